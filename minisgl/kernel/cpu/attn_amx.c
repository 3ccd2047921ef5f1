/* Causal prefill attention on AMX tiles (bf16 in, fp32 scores, bf16 out), for a prompt whose
 * keys are its own rows (no cached prefix): out[i, h] = softmax(q_i . k_j * scale, j <= i) v.
 *
 * Why: torch's SDPA (its CPU flash kernel) is a quarter of a 500-token prefill on one core, far
 * from the tiles' rate; this is several times faster at 100-1000 tokens (docs/PERFORMANCE.md).
 * Per 32 queries of one head: S = Q K^T on tiles into an fp32 row block (the whole causal row,
 * <= n keys: no online rescaling), an exact row softmax in AVX-512 written as bf16 weights P
 * (unnormalized, in [0, 1]), then O = P V on tiles and one division by the row sum. K^T and V are packed once per KV head into the tiles' layouts and
 * shared by the GQA query heads of that KV head. q, k, v are read in place from the fused qkv
 * rows.
 *
 * Returns 0 (caller uses SDPA) without AMX, for head_dim % 32 or > 256, or hq % hk.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"


/* exp(x) for x <= 0, good to 1.2e-4 relative (a least-squares cubic) (the weights are rounded to bf16, 4e-3, next):
 * 2^(x log2 e) as 2^n by the exponent (scalef) and 2^f, f in [-0.5, 0.5], by a cubic. */
static inline __m512 attn_exp(__m512 x) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(0.05459283f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24221838f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69336869f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Packs one KV head: K^T as B tiles kt[key block of 16][d chunk of 32] (a transpose of bf16
 * pairs), V as B tiles vt[key block of 32][d tile of 16] (pairs of consecutive keys
 * interleaved); keys past n, up to a multiple of 32, are zero. */
static void pack_kv(const uint16_t *k, const uint16_t *v, long ld, long n, long d, uint32_t *kt, uint32_t *vt,
                    uint16_t *pad) {
    const long dc = d / 32, nk32 = (n + 31) / 32;
    for (long b = 0; b < 2 * nk32; b++) {
        const uint16_t *rows = k + b * 16 * ld;
        long stride = ld;
        if (b * 16 + 16 > n) { /* the last partial blocks through a zeroed copy */
            memset(pad, 0, 16 * d * 2);
            for (long r = 0; b * 16 + r < n; r++) memcpy(pad + r * d, rows + r * ld, d * 2);
            rows = pad, stride = d;
        }
        for (long c = 0; c < dc; c++) transpose16(rows + c * 32, stride * 2, kt + (b * dc + c) * 256);
    }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                        36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (long b = 0; b < nk32; b++) {
        for (long p = 0; p < 16; p++) { /* keys 2p, 2p + 1 of the block */
            long k0 = b * 32 + 2 * p, k1 = k0 + 1;
            for (long c = 0; c < d / 32; c++) {
                __m512i a = k0 < n ? _mm512_loadu_si512(v + k0 * ld + c * 32) : _mm512_setzero_si512();
                __m512i e = k1 < n ? _mm512_loadu_si512(v + k1 * ld + c * 32) : _mm512_setzero_si512();
                /* d tile 2c gets columns 0-15 of the pair, tile 2c + 1 columns 16-31 */
                _mm512_storeu_si512(vt + ((b * (d / 16) + 2 * c) * 16 + p) * 16, _mm512_permutex2var_epi16(a, lo, e));
                _mm512_storeu_si512(vt + ((b * (d / 16) + 2 * c + 1) * 16 + p) * 16, _mm512_permutex2var_epi16(a, hi, e));
            }
        }
    }
}

/* 32 queries [r0, r0 + 32) of one head against keys [0, min(n, r0 + 32)) */
static void attend_block(const uint16_t *q, long ld, long n, long d, float scale, const uint32_t *kt, const uint32_t *vt,
                         long r0, uint16_t *out, long ldo, float *s, uint16_t *pb, float *cb, uint16_t *qpad) {
    const long dc = d / 32, kend = n < r0 + 32 ? n : r0 + 32, nk32 = (kend + 31) / 32, lds = nk32 * 32;
    const int two_m = r0 + 16 < n;
    const uint16_t *q0 = q + r0 * ld, *q1 = q0 + 16 * ld;
    long sq0 = ld * 2, sq1 = ld * 2;
    if (r0 + 32 > n) { /* partial query block: rows past n from a zeroed copy */
        memset(qpad, 0, 32 * d * 2);
        for (long r = 0; r0 + r < n; r++) memcpy(qpad + r * d, q0 + r * ld, d * 2);
        q0 = qpad, q1 = qpad + 16 * d, sq0 = sq1 = d * 2;
    }
    for (long b = 0; b < nk32; b++) { /* S[:, 32 b .. + 32] = Q K^T: 2 x 2 tiles */
        const uint32_t *k0 = kt + (2 * b) * dc * 256, *k1 = k0 + dc * 256;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long c = 0; c < dc; c++) {
            _tile_loadd(4, q0 + c * 32, sq0);
            _tile_loadd(6, k0 + c * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, k1 + c * 256, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (two_m) {
                _tile_loadd(5, q1 + c * 32, sq1);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, s + b * 32, lds * 4);
        _tile_stored(1, s + b * 32 + 16, lds * 4);
        _tile_stored(2, s + 16 * lds + b * 32, lds * 4);
        _tile_stored(3, s + 16 * lds + b * 32 + 16, lds * 4);
    }
    float inv[32];
    const long rows = two_m ? 32 : 16;
    for (long r = 0; r < rows; r++) { /* row softmax over keys <= query r0 + r, as bf16 weights */
        const long live = r0 + r < n ? r0 + r + 1 : 0;
        float *sr = s + r * lds;
        uint16_t *pr = pb + r * lds;
        __m512 mx = _mm512_set1_ps(-3.0e38f);
        for (long j = 0; j < live; j += 16) {
            __mmask16 mk = live - j >= 16 ? 0xffff : (__mmask16)((1u << (live - j)) - 1);
            mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_loadu_ps(sr + j));
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale), sc = _mm512_set1_ps(scale);
        __m512 sum = _mm512_setzero_ps();
        for (long j = 0; j < lds; j += 32) {
            __mmask16 m0 = live - j >= 16 ? 0xffff : (live > j ? (__mmask16)((1u << (live - j)) - 1) : 0);
            __mmask16 m1 = live - j - 16 >= 16 ? 0xffff : (live > j + 16 ? (__mmask16)((1u << (live - j - 16)) - 1) : 0);
            __m512 e0 = _mm512_maskz_mov_ps(m0, attn_exp(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), sc, m)));
            __m512 e1 = _mm512_maskz_mov_ps(m1, attn_exp(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j + 16), sc, m)));
            sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
            _mm512_storeu_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        float tot = _mm512_reduce_add_ps(sum);
        inv[r] = tot > 0 ? 1.0f / tot : 0.0f;
    }
    for (long dp = 0; dp < d / 32; dp++) { /* O[:, 32 dp .. + 32] = P V: 2 x 2 tiles */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long b = 0; b < nk32; b++) {
            const uint32_t *v0 = vt + (b * (d / 16) + 2 * dp) * 256, *v1 = v0 + 256;
            _tile_loadd(4, pb + b * 32, lds * 2);
            _tile_loadd(6, v0, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, v1, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (two_m) {
                _tile_loadd(5, pb + 16 * lds + b * 32, lds * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, cb, 128);
        _tile_stored(1, cb + 16, 128);
        _tile_stored(2, cb + 512, 128);
        _tile_stored(3, cb + 528, 128);
        for (long r = 0; r < rows && r0 + r < n; r++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(cb + r * 32), _mm512_set1_ps(inv[r]));
            __m512 e = _mm512_mul_ps(_mm512_loadu_ps(cb + r * 32 + 16), _mm512_set1_ps(inv[r]));
            _mm512_storeu_si512(out + (r0 + r) * ldo + dp * 32, (__m512i)_mm512_cvtne2ps_pbh(e, a));
        }
    }
}

int prefill_attention_amx_bf16(const uint16_t *qkv, long ld, long n, long hq, long hk, long d, float scale,
                               uint16_t *out, long ldo, int nthreads) {
    if (d % 32 || d > 256 || n < 1 || hk < 1 || hq % hk || !amx_request()) return 0;
    const long nk32 = (n + 31) / 32, lds = nk32 * 32, nqb = (n + 31) / 32;
    const long kt_sz = 2 * nk32 * (d / 32) * 256, vt_sz = nk32 * (d / 16) * 256; /* dwords per KV head */
    uint32_t *kv = aligned_alloc(64, hk * (kt_sz + vt_sz) * 4);
    if (!kv) return 0;
    const long g = hq / hk, items = hq * nqb;
    int ok = 1;
#pragma omp parallel num_threads(nthreads) reduction(& : ok)
    {
        amx_config();
        char *buf = amx_scratch(32 * lds * 4 + 32 * lds * 2 + 32 * 32 * 4 + 64 * d * 2 + 256);
        if (!buf) ok = 0;
        float *s = (float *)buf, *cb = s + 32 * lds;
        uint16_t *pb = (uint16_t *)(cb + 32 * 32), *pad = pb + 32 * lds;
#pragma omp for schedule(static)
        for (long h = 0; h < hk; h++)
            if (buf) pack_kv(qkv + (hq + h) * d, qkv + (hq + hk + h) * d, ld, n, d, kv + h * (kt_sz + vt_sz),
                             kv + h * (kt_sz + vt_sz) + kt_sz, pad);
        /* longest causal rows first, so the dynamic schedule ends level */
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items; it++) {
            long qb = nqb - 1 - it / hq, h = it % hq, kh = h / g;
            if (buf)
                attend_block(qkv + h * d, ld, n, d, scale, kv + kh * (kt_sz + vt_sz), kv + kh * (kt_sz + vt_sz) + kt_sz,
                             qb * 32, out + h * d, ldo, s, pb, cb, pad);
        }
        _tile_release();
    }
    free(kv);
    return ok;
}
#else
int prefill_attention_amx_bf16(const void *qkv, long ld, long n, long hq, long hk, long d, float scale, void *out,
                               long ldo, int nthreads) {
    (void)qkv, (void)ld, (void)n, (void)hq, (void)hk, (void)d, (void)scale, (void)out, (void)ldo, (void)nthreads;
    return 0;
}
#endif
