/* Skinny bf16 GEMM for small decode batches: y[m, n] = bf16(x[m, :] . w[n, :] (+ bias[n])).
 *
 * Why: at one to a few rows a decode GEMM is a pure stream of the weight matrix, and oneDNN's
 * bf16 linear on a plain [N, K] weight re-packs it into its blocked layout on every call (the
 * weight crosses memory twice). Here the weight is read once, in the row-major layout the module
 * already stores (no second copy), with VDPBF16PS: 32 bf16 products per instruction, summed in
 * fp32 like oneDNN (results differ from it by summation order only). A tile of R weight rows is
 * dotted with every activation row while it sits in L1, so M rows cost one pass over the weight.
 *
 * Without AVX512-BF16 at compile time skinny_avx2.c has the same entry point for AVX2 + FMA;
 * without either it reports 0 (not available) and the caller keeps torch's GEMM.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if MINISGL_SKINNY_ISA == 512
#include <immintrin.h>
#include <omp.h>

#include "vec_math.h"
/* Prefetch distances in tiles (R weight rows each): the next tile into L1, the one PF_L2 ahead
 * into L2; the pair won a sweep on a batch-1 bf16 decode step (docs/PERFORMANCE.md). */
#ifndef PF_DIST
#define PF_DIST 1
#endif
#ifndef PF_L2
#define PF_L2 4
#endif

/* The sum of a vector's 16 lanes in one fixed tree: lanes (i, i + 8), then (i, i + 4), then
 * (i, i + 2), then (i, i + 1). Written out rather than _mm512_reduce_add_ps (whose tree is the
 * compiler's: GCC's is this one) because hsum16_fixed below must give the same bits. */
static inline float hsum_fixed(__m512 a) {
    __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
    __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}

/* hsum_fixed of 16 vectors at once, the same additions in the same tree: lane L of the result
 * is hsum_fixed(v[L]). Each level adds two vectors' halves side by side (a shuffle per operand
 * instead of a horizontal reduction per vector). */
static inline __m512 hsum16_fixed(const __m512 v[16]) {
    __m512 e[8], f[4], g[2];
    /* lane order in: the transposed 4 x 4 order, so that lanes come out in natural order */
    for (int p = 0; p < 8; p++) { /* (i, i + 8): quarters 0-1 of e[p] from one vector, 2-3 from the other */
        __m512 a = v[4 * ((2 * p) % 4) + (2 * p) / 4], b = v[4 * ((2 * p + 1) % 4) + (2 * p + 1) / 4];
        e[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int r = 0; r < 4; r++) /* (i, i + 4): one quarter per vector */
        f[r] = _mm512_add_ps(_mm512_shuffle_f32x4(e[2 * r], e[2 * r + 1], 0x88), _mm512_shuffle_f32x4(e[2 * r], e[2 * r + 1], 0xDD));
    for (int q = 0; q < 2; q++) { /* (i, i + 2) within each quarter */
        __m512d a = _mm512_castps_pd(f[2 * q]), b = _mm512_castps_pd(f[2 * q + 1]);
        g[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* (i, i + 1) */
    return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
}

/* R weight rows (n0 ..) against M activation rows; R * M <= 16 accumulators. always_inline with
 * constant R and M: the compiler unrolls both loops and keeps the accumulators in registers. */
static inline __attribute__((always_inline)) void gemv_tile(
    const uint16_t *x, long ldx, const uint16_t *w, long k, long n0, const uint16_t *bias,
    uint16_t *y, long ldy, const int R, const int M) {
    __m512 acc[R][M];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    const uint16_t *wr = w + n0 * k;
    /* Weight rows are short (1-3 KiB): too short for the hardware prefetcher to ramp up on
     * each, so the tiles PF_DIST and PF_L2 ahead are prefetched in address order, R lines each
     * per step (the L2 one keeps enough DRAM reads in flight to stream). */
    const char *pf = (const char *)(wr + PF_DIST * R * k), *pf2 = (const char *)(wr + PF_L2 * R * k);
    long kk = 0;
    for (; kk + 32 <= k; kk += 32, pf += R * 64, pf2 += R * 64) {
        for (int r = 0; r < R; r++) _mm_prefetch(pf + r * 64, _MM_HINT_T0);
        for (int r = 0; r < R; r++) _mm_prefetch(pf2 + r * 64, _MM_HINT_T1);
        __m512bh xv[M];
        for (int m = 0; m < M; m++) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + kk);
        for (int r = 0; r < R; r++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + r * k + kk);
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
        }
    }
    if (kk < k) { /* masked tail: zeros contribute nothing */
        __mmask32 live = (__mmask32)((1ull << (k - kk)) - 1ull);
        __m512bh xv[M];
        for (int m = 0; m < M; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(live, x + m * ldx + kk);
        for (int r = 0; r < R; r++) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(live, wr + r * k + kk);
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
        }
    }
    for (int r = 0; r < R; r++) {
        float b = bias ? bf16_to_f(bias[n0 + r]) : 0.f;
        for (int m = 0; m < M; m++) y[m * ldy + n0 + r] = f_to_bf16(hsum_fixed(acc[r][m]) + b);
    }
}

/* 4 weight rows (n0 ..) x 4 activation rows: gemv_tile's accumulator chains, then one
 * hsum16_fixed for the 16 outputs instead of 16 reductions, so each output has gemv_tile's bits
 * (tests/test_batch_invariant_cpu.py checks rows alone against rows inside large batches). */
static inline __attribute__((always_inline)) void gemm_tile4x4(const uint16_t *x, long ldx, const uint16_t *w, long k,
                                                               long n0, const uint16_t *bias, uint16_t *y, long ldy) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const uint16_t *wr = w + n0 * k;
    long kk = 0;
    for (; kk + 32 <= k; kk += 32) {
        __m512bh xv[4];
        for (int m = 0; m < 4; m++) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + kk);
        for (int r = 0; r < 4; r++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + r * k + kk);
            for (int m = 0; m < 4; m++) acc[r * 4 + m] = _mm512_dpbf16_ps(acc[r * 4 + m], wv, xv[m]);
        }
    }
    if (kk < k) {
        __mmask32 live = (__mmask32)((1ull << (k - kk)) - 1ull);
        __m512bh xv[4];
        for (int m = 0; m < 4; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(live, x + m * ldx + kk);
        for (int r = 0; r < 4; r++) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(live, wr + r * k + kk);
            for (int m = 0; m < 4; m++) acc[r * 4 + m] = _mm512_dpbf16_ps(acc[r * 4 + m], wv, xv[m]);
        }
    }
    float sums[16];
    _mm512_storeu_ps(sums, hsum16_fixed(acc));
    for (int r = 0; r < 4; r++) {
        float b = bias ? bf16_to_f(bias[n0 + r]) : 0.f;
        for (int m = 0; m < 4; m++) y[m * ldy + n0 + r] = f_to_bf16(sums[r * 4 + m] + b);
    }
}

/* Many activation rows over weight rows [lo, hi): blocks of GEMM_NB weight rows (they stay in
 * L2) passed by every 4-row block of x; edges (fewer than 4 rows either way) by gemv_tile. */
#ifndef GEMM_NB
#define GEMM_NB 64
#endif
static void gemm_rows(const uint16_t *x, long ldx, long m, const uint16_t *w, long k, long lo, long hi,
                      const uint16_t *bias, uint16_t *y, long ldy) {
    for (long nb = lo; nb < hi; nb += GEMM_NB) {
        long ne = nb + GEMM_NB < hi ? nb + GEMM_NB : hi;
        long m0 = 0;
        for (; m0 + 4 <= m; m0 += 4) {
            long n = nb;
            for (; n + 4 <= ne; n += 4) gemm_tile4x4(x + m0 * ldx, ldx, w, k, n, bias, y + m0 * ldy, ldy);
            for (; n < ne; n++) gemv_tile(x + m0 * ldx, ldx, w, k, n, bias, y + m0 * ldy, ldy, 1, 4);
        }
        for (; m0 < m; m0++)
            for (long n = nb; n < ne; n++) gemv_tile(x + m0 * ldx, ldx, w, k, n, bias, y + m0 * ldy, ldy, 1, 1);
    }
}

/* One block of M (<= 8) activation rows over weight rows [lo, hi). */
static void gemv_rows(const uint16_t *x, long ldx, long M, const uint16_t *w, long k, long lo,
                      long hi, const uint16_t *bias, uint16_t *y, long ldy) {
    long n = lo;
#define GEMV_CASE(MM, RR)                                                                         \
    case MM:                                                                                      \
        for (; n + RR <= hi; n += RR) gemv_tile(x, ldx, w, k, n, bias, y, ldy, RR, MM);           \
        for (; n < hi; n++) gemv_tile(x, ldx, w, k, n, bias, y, ldy, 1, MM);                      \
        break;
    switch (M) {
        GEMV_CASE(1, 8)
        GEMV_CASE(2, 4)
        GEMV_CASE(3, 4)
        GEMV_CASE(4, 4)
        GEMV_CASE(5, 2)
        GEMV_CASE(6, 2)
        GEMV_CASE(7, 2)
        GEMV_CASE(8, 2)
    }
#undef GEMV_CASE
}

/* Returns 1 when it ran, 0 when this build cannot (the caller falls back). Rows of x and y are
 * contiguous with strides ldx / n. The weight rows are split over the threads in 16-row chunks
 * (static schedule: each thread streams one contiguous range); each thread runs every
 * activation row over its chunk, 8 rows at a time. */
#ifndef GEMM_MIN_ROWS
#define GEMM_MIN_ROWS 4 /* from here on gemm_rows (2x gemv_rows at 4-8 rows, 3-10x at 150: docs/PERFORMANCE.md) */
#endif
int gemv_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k,
              const uint16_t *bias, uint16_t *y, int nthreads) {
    long chunk = 16; /* o/down have 576 rows: 64-row chunks split them 5:4 over two threads */
    long nchunks = (n + chunk - 1) / chunk;
    int nt = n * k < (1l << 16) ? 1 : nthreads;
    if (m >= GEMM_MIN_ROWS) {
        /* each thread one contiguous range of weight rows (whole 16-row chunks) */
#pragma omp parallel num_threads(nt)
        {
            int t = omp_get_thread_num(), T = omp_get_num_threads();
            long lo = nchunks * t / T * chunk, hi = nchunks * (t + 1) / T * chunk;
            gemm_rows(x, ldx, m, w, k, lo, hi < n ? hi : n, bias, y, n);
        }
        return 1;
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long c = 0; c < nchunks; c++) {
        long lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
        for (long m0 = 0; m0 < m; m0 += 8) {
            long mm = m - m0 < 8 ? m - m0 : 8;
            gemv_rows(x + m0 * ldx, ldx, mm, w, k, lo, hi, bias, y + m0 * n, n);
        }
    }
    return 1;
}

/* The same product on a weight in VNNI tiles (amx.c's gemm_amx_vnni_bf16 layout: w[n / 16][k / 32]
 * tiles of 16 pair rows x 16 output rows): each 64-byte tile row holds one bf16 pair of 16
 * outputs, so one VDPBF16PS with the activation's pair broadcast adds it to the 16 outputs' lanes
 * (no horizontal sums), and each 16-row block is one contiguous stream. JB blocks at a time keep
 * JB x M accumulator chains in flight. */
#ifndef VNNI_JB1
#define VNNI_JB1 8 /* 16-row blocks at a time for one row (a sweep of 2 / 4 / 6 / 8: docs/PERFORMANCE.md) */
#endif
#ifndef VNNI_PF
#define VNNI_PF 1024 /* bytes ahead of each block's stream, into L2 (the 120 GEMMs of a batch-1 step: 512 B-8 KiB within noise) */
#endif
static inline __attribute__((always_inline)) void gemv_vnni_tile(
    const uint16_t *x, long ldx, const uint32_t *w, long kb, long jb0, const uint16_t *bias, uint16_t *y,
    long ldy, const int JB, const int M) {
    __m512 acc[JB][M];
    for (int j = 0; j < JB; j++)
        for (int m = 0; m < M; m++) acc[j][m] = _mm512_setzero_ps();
    const uint32_t *wb[JB];
    for (int j = 0; j < JB; j++) wb[j] = w + (jb0 + j) * kb * 256;
    for (long q = 0; q < kb; q++) {
        for (int j = 0; j < JB; j++)
            for (int l = 0; l < 1024; l += 64) _mm_prefetch((const char *)(wb[j] + q * 256) + VNNI_PF + l, _MM_HINT_T1);
        for (int p = 0; p < 16; p++) {
            __m512bh xv[M];
            for (int m = 0; m < M; m++) {
                uint32_t pair;
                memcpy(&pair, x + m * ldx + q * 32 + 2 * p, 4);
                xv[m] = (__m512bh)_mm512_set1_epi32((int)pair);
            }
            for (int j = 0; j < JB; j++) {
                __m512bh wv = (__m512bh)_mm512_loadu_si512(wb[j] + q * 256 + p * 16);
                for (int m = 0; m < M; m++) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv, xv[m]);
            }
        }
    }
    for (int j = 0; j < JB; j++) {
        long n0 = (jb0 + j) * 16;
        __m512 b = bias ? bf16x16_to_f(_mm256_loadu_si256((const __m256i *)(bias + n0))) : _mm512_setzero_ps();
        for (int m = 0; m < M; m++)
            _mm256_storeu_si256((__m256i *)(y + m * ldy + n0), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[j][m], b)));
    }
}

/* y = x w^T for the few rows of a decode step, w in VNNI tiles (n % 16 == 0, k % 32 == 0; 0 if
 * not). The 16-row blocks are split over the threads; every activation row runs over each. */
int gemv_vnni_bf16(const uint16_t *x, long ldx, long m, const uint32_t *w, long n, long k,
                   const uint16_t *bias, uint16_t *y, int nthreads) {
    if (n % 16 || k % 32 || m < 1) return 0;
    const long nb = n / 16, kb = k / 32;
    int nt = n * k < (1l << 16) ? 1 : nthreads;
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        long b0 = nb * t / T, b1 = nb * (t + 1) / T;
        for (long m0 = 0; m0 < m; m0 += 4) {
            const uint16_t *xm = x + m0 * ldx;
            uint16_t *ym = y + m0 * n;
            long jb = b0;
#define VNNI_CASE(MM, JJ)                                                                          \
    case MM:                                                                                       \
        for (; jb + JJ <= b1; jb += JJ) gemv_vnni_tile(xm, ldx, w, kb, jb, bias, ym, n, JJ, MM);   \
        for (; jb < b1; jb++) gemv_vnni_tile(xm, ldx, w, kb, jb, bias, ym, n, 1, MM);              \
        break;
            switch (m - m0 < 4 ? m - m0 : 4) {
                VNNI_CASE(1, VNNI_JB1)
                VNNI_CASE(2, 4)
                VNNI_CASE(3, 2)
                VNNI_CASE(4, 2)
            }
#undef VNNI_CASE
        }
    }
    return 1;
}
int gemv_available(void) { return 1; }
#else
int gemv_vnni_bf16(const void *x, long ldx, long m, const void *w, long n, long k, const void *bias,
                   void *y, int nthreads) { /* VNNI tiles exist only beside AMX */
    (void)x, (void)ldx, (void)m, (void)w, (void)n, (void)k, (void)bias, (void)y, (void)nthreads;
    return 0;
}
#if MINISGL_SKINNY_ISA == 0
int gemv_bf16(const void *x, long ldx, long m, const void *w, long n, long k, const void *bias,
              void *y, int nthreads) {
    (void)x, (void)ldx, (void)m, (void)w, (void)n, (void)k, (void)bias, (void)y, (void)nthreads;
    return 0;
}
int gemv_available(void) { return 0; }
#endif
#endif
