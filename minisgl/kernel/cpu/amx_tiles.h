/* What the AMX kernels (amx.c, attn_amx.c) share: the tile state (Linux's permission, the one
 * tile configuration both use), a per-thread scratch buffer and the 16 x 16 32-bit transpose. Included
 * only under the AMX build guard of those files. */
#ifndef MINISGL_AMX_TILES_H
#define MINISGL_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

static int amx_state = -1; /* per translation unit; asking twice is harmless */
/* Linux hands out the 8 KiB tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA),
 * once per process. */
static int amx_request(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
}
static void amx_config(void) { /* 8 tiles of 16 rows x 64 bytes: C 0-3, A 4-5, B 6-7 */
    amx_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* One 16 x 16 transpose of 32-bit elements: out[j * 16 + i] = row i's element j, row i read at
 * src + i * stride (bytes). 64 shuffles in registers (16 gathers per tile were slower). It
 * packs bf16 pairs into the tile unit's pair-interleaved (VNNI) B layout and turns fp32 C tiles
 * of the transposed product back into rows. */
static inline void transpose16(const void *src, long stride, uint32_t *out) {
    __m512i r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const char *)src + i * stride);
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i v = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v2 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        __m512i x = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), x2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        _mm512_storeu_si512(out + (0 + j) * 16, _mm512_shuffle_i32x4(v, x, 0x88));
        _mm512_storeu_si512(out + (8 + j) * 16, _mm512_shuffle_i32x4(v, x, 0xDD));
        _mm512_storeu_si512(out + (4 + j) * 16, _mm512_shuffle_i32x4(v2, x2, 0x88));
        _mm512_storeu_si512(out + (12 + j) * 16, _mm512_shuffle_i32x4(v2, x2, 0xDD));
    }
}

/* A per-thread buffer that only grows (no page faults per call); NULL when it cannot. */
static void *amx_scratch(long bytes) {
    static __thread void *buf;
    static __thread long cap;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + 4095) & ~4095l;
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}
#endif
