/* bf16 GEMM on AMX tiles for prefill and large decode batches: y[m, n] = bf16(x[m, :] . w[n, :]
 * (+ bias[n])), x and w row-major bf16 (the module's own weight, no packed copy kept).
 *
 * Why: oneDNN's bf16 linear on a plain weight re-packs the whole weight into a buffer on every
 * call (the weight crosses memory three times). Here it is packed per 32 output rows into the
 * tile unit's pair-interleaved (VNNI) layout right before use, in L1/L2, for every block of
 * activation rows, and never stored: one pass over the weight. fp32 accumulation, one
 * rounding to bf16 (results differ from oneDNN's by summation order).
 *
 * Returns 0 (caller falls back to torch) without AMX at compile time, when Linux refuses the tile
 * state, or for shapes it does not tile (k % 32, n % 16).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

static int amx_state = -1;
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

/* Rows [n0, n0 + 16) of w [., k] as k / 32 B tiles: out[q][p][i] = the bf16 pair
 * w[n0 + i][32 q + 2 p .. + 1], one 16 x 16 transpose of 32-bit pairs per tile (64 shuffles;
 * 16 gathers per tile were ~2x slower at 64 rows). */
static void pack_w16(const uint16_t *w, long k, long n0, uint32_t *out) {
    const uint16_t *base = w + n0 * k;
    for (long q = 0; q < k / 32; q++) {
        __m512i r[16], t[16], u[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(base + i * k + q * 32);
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
        uint32_t *o = out + q * 256;
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v2 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
            __m512i x = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88), x2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
            _mm512_storeu_si512(o + (0 + j) * 16, _mm512_shuffle_i32x4(v, x, 0x88));
            _mm512_storeu_si512(o + (8 + j) * 16, _mm512_shuffle_i32x4(v, x, 0xDD));
            _mm512_storeu_si512(o + (4 + j) * 16, _mm512_shuffle_i32x4(v2, x2, 0x88));
            _mm512_storeu_si512(o + (12 + j) * 16, _mm512_shuffle_i32x4(v2, x2, 0xDD));
        }
    }
}

static void store_tile(const float *c, long row0, long m, long col0, long n, const uint16_t *bias, uint16_t *y) {
    __m512 b = _mm512_setzero_ps();
    if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + col0))), 16));
    for (int r = 0; r < 16 && row0 + r < m; r++) {
        __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b));
        _mm256_storeu_si256((__m256i *)(y + (row0 + r) * n + col0), (__m256i)v);
    }
}

int gemm_amx_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k,
                  const uint16_t *bias, uint16_t *y, int nthreads) {
    if (k % 32 || n % 16 || m < 1 || k * 2 > (1l << 30) || !amx_request()) return 0;
    const long mb = (m + 15) / 16, kb = k / 32, pairs = (n / 16 + 1) / 2;
    /* the last partial block of x rows, zero-padded, so every A tile load stays in bounds */
    uint16_t *xpad = NULL;
    if (m % 16) {
        xpad = calloc(16 * k, sizeof(uint16_t));
        if (!xpad) return 0;
        for (long r = 0; r < m % 16; r++) memcpy(xpad + r * k, x + ((mb - 1) * 16 + r) * ldx, k * 2);
    }
    int nt = pairs < nthreads ? (int)pairs : nthreads;
#pragma omp parallel num_threads(nt)
    {
        amx_config();
        uint32_t *wp = aligned_alloc(64, 2 * kb * 256 * sizeof(uint32_t));
        float *cb = aligned_alloc(64, 4 * 256 * sizeof(float));
#pragma omp for schedule(static)
        for (long j = 0; j < pairs; j++) { /* 32 output columns: two B tiles */
            long n0 = j * 32;
            int two = n0 + 16 < n;
            pack_w16(w, k, n0, wp);
            if (two) pack_w16(w, k, n0 + 16, wp + kb * 256);
            for (long i = 0; i < mb; i += 2) { /* 32 rows: two A tiles */
                int two_m = i + 1 < mb;
                const uint16_t *a0 = (xpad && i == mb - 1) ? xpad : x + i * 16 * ldx;
                const uint16_t *a1 = (xpad && i + 1 == mb - 1) ? xpad : x + (i + 1) * 16 * ldx;
                long s0 = (a0 == xpad ? k : ldx) * 2, s1 = (a1 == xpad ? k : ldx) * 2;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (long q = 0; q < kb; q++) {
                    _tile_loadd(4, a0 + q * 32, s0);
                    _tile_loadd(6, wp + q * 256, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, wp + (kb + q) * 256, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (two_m) {
                        _tile_loadd(5, a1 + q * 32, s1);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, cb, 64);
                _tile_stored(1, cb + 256, 64);
                _tile_stored(2, cb + 512, 64);
                _tile_stored(3, cb + 768, 64);
                store_tile(cb, i * 16, m, n0, n, bias, y);
                if (two) store_tile(cb + 256, i * 16, m, n0 + 16, n, bias, y);
                if (two_m) store_tile(cb + 512, (i + 1) * 16, m, n0, n, bias, y);
                if (two_m && two) store_tile(cb + 768, (i + 1) * 16, m, n0 + 16, n, bias, y);
            }
        }
        free(wp);
        free(cb);
        _tile_release();
    }
    free(xpad);
    return 1;
}
int amx_available(void) { return amx_request(); }
#else
int gemm_amx_bf16(const void *x, long ldx, long m, const void *w, long n, long k, const void *bias,
                  void *y, int nthreads) {
    (void)x, (void)ldx, (void)m, (void)w, (void)n, (void)k, (void)bias, (void)y, (void)nthreads;
    return 0;
}
int amx_available(void) { return 0; }
#endif
