/* The bf16 GEMM of prefill and large decode batches on CPUs with AVX2 + FMA but neither AMX nor
 * AVX512-BF16: y[m, n] = bf16(x[m, :] . w[n, :] (+ bias[n])), fp32 sums, one rounding to bf16.
 *
 * Why: there torch's bf16 linear runs oneDNN's reference-speed path (~18 GFLOP/s on two Zen
 * cores against ~150 for an fp32 GEMM), which made a 500-token prefill of the embedded model take
 * 7.6 s; converting the weight to fp32 for torch's sgemm would cost a second copy of every
 * weight. Here both operands are converted while they are packed, in the classic register-
 * blocked form: x in panels of 6 rows (packed once per call, [k][6] fp32), each 16 weight rows
 * as a [k][16] fp32 panel (packed per panel, per thread, and kept in L2 while every x panel
 * passes it), and a 6 x 16 block of outputs in 12 accumulators, two 8-lane FMAs per x value.
 *
 * Each output is one FMA chain over k in order, whatever m and whichever block it falls in, so a
 * row's result does not depend on the rows beside it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if MINISGL_SKINNY_ISA == 2
#include <immintrin.h>
#include <omp.h>

#include "vec_math.h"

#define MR 6
#define NR 16

/* x rows [m0, m0 + MR) -> ap [k][MR] fp32 (rows past m are zero). */
static void pack_x(const uint16_t *x, long ldx, long m, long m0, long k, float *ap) {
    for (int i = 0; i < MR; i++) {
        const uint16_t *row = m0 + i < m ? x + (m0 + i) * ldx : NULL;
        for (long kk = 0; kk < k; kk++) ap[kk * MR + i] = row ? bf16_to_f(row[kk]) : 0.f;
    }
}

/* weight rows [n0, n0 + NR), columns [k0, k0 + kc) -> bp [kc][NR] fp32 (rows past n are zero):
 * 8 columns of 8 rows at a time, widened (a bf16 is an fp32's top half) and transposed in
 * registers. */
static void pack_w(const uint16_t *w, long n, long n0, long k, long k0, long kc, float *bp) {
    w += k0;
    long kk = 0;
    for (; kk + 8 <= kc; kk += 8)
        for (int h = 0; h < NR; h += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++)
                r[j] = n0 + h + j < n ? ld8_bf16(w + (n0 + h + j) * k + kk) : _mm256_setzero_ps();
            /* 8 x 8 transpose: r[j][c] -> out[c][j] */
            __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
            __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
            __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
            __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
            __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            __m256 c[8] = {_mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
                           _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
                           _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
                           _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
            for (int j = 0; j < 8; j++) _mm256_store_ps(bp + (kk + j) * NR + h, c[j]);
        }
    for (; kk < kc; kk++)
        for (int j = 0; j < NR; j++) bp[kk * NR + j] = n0 + j < n ? bf16_to_f(w[(n0 + j) * k + kk]) : 0.f;
}

/* One 6 x 16 block of outputs over columns [k0, k0 + kc) of one x panel and one weight panel:
 * the partial sums continue from `part` (unless `first`) and go back there, or, at the last
 * column block, to y as bf16 (+ bias). A partial sum stored and reloaded is exact, so each
 * output is still one FMA chain over k in order. The 12 accumulators are named variables: as an
 * array, GCC stores them to the stack every step. */
static void block_6x16(const float *ap, const float *bp, long kc, float *part, int first, int last,
                       const uint16_t *bias, long n0, int mr, int nr, uint16_t *y, long ldy) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    if (!first) {
        c00 = _mm256_load_ps(part), c01 = _mm256_load_ps(part + 8), c10 = _mm256_load_ps(part + 16);
        c11 = _mm256_load_ps(part + 24), c20 = _mm256_load_ps(part + 32), c21 = _mm256_load_ps(part + 40);
        c30 = _mm256_load_ps(part + 48), c31 = _mm256_load_ps(part + 56), c40 = _mm256_load_ps(part + 64);
        c41 = _mm256_load_ps(part + 72), c50 = _mm256_load_ps(part + 80), c51 = _mm256_load_ps(part + 88);
    }
    for (long kk = 0; kk < kc; kk++) {
        const __m256 b0 = _mm256_load_ps(bp + kk * NR), b1 = _mm256_load_ps(bp + kk * NR + 8);
        const float *a = ap + kk * MR;
        __m256 v = _mm256_broadcast_ss(a);
        c00 = _mm256_fmadd_ps(v, b0, c00), c01 = _mm256_fmadd_ps(v, b1, c01);
        v = _mm256_broadcast_ss(a + 1);
        c10 = _mm256_fmadd_ps(v, b0, c10), c11 = _mm256_fmadd_ps(v, b1, c11);
        v = _mm256_broadcast_ss(a + 2);
        c20 = _mm256_fmadd_ps(v, b0, c20), c21 = _mm256_fmadd_ps(v, b1, c21);
        v = _mm256_broadcast_ss(a + 3);
        c30 = _mm256_fmadd_ps(v, b0, c30), c31 = _mm256_fmadd_ps(v, b1, c31);
        v = _mm256_broadcast_ss(a + 4);
        c40 = _mm256_fmadd_ps(v, b0, c40), c41 = _mm256_fmadd_ps(v, b1, c41);
        v = _mm256_broadcast_ss(a + 5);
        c50 = _mm256_fmadd_ps(v, b0, c50), c51 = _mm256_fmadd_ps(v, b1, c51);
    }
    if (!last) {
        _mm256_store_ps(part, c00), _mm256_store_ps(part + 8, c01), _mm256_store_ps(part + 16, c10);
        _mm256_store_ps(part + 24, c11), _mm256_store_ps(part + 32, c20), _mm256_store_ps(part + 40, c21);
        _mm256_store_ps(part + 48, c30), _mm256_store_ps(part + 56, c31), _mm256_store_ps(part + 64, c40);
        _mm256_store_ps(part + 72, c41), _mm256_store_ps(part + 80, c50), _mm256_store_ps(part + 88, c51);
        return;
    }
    float out[MR][NR];
    _mm256_storeu_ps(out[0], c00), _mm256_storeu_ps(out[0] + 8, c01);
    _mm256_storeu_ps(out[1], c10), _mm256_storeu_ps(out[1] + 8, c11);
    _mm256_storeu_ps(out[2], c20), _mm256_storeu_ps(out[2] + 8, c21);
    _mm256_storeu_ps(out[3], c30), _mm256_storeu_ps(out[3] + 8, c31);
    _mm256_storeu_ps(out[4], c40), _mm256_storeu_ps(out[4] + 8, c41);
    _mm256_storeu_ps(out[5], c50), _mm256_storeu_ps(out[5] + 8, c51);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + n0 + j] = f_to_bf16(out[i][j] + (bias ? bf16_to_f(bias[n0 + j]) : 0.f));
}

/* Columns per block: a 16-row weight panel's block (16 KiB fp32) stays in L1 while the x panels
 * pass it; the outputs' partial sums wait in a per-thread buffer between blocks. */
#ifndef KC
#define KC 256
#endif
/* Rows per block: the x panels of one row block and column block (MC x KC fp32, 192 KiB) stay in
 * L2 while every weight panel passes them; without it a prefill of thousands of rows streamed
 * all of x from DRAM for each weight panel (64 vs 100 GFLOP/s at 12,800 vs 500 rows). */
#ifndef MC
#define MC 192
#endif

/* Returns 1 when it ran, 0 when it could not allocate (the caller falls back). Per block of MC
 * rows, the 16-row weight panels are split over the threads in contiguous ranges; each thread
 * packs its panel one column block at a time and runs the row block's x panels over it. */
int gemm_avx2_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k, const uint16_t *bias,
                   uint16_t *y, int nthreads) {
    if (m < 1 || n < 1 || k < 1) return 0;
    const long mp = (m + MR - 1) / MR, np = (n + NR - 1) / NR, mcp = MC / MR;
    float *ap = aligned_alloc(32, (size_t)(mp * MR * k * sizeof(float) + 31) / 32 * 32);
    if (!ap) return 0;
    int ok = 1;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (long i = 0; i < mp; i++) pack_x(x, ldx, m, i * MR, k, ap + i * MR * k);
        float *bp = aligned_alloc(32, NR * KC * sizeof(float));
        float *part = k > KC ? aligned_alloc(32, (size_t)mcp * MR * NR * sizeof(float)) : NULL;
        const int mine = bp && (k <= KC || part);
        if (!mine) {
#pragma omp atomic write
            ok = 0;
        }
        for (long i0 = 0; i0 < mp; i0 += mcp) {
            const long i1 = i0 + mcp < mp ? i0 + mcp : mp;
#pragma omp for schedule(static)
            for (long j = 0; j < np; j++) {
                if (!mine) continue;
                int nr = n - j * NR < NR ? (int)(n - j * NR) : NR;
                for (long k0 = 0; k0 < k; k0 += KC) {
                    long kc = k - k0 < KC ? k - k0 : KC;
                    pack_w(w, n, j * NR, k, k0, kc, bp);
                    for (long i = i0; i < i1; i++) {
                        int mr = m - i * MR < MR ? (int)(m - i * MR) : MR;
                        block_6x16(ap + i * MR * k + k0 * MR, bp, kc, part ? part + (i - i0) * MR * NR : NULL, k0 == 0,
                                   k0 + kc >= k, bias, j * NR, mr, nr, y + i * MR * n, n);
                    }
                }
            }
        }
        free(bp);
        free(part);
    }
    free(ap);
    return ok;
}
int gemm_avx2_available(void) { return 1; }
#else
int gemm_avx2_bf16(const void *x, long ldx, long m, const void *w, long n, long k, const void *bias, void *y,
                   int nthreads) {
    (void)x, (void)ldx, (void)m, (void)w, (void)n, (void)k, (void)bias, (void)y, (void)nthreads;
    return 0;
}
int gemm_avx2_available(void) { return 0; }
#endif
