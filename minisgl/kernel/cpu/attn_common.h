/* What the CPU decode attention kernels (kernels.c, kv_int8.c) share: the online-softmax
 * arithmetic and the prefetch of a request's scattered key rows. */
#ifndef MINISGL_ATTN_COMMON_H
#define MINISGL_ATTN_COMMON_H
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

#ifdef __AVX512F__
#include <immintrin.h>
/* 16 vectors -> one: lane b = the sum of d[b]'s 16 lanes. A shuffle tree (45 ops) in place of
 * 16 horizontal reductions (~9 dependent ops each), which dominated the per-key score cost. */
static inline __m512 hsum16x16(__m512 d[16]) {
    __m512 e[8], f[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [k2i, k2i+1, k2i, k2i+1] partials */
        e[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                             _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: [k4i .. k4i+3] partials */
        __m512d a = _mm512_castps_pd(e[2 * i]), b = _mm512_castps_pd(e[2 * i + 1]);
        f[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* across the four 128-bit lanes */
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x88), _mm512_shuffle_f32x4(f[0], f[1], 0xDD));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], 0x88), _mm512_shuffle_f32x4(f[2], f[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}
/* Keys [b0, b1) of a request (its pool slots; row = slot * hk + kh): their K and V rows of
 * row_bytes each, and with k_scale non-NULL their int8 scales, prefetched with `hint`. The
 * kernels prefetch the next 16-key block into L1 and one further ahead into L2: the rows are
 * scattered over the pool, so without the far one too few DRAM reads are in flight
 * (docs/PERFORMANCE.md). */
#define PREFETCH_KV_ROWS(k_cache, v_cache, k_scale, v_scale, slots, b0, b1, n, hk, kh, row_bytes, hint) \
    for (long b_ = (b0); b_ < (b1) && b_ < (n); b_++) {                                           \
        long row_ = (long)(slots)[b_] * (hk) + (kh);                                              \
        for (int off_ = 0; off_ < (row_bytes); off_ += 64) {                                      \
            _mm_prefetch((const char *)(k_cache) + row_ * (row_bytes) + off_, hint);              \
            _mm_prefetch((const char *)(v_cache) + row_ * (row_bytes) + off_, hint);              \
        }                                                                                         \
        if (k_scale) {                                                                            \
            _mm_prefetch((const char *)((k_scale) + row_), hint);                                 \
            _mm_prefetch((const char *)((v_scale) + row_), hint);                                 \
        }                                                                                         \
    }
#define ATTN_PF_FAR_BF16 32 /* keys ahead for the L2 prefetch (a sweep of 32 / 48 / 64) */
#define ATTN_PF_FAR_INT8 48 /* the same sweep's winner for the int8 pool */

/* One 16-key block of the online softmax: scores sv (dead lanes already -inf) raise the running
 * max *mx (the nv accumulators and *den rescaled when it moves), add their exps to *den, and
 * come back as those exps, dead lanes 0. */
static inline __m512 softmax_block(__m512 sv, __mmask16 live, float *mx, float *den, __m512 *acc, int nv) {
    float bm = _mm512_reduce_max_ps(sv);
    if (bm > *mx) {
        float corr = fast_exp(*mx - bm);
        *den *= corr;
        for (int c = 0; c < nv; c++) acc[c] = _mm512_mul_ps(acc[c], _mm512_set1_ps(corr));
        *mx = bm;
    }
    __m512 pv = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(*mx))));
    *den += _mm512_reduce_add_ps(pv);
    return pv;
}
#endif
#endif
