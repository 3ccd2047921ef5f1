/* The skinny decode GEMMs of gemv.c and qgemv.c for CPUs with AVX2 + FMA but no AVX512-BF16
 * (most desktop and many cloud CPUs: Zen 1-3, Intel before Cooper Lake), with the same entry
 * points, record layouts and contract: y[m, n] = bf16(x[m, :] . w[n, :] (+ bias[n])), fp32 sums,
 * one rounding to bf16.
 *
 * Why: without them such a CPU runs a bf16 decode step on torch's GEMM (oneDNN re-packs a plain
 * weight on every call) and a GGUF model on torch's int4 kernel, and the C decode loop, which
 * needs a GEMM that cannot decline, is off; the weight stream is the whole cost at one row, and
 * these read each weight byte once.
 *
 * AVX2 has no bf16 dot, so products run in fp32 FMAs: a bf16 is the top half of an fp32, so 16
 * bf16 weights (one 256-bit load) become two fp32 vectors by one shift (the even elements) and
 * one mask (the odd ones), and the activations are converted once per call to fp32 in that
 * even/odd order. The GGUF codes become fp32 by one in-lane byte shuffle (each code byte into a
 * 32-bit lane) and one int->float convert, exactly (Q8_0's signed bytes go to the lane's top byte,
 * so the convert sees q * 2^24 and the 2^-24 joins the block scale); the activations are permuted
 * once per call to the order the shuffles produce.
 *
 * Every output is one fixed sequence of fp32 operations whatever the number of rows or the tile
 * it falls in, so a row's result does not depend on its batch (the deterministic mode relies on
 * this for the bf16 GEMM: tests/test_batch_invariant_cpu.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if MINISGL_SKINNY_ISA == 2
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>

/* Tuning knobs (bytes prefetched ahead of a weight row's stream, 0: none; weight rows per tile
 * at one activation row), swept in docs/PERFORMANCE.md. */
#ifndef BF_PF
#define BF_PF 16384
#endif
#ifndef Q_PF
#define Q_PF 16384
#endif
#ifndef BF_R1
#define BF_R1 1
#endif
#ifndef Q_R1
#define Q_R1 2
#endif

/* The sum of 8 lanes in one fixed tree: (i, i + 4), (i, i + 2), (i, i + 1). */
static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* ---- bf16 weights ------------------------------------------------------------------------------ */

/* x [M, k] bf16 -> xp [M, kp] fp32, kp = k rounded up to 16, each 16 in the order the weight
 * vectors take them (the 8 even elements, then the 8 odd ones), zeros past k. */
static void bf16_prepare(const uint16_t *x, long ldx, long M, long k, long kp, float *xp) {
    for (long m = 0; m < M; m++)
        for (long c = 0; c < kp; c += 16)
            for (int e = 0; e < 16; e++) {
                long src = c + (e < 8 ? 2 * e : 2 * (e - 8) + 1);
                xp[m * kp + c + e] = src < k ? bf16_to_f(x[m * ldx + src]) : 0.f;
            }
}

/* R weight rows (n0 ..) against M activation rows: two accumulator chains (even, odd elements)
 * per output. always_inline with constant R and M, so the loops unroll into registers. */
static inline __attribute__((always_inline)) void bf16_tile(const float *xp, long kp, const uint16_t *w, long k,
                                                            long n0, const uint16_t *bias, uint16_t *y, long ldy,
                                                            const int R, const int M) {
    __m256 ae[4][4], ao[4][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) ae[r][m] = ao[r][m] = _mm256_setzero_ps();
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    const uint16_t *wr = w + n0 * k;
    long kk = 0;
    for (; kk + 16 <= k; kk += 16) {
#if BF_PF
        if (kk % 32 == 0)
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(wr + r * k + kk) + BF_PF, _MM_HINT_T0);
#endif
        for (int r = 0; r < R; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wr + r * k + kk));
            __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
            for (int m = 0; m < M; m++) {
                ae[r][m] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xp + m * kp + kk), ae[r][m]);
                ao[r][m] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xp + m * kp + kk + 8), ao[r][m]);
            }
        }
    }
    if (kk < k) { /* the last partial 16: the same arithmetic on zero-padded copies */
        for (int r = 0; r < R; r++) {
            uint16_t tail[16] = {0};
            memcpy(tail, wr + r * k + kk, (size_t)(k - kk) * 2);
            __m256i v = _mm256_loadu_si256((const __m256i *)tail);
            __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
            for (int m = 0; m < M; m++) {
                ae[r][m] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xp + m * kp + kk), ae[r][m]);
                ao[r][m] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xp + m * kp + kk + 8), ao[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float b = bias ? bf16_to_f(bias[n0 + r]) : 0.f;
        for (int m = 0; m < M; m++) y[m * ldy + n0 + r] = f_to_bf16(hsum8(_mm256_add_ps(ae[r][m], ao[r][m])) + b);
    }
}

static void bf16_rows(const float *xp, long kp, long M, const uint16_t *w, long k, long lo, long hi,
                      const uint16_t *bias, uint16_t *y, long ldy) {
    long n = lo;
#define BCASE(MM, RR)                                                                              \
    case MM:                                                                                       \
        for (; n + RR <= hi; n += RR) bf16_tile(xp, kp, w, k, n, bias, y, ldy, RR, MM);            \
        for (; n < hi; n++) bf16_tile(xp, kp, w, k, n, bias, y, ldy, 1, MM);                       \
        break;
    switch (M) {
        BCASE(1, BF_R1)
        BCASE(2, 2)
        BCASE(3, 1)
        BCASE(4, 1)
    }
#undef BCASE
}

/* 16-row chunks of the weight split over the threads (static: each thread streams one range);
 * each chunk is passed by every block of <= 4 activation rows while it sits in cache. */
int gemv_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k, const uint16_t *bias,
              uint16_t *y, int nthreads) {
    if (m < 1 || k < 1) return 0;
    const long kp = (k + 15) / 16 * 16;
    float *xp = aligned_alloc(32, (m * kp * sizeof(float) + 31) / 32 * 32);
    if (!xp) return 0;
    bf16_prepare(x, ldx, m, k, kp, xp);
    const long chunk = 16, nchunks = (n + chunk - 1) / chunk;
    int nt = n * k < (1l << 16) ? 1 : nthreads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long c = 0; c < nchunks; c++) {
        long lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
        for (long m0 = 0; m0 < m; m0 += 4)
            bf16_rows(xp + m0 * kp, kp, m - m0 < 4 ? m - m0 : 4, w, k, lo, hi, bias, y + m0 * n, n);
    }
    free(xp);
    return 1;
}
int gemv_available(void) { return 1; }

/* ---- GGUF records (layers/quant.py, qgemv.c's header) -------------------------------------------- */

/* Position in a 64-code block pair of the code in byte w's low nibble (the high nibble: + 16);
 * qgemv.c's q4_pos, the records' order. */
static inline int q4_pos(int w) { return ((w >> 1) & 1) * 32 + 2 * (w >> 2) + (w & 1); }

/* Vector v (0-7) of a pair holds, in fp32 lane e, the code of byte 16 (e / 4) + 4 (v % 4) + e % 4
 * (the shuffle's in-lane order), low nibbles for v < 4 (q8: the pair's first 32 bytes), high ones
 * after (q8: the second 32 bytes): the code position of (v, e). Lanes e % 4 < 2 are block A's
 * (codes 0-31), the others block B's, in every vector. */
static inline int qpos(int v, int e) { return q4_pos(16 * (e >> 2) + 4 * (v & 3) + (e & 3)) + 16 * (v >> 2); }

/* x [M, k] -> xp [M, kp] fp32 in the vectors' order (zero past k), and per 32-block sums S
 * (in column order, for q4's m term). */
static void q_prepare(const uint16_t *x, long ldx, long M, long k, long kp, float *xp, float *xs) {
    int pos[64];
    for (int i = 0; i < 64; i++) pos[i] = qpos(i / 8, i % 8);
    const long G = kp / 32;
    for (long m = 0; m < M; m++) {
        const uint16_t *row = x + m * ldx;
        for (long c = 0; c < kp; c += 64)
            for (int i = 0; i < 64; i++) xp[m * kp + c + i] = c + pos[i] < k ? bf16_to_f(row[c + pos[i]]) : 0.f;
        for (long g = 0; g < G; g++) {
            float s = 0.f;
            for (long j = g * 32; j < g * 32 + 32 && j < k; j++) s += bf16_to_f(row[j]);
            xs[m * G + g] = s;
        }
    }
}

/* Byte 4 j + i of each 128-bit lane into 32-bit lane i, at bit `shift` (0: q4's nibbles as
 * integers; 24: q8's signed bytes, as q * 2^24). */
static int8_t spread_masks[2][4][32] __attribute__((aligned(32))); /* [q8][j]: filled once, by spread_init */
static void spread_init(void) {
    for (int q8 = 0; q8 < 2; q8++)
        for (int j = 0; j < 4; j++)
            for (int L = 0; L < 2; L++)
                for (int i = 0; i < 4; i++)
                    for (int b = 0; b < 4; b++) spread_masks[q8][j][16 * L + 4 * i + b] = (int8_t)(b == (q8 ? 3 : 0) ? 4 * j + i : -128);
}
static inline __m256i byte_spread(int j, int shift) {
    return _mm256_load_si256((const __m256i *)spread_masks[shift ? 1 : 0][j]);
}

/* The pair's two fp16 scales as [dA, dA, dB, dB] x 2, times `mul`. */
static inline __m256 pair_scales(const uint8_t *d2, float mul) {
    int32_t dd;
    memcpy(&dd, d2, 4);
    __m128 ab = _mm_cvtph_ps(_mm_cvtsi32_si128(dd)); /* dA, dB, -, - */
    __m128 aabb = _mm_mul_ps(_mm_unpacklo_ps(ab, ab), _mm_set1_ps(mul));
    return _mm256_set_m128(aabb, aabb);
}

/* R weight rows (n0 ..) against M activation rows. Per pair, each row's 8 code vectors are made
 * once and dotted with every activation row (two chains of 4 products), then scaled into the
 * output's accumulator. bits 4: Q4_1 records (codes, d, m); 8: Q8_0 records (codes + 128, d). */
static inline __attribute__((always_inline)) void q_tile(const float *xp, const float *xs, long kp, const uint8_t *w,
                                                         long rec, long n0, const uint16_t *bias, uint16_t *y,
                                                         long ldy, const int bits, const int R, const int M) {
    const long G = kp / 32, P = G / 2, d_off = bits == 4 ? kp / 2 : kp;
    const int shift = bits == 4 ? 0 : 24;
    const __m256i low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    const uint8_t *wr = w + n0 * rec;
    for (long p = 0; p < P; p++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *row = wr + r * rec;
            __m256i h0, h1; /* the vectors' two 32-byte sources */
            if (bits == 4) {
                __m256i b = _mm256_loadu_si256((const __m256i *)(row + p * 32));
#if Q_PF
                if (p % 2 == 0) _mm_prefetch((const char *)(row + p * 32) + Q_PF, _MM_HINT_T0);
#endif
                h0 = _mm256_and_si256(b, low4);
                h1 = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
            } else {
                h0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + p * 64)), flip);
                h1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + p * 64 + 32)), flip);
#if Q_PF
                _mm_prefetch((const char *)(row + p * 64) + 2 * Q_PF, _MM_HINT_T0);
#endif
            }
            __m256 d = pair_scales(row + d_off + 4 * p, bits == 4 ? 1.f : 0x1p-24f);
            /* t0: the 4 vectors of h0, t1: those of h1 (the masks are read from memory, as
             * vpshufb's operand: in registers they and the code vectors would spill) */
            __m256 q[8];
            for (int v = 0; v < 8; v++) q[v] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v < 4 ? h0 : h1, byte_spread(v & 3, shift)));
            for (int m = 0; m < M; m++) {
                const float *xv = xp + m * kp + p * 64;
                __m256 t0 = _mm256_mul_ps(q[0], _mm256_load_ps(xv)), t1 = _mm256_mul_ps(q[4], _mm256_load_ps(xv + 32));
                for (int v = 1; v < 4; v++) {
                    t0 = _mm256_fmadd_ps(q[v], _mm256_load_ps(xv + 8 * v), t0);
                    t1 = _mm256_fmadd_ps(q[v + 4], _mm256_load_ps(xv + 32 + 8 * v), t1);
                }
                acc[r][m] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), d, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const uint16_t *mins = (const uint16_t *)(wr + r * rec + d_off) + G;
        float b = bias ? bf16_to_f(bias[n0 + r]) : 0.f;
        for (int m = 0; m < M; m++) {
            float s = hsum8(acc[r][m]);
            if (bits == 4) /* Q4_1's m term: sum_g m_g S_g, in block order */
                for (long g = 0; g < G; g++) s += _cvtsh_ss(mins[g]) * xs[m * G + g];
            y[m * ldy + n0 + r] = f_to_bf16(s + b);
        }
    }
}

#define Q_ROWS(NAME, BITS)                                                                         \
    static void NAME(const float *xp, const float *xs, long kp, long M, const uint8_t *w, long rec, long lo, \
                     long hi, const uint16_t *bias, uint16_t *y, long ldy) {                       \
        long n = lo;                                                                               \
        switch (M) {                                                                               \
            QCASE(BITS, 1, Q_R1) QCASE(BITS, 2, 2) QCASE(BITS, 3, 1) QCASE(BITS, 4, 1)                \
        }                                                                                          \
    }
#define QCASE(BITS, MM, RR)                                                                        \
    case MM:                                                                                       \
        for (; n + RR <= hi; n += RR) q_tile(xp, xs, kp, w, rec, n, bias, y, ldy, BITS, RR, MM);   \
        for (; n < hi; n++) q_tile(xp, xs, kp, w, rec, n, bias, y, ldy, BITS, 1, MM);              \
        break;
Q_ROWS(q4_rows, 4)
Q_ROWS(q8_rows, 8)
#undef QCASE
#undef Q_ROWS

static int qgemv(int bits, const uint16_t *x, long ldx, long m, const uint8_t *w, long n, long k,
                 const uint16_t *bias, uint16_t *y, int nthreads) {
    if (k % 32 || m < 1) return 0;
    const long kp = (k + 63) / 64 * 64, G = kp / 32;
    const long rec = bits == 4 ? kp / 2 + 4 * G : kp + 2 * G;
    float *xs = malloc(m * G * sizeof(float));
    float *xp = aligned_alloc(32, (m * kp * sizeof(float) + 31) / 32 * 32);
    if (!xs || !xp) {
        free(xs), free(xp);
        return 0;
    }
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, spread_init);
    q_prepare(x, ldx, m, k, kp, xp, xs);
    const long chunk = 16, nchunks = (n + chunk - 1) / chunk;
    int nt = n * k < (1l << 16) ? 1 : nthreads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long c = 0; c < nchunks; c++) {
        long lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
        for (long m0 = 0; m0 < m; m0 += 4) {
            long mm = m - m0 < 4 ? m - m0 : 4;
            if (bits == 4)
                q4_rows(xp + m0 * kp, xs + m0 * G, kp, mm, w, rec, lo, hi, bias, y + m0 * n, n);
            else
                q8_rows(xp + m0 * kp, xs + m0 * G, kp, mm, w, rec, lo, hi, bias, y + m0 * n, n);
        }
    }
    free(xs);
    free(xp);
    return 1;
}

int qgemv_q4_bf16(const uint16_t *x, long ldx, long m, const uint8_t *w, long n, long k, const uint16_t *bias,
                  uint16_t *y, int nthreads) {
    return qgemv(4, x, ldx, m, w, n, k, bias, y, nthreads);
}
int qgemv_q8_bf16(const uint16_t *x, long ldx, long m, const uint8_t *w, long n, long k, const uint16_t *bias,
                  uint16_t *y, int nthreads) {
    return qgemv(8, x, ldx, m, w, n, k, bias, y, nthreads);
}
int qgemv_available(void) { return 1; }
#endif
