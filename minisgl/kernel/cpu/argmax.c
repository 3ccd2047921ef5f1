/* Greedy sampling's argmax over the logits rows, on the CPU (engine/sample.py).
 *
 * Why: torch's CPU argmax scans a large batch of logits on one thread, after a bf16 -> fp32
 * cast: a visible part of a 64-row decode step of the embedded model (docs/PERFORMANCE.md). Here
 * each row is one pass over its bf16 (or fp32) values, rows split over threads.
 *
 * Semantics are torch.argmax's: the first index of the largest value; a NaN counts as larger
 * than everything, so the first NaN wins.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

static long argmax_scalar_f(const float *v, long n) {
    long best = 0;
    for (long i = 0; i < n; i++) {
        if (isnan(v[i])) return i;
        if (v[i] > v[best]) best = i;
    }
    return best;
}

static long argmax_scalar_bf16(const uint16_t *v, long n) {
    long best = 0;
    float bv = bf16_to_f(v[0]);
    for (long i = 0; i < n; i++) {
        float x = bf16_to_f(v[i]);
        if (isnan(x)) return i;
        if (x > bv) best = i, bv = x;
    }
    return best;
}

#ifdef __AVX512F__
#include <immintrin.h>
/* 16 lanes, each keeping its first maximum (strict >, so a later equal value never replaces
 * it); lanes then reduce to the smallest index among those at the overall max. A NaN in the
 * row sends it to the scalar scan, which finds the first one. */
static long argmax16(const void *p, long n, int bf16) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i idx = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16))
                        : _mm512_loadu_ps((const float *)p + i);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        __mmask16 gt = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, x);
        idx = _mm512_mask_mov_epi32(idx, gt, cur);
        cur = _mm512_add_epi32(cur, step);
    }
    if (nan) return -1;
    float m = _mm512_reduce_max_ps(best);
    long out = n; /* smallest index at the max */
    float bl[16];
    int32_t il[16];
    _mm512_storeu_ps(bl, best);
    _mm512_storeu_si512(il, idx);
    if (i > 0)
        for (int l = 0; l < 16; l++)
            if (bl[l] == m && il[l] < out) out = il[l];
    float bm = i > 0 ? m : -INFINITY;
    for (; i < n; i++) { /* the tail: later than every lane's index */
        float x = bf16 ? bf16_to_f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
        if (isnan(x)) return -1;
        if (x > bm) bm = x, out = i;
    }
    if (out == n) out = 0; /* every value -inf: torch returns 0 */
    return out;
}
#endif

/* out[r] = argmax of row r (x + r * ld, n values). */
#define DEFINE_ARGMAX(SUF, T, IS_BF16)                                                           \
void argmax_rows_##SUF(const T *x, long rows, long n, long ld, int64_t *out, int nthreads) {     \
    int nt = rows * n < (1 << 18) ? 1 : nthreads;                                                \
    _Pragma("omp parallel for num_threads(nt)")                                                  \
    for (long r = 0; r < rows; r++) {                                                            \
        const T *row = x + r * ld;                                                               \
        long best = -1;                                                                          \
        FAST_ARGMAX(IS_BF16)                                                                     \
        out[r] = best >= 0 ? best : argmax_scalar_##SUF(row, n);                                 \
    }                                                                                            \
}
#ifdef __AVX512F__
#define FAST_ARGMAX(IS_BF16) best = argmax16(row, n, IS_BF16);
#else
#define FAST_ARGMAX(IS_BF16)
#endif
#define argmax_scalar_f32 argmax_scalar_f
DEFINE_ARGMAX(f32, float, 0)
DEFINE_ARGMAX(bf16, uint16_t, 1)
