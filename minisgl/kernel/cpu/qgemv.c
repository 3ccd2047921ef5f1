/* Weight-only quantized skinny GEMM for small bf16 decode batches:
 * y[m, n] = bf16(x[m, :] . dequant(w)[n, :] (+ bias[n])), weights in GGUF's own block formats.
 *
 * Why: at one to a few rows a decode GEMM streams its weight once, so its time is the weight's
 * bytes. GGUF's Q4_1 (20 bytes per 32 weights) is 3.2x fewer bytes than bf16 and its Q8_0 (34)
 * 1.9x; torch's int4 kernel wants its own packed layout with bf16 scale/zero pairs (which round
 * GGUF's fp16 scales) and its int8 kernel one scale per row (which re-quantizes Q8_0). Here the
 * blocks are read as the file has them, without rounding anything:
 *
 * - q4: w = d * q + m, q in [0, 15], per 32-block fp16 d and m (Q4_1's values);
 * - q8: w = d * q, q int8, per 32-block fp16 d (Q8_0's).
 *
 * A weight row is one contiguous record, so a tile of rows is one stream (prefetched, see below):
 * q4 [codes, kp / 2 bytes][d, fp16 x G][m, fp16 x G], q8 [codes + 128, kp bytes][d, fp16 x G],
 * with k padded to kp = 64 * ceil(k / 64) (G = kp / 32; pad blocks all zero).
 *
 * q4 is the hot path (the embedded model's projections), and its limit on this CPU is the
 * shuffle port, not memory: each 64 codes of a block pair sit in 32 bytes ordered so that one
 * zero-extension to 16-bit lanes, a mask and a shift leave them where VDPBF16PS wants them, with
 * the two blocks in alternating fp32 lanes (so the pair's two d values are one broadcast). The
 * bf16 value of a code is built by OR: 0x4300 | q is exactly 128 + q, and the 128 * d * (sum of
 * the block's activations) this adds is taken off with the m term, sum_g (m_g - 128 d_g) S_g,
 * once per row (products are exact in fp32; the offset costs ~4 of fp32's 24 bits, far below the
 * output's bf16 rounding). Activations are permuted once per call to the same order.
 * q8 stores q + 128 and splits each byte into its two nibbles the same way (see q8_tile).
 * fp32 sums throughout, one rounding to bf16.
 *
 * For k % 32 != 0, or without AVX512-BF16 at compile time (and without AVX2 + FMA, for
 * skinny_avx2.c's twins), the entry points return 0 and the caller falls back to torch. The Python side (layers/quant.py) builds the records.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if MINISGL_SKINNY_ISA == 512
#include <immintrin.h>

/* DRAM latency, not the stream, bounds a lone core here: without help one core reads the records
 * at under half a plain read stream's rate. So each tile step prefetches, into L2, its share of
 * the bytes QPF_BYTES ahead (the tile QPF_BYTES further down the same contiguous stream; the
 * figures are in docs/PERFORMANCE.md). */
#define QPF_BYTES 16384
#define TILE_PREFETCH(tile, lines, per, step)                                                      \
    for (long l_ = (step) * (per); l_ < ((step) + 1) * (per) && l_ < (lines); l_++)                \
        _mm_prefetch((const char *)(tile) + QPF_BYTES + l_ * 64, _MM_HINT_T1);

/* Position in a 64-code block pair of the code in byte w's low nibble (its high nibble holds the
 * code 16 further): 16-bit lane w after zero-extension, fp32 lane w / 2 of VDPBF16PS; even fp32
 * lanes take block A (codes 0..31), odd ones block B (32..63). layers/quant.py uses the same map. */
static inline int q4_pos(int w) { return ((w >> 1) & 1) * 32 + 2 * (w >> 2) + (w & 1); }

/* x [M, k] -> xp [M, kp] in the q4 record order (zero past k), and per 32-block sums S. */
static void q4_prepare(const uint16_t *x, long ldx, long M, long k, long kp, uint16_t *xp, float *xs) {
    uint16_t lo_idx[32], hi_idx[32];
    for (int w = 0; w < 32; w++) lo_idx[w] = (uint16_t)q4_pos(w), hi_idx[w] = (uint16_t)(q4_pos(w) + 16);
    const __m512i il = _mm512_loadu_si512(lo_idx), ih = _mm512_loadu_si512(hi_idx);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16((short)0x3F80);
    const long G = kp / 32;
    for (long m = 0; m < M; m++) {
        const uint16_t *row = x + m * ldx;
        for (long c = 0; c < kp; c += 64) {
            long left = k - c;
            __mmask32 m0 = left >= 32 ? 0xFFFFFFFFu : left > 0 ? (__mmask32)((1ull << left) - 1) : 0;
            __mmask32 m1 = left >= 64 ? 0xFFFFFFFFu : left > 32 ? (__mmask32)((1ull << (left - 32)) - 1) : 0;
            __m512i x0 = _mm512_maskz_loadu_epi16(m0, row + c), x1 = _mm512_maskz_loadu_epi16(m1, row + c + 32);
            _mm512_storeu_si512(xp + m * kp + c, _mm512_permutex2var_epi16(x0, il, x1));
            _mm512_storeu_si512(xp + m * kp + c + 32, _mm512_permutex2var_epi16(x0, ih, x1));
            xs[m * G + c / 32] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)x0, ones));
            xs[m * G + c / 32 + 1] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)x1, ones));
        }
    }
}

/* The end of a tile, shared by q4 and q8: each row's block term sum_g (m_g - offset d_g) S_g (the
 * fp16 d at byte d_off of the row's record, then m when has_m), 16 blocks at a time, then the
 * lanes summed, the bias added and one rounding to bf16. */
static inline __attribute__((always_inline)) void tile_finish(
    __m512 acc[8][8], const uint8_t *wr, long rec, long d_off, int has_m, float offset, const float *xs, long G,
    const uint16_t *bias, long n0, uint16_t *y, long ldy, const int R, const int M) {
    const __m512 neg = _mm512_set1_ps(-offset);
    for (int r = 0; r < R; r++) {
        const uint16_t *ds = (const uint16_t *)(wr + r * rec + d_off), *mins = ds + G;
        for (long g = 0; g < G; g += 16) {
            __mmask16 live = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1u);
            __m512 cv = _mm512_mul_ps(neg, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, ds + g)));
            if (has_m) cv = _mm512_add_ps(cv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mins + g)));
            for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(cv, _mm512_maskz_loadu_ps(live, xs + m * G + g), acc[r][m]);
        }
        float b = bias ? bf16_to_f(bias[n0 + r]) : 0.f;
        for (int m = 0; m < M; m++) y[m * ldy + n0 + r] = f_to_bf16(_mm512_reduce_add_ps(acc[r][m]) + b);
    }
}

/* R weight rows (n0 ..) against M activation rows, R * M <= 16 accumulators; always_inline with
 * constant R and M so both loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void q4_tile(
    const uint16_t *x, long ldx, const float *xs, const uint8_t *w, long rec, long kp, long n0,
    const uint16_t *bias, uint16_t *y, long ldy, const int R, const int M) {
    const long G = kp / 32, P = G / 2, kb = kp / 2;
    const __m512i low4 = _mm512_set1_epi16(0x000F), bf128 = _mm512_set1_epi16(0x4300);
    __m512 acc[8][8]; /* fixed sizes: a VLA would keep them in memory */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    const uint8_t *wr = w + n0 * rec;
    const long lines = (R * rec + 63) / 64, per = (lines + P - 1) / P;
    for (long p = 0; p < P; p++) {
        TILE_PREFETCH(wr, lines, per, p);
        __m512bh xl[8], xh[8];
        for (int m = 0; m < M; m++) {
            xl[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + p * 64);
            xh[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + p * 64 + 32);
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *row = wr + r * rec;
            __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + p * 32)));
            /* (q & 15) | 0x4300 and (q >> 4) | 0x4300: bf16 128 + code */
            __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(q, low4, bf128, 0xEA);
            __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(q, 4), bf128);
            int32_t dd;
            memcpy(&dd, row + kb + 4 * p, 4);
            __m512 d = _mm512_cvtph_ps(_mm256_set1_epi32(dd)); /* d_A, d_B, d_A, ... */
            for (int m = 0; m < M; m++) {
                __m512 t = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), lo, xl[m]), hi, xh[m]);
                acc[r][m] = _mm512_fmadd_ps(t, d, acc[r][m]);
            }
        }
    }
    tile_finish(acc, wr, rec, kb, 1, 128.f, xs, G, bias, n0, y, ldy, R, M);
}

/* q8 runs the same arithmetic on byte codes u = q + 128 split into nibbles l, h: the pair's 64
 * codes are laid out as q4's two 32-byte halves (byte w of half c holds code q4_pos(w) + 16 c),
 * so x takes q4's permutation; per half, (128 + l) and (128 + h) dot x, and
 * sum q x = D_l + 16 D_h - 2304 S (the offsets: 128 S + 16 * 128 S for the nibbles, 128 S for u). */
static inline __attribute__((always_inline)) void q8_tile(
    const uint16_t *x, long ldx, const float *xs, const uint8_t *w, long rec, long kp, long n0,
    const uint16_t *bias, uint16_t *y, long ldy, const int R, const int M) {
    const long G = kp / 32, P = G / 2;
    const __m512i low4 = _mm512_set1_epi16(0x000F), bf128 = _mm512_set1_epi16(0x4300);
    __m512 acc[8][8]; /* fixed sizes: a VLA would keep them in memory */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    const uint8_t *wr = w + n0 * rec;
    const long lines = (R * rec + 63) / 64, per = (lines + P - 1) / P;
    for (long p = 0; p < P; p++) {
        TILE_PREFETCH(wr, lines, per, p);
        for (int r = 0; r < R; r++) {
            const uint8_t *row = wr + r * rec;
            __m512i c0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + p * 64)));
            __m512i c1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + p * 64 + 32)));
            __m512bh l0 = (__m512bh)_mm512_ternarylogic_epi32(c0, low4, bf128, 0xEA);
            __m512bh h0 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(c0, 4), bf128);
            __m512bh l1 = (__m512bh)_mm512_ternarylogic_epi32(c1, low4, bf128, 0xEA);
            __m512bh h1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(c1, 4), bf128);
            int32_t dd;
            memcpy(&dd, row + kp + 4 * p, 4);
            __m512 d = _mm512_cvtph_ps(_mm256_set1_epi32(dd)); /* d_A, d_B, d_A, ... */
            __m512 d16 = _mm512_mul_ps(d, _mm512_set1_ps(16.f));
            for (int m = 0; m < M; m++) {
                __m512bh xl = (__m512bh)_mm512_loadu_si512(x + m * ldx + p * 64);
                __m512bh xh = (__m512bh)_mm512_loadu_si512(x + m * ldx + p * 64 + 32);
                __m512 tl = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), l0, xl), l1, xh);
                __m512 th = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), h0, xl), h1, xh);
                acc[r][m] = _mm512_fmadd_ps(th, d16, _mm512_fmadd_ps(tl, d, acc[r][m]));
            }
        }
    }
    tile_finish(acc, wr, rec, kp, 0, 2304.f, xs, G, bias, n0, y, ldy, R, M);
}

#define Q_ROWS(NAME, TILE)                                                                         \
    static void NAME(const uint16_t *x, long ldx, const float *xs, long M, const uint8_t *w,       \
                     long rec, long k, long lo, long hi, const uint16_t *bias, uint16_t *y,        \
                     long ldy) {                                                                   \
        long n = lo;                                                                               \
        switch (M) {                                                                               \
            QCASE(TILE, 1, 8) QCASE(TILE, 2, 4) QCASE(TILE, 3, 4) QCASE(TILE, 4, 4)                \
            QCASE(TILE, 5, 2) QCASE(TILE, 6, 2) QCASE(TILE, 7, 2) QCASE(TILE, 8, 2)                \
        }                                                                                          \
    }
#define QCASE(TILE, MM, RR)                                                                        \
    case MM:                                                                                       \
        for (; n + RR <= hi; n += RR) TILE(x, ldx, xs, w, rec, k, n, bias, y, ldy, RR, MM);        \
        for (; n < hi; n++) TILE(x, ldx, xs, w, rec, k, n, bias, y, ldy, 1, MM);                   \
        break;
Q_ROWS(q4_rows, q4_tile)
Q_ROWS(q8_rows, q8_tile)
#undef QCASE
#undef Q_ROWS

/* 16-row thread chunks over the weight rows (static: each thread streams one range); every
 * thread runs each block of <= 8 activation rows over its chunk. */
static int qgemv(int bits, const uint16_t *x, long ldx, long m, const uint8_t *w, long n, long k,
                 const uint16_t *bias, uint16_t *y, int nthreads) {
    if (k % 32 || m < 1) return 0;
    const long kp = (k + 63) / 64 * 64, G = kp / 32;
    const long rec = bits == 4 ? kp / 2 + 4 * G : kp + 2 * G;
    /* activations in the records' order (the kernels read xp, stride kp) and their block sums */
    float *xs = malloc(m * G * sizeof(float));
    uint16_t *xp = aligned_alloc(64, (m * kp * sizeof(uint16_t) + 63) / 64 * 64);
    if (!xs || !xp) {
        free(xs), free(xp);
        return 0;
    }
    q4_prepare(x, ldx, m, k, kp, xp, xs);
    long chunk = 16, nchunks = (n + chunk - 1) / chunk;
    int nt = n * k < (1l << 16) ? 1 : nthreads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long c = 0; c < nchunks; c++) {
        long lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
        for (long m0 = 0; m0 < m; m0 += 8) {
            long mm = m - m0 < 8 ? m - m0 : 8;
            if (bits == 4)
                q4_rows(xp + m0 * kp, kp, xs + m0 * G, mm, w, rec, kp, lo, hi, bias, y + m0 * n, n);
            else
                q8_rows(xp + m0 * kp, kp, xs + m0 * G, mm, w, rec, kp, lo, hi, bias, y + m0 * n, n);
        }
    }
    free(xs);
    free(xp);
    return 1;
}

int qgemv_q4_bf16(const uint16_t *x, long ldx, long m, const uint8_t *w, long n, long k,
                  const uint16_t *bias, uint16_t *y, int nthreads) {
    return qgemv(4, x, ldx, m, w, n, k, bias, y, nthreads);
}
int qgemv_q8_bf16(const uint16_t *x, long ldx, long m, const uint8_t *w, long n, long k,
                  const uint16_t *bias, uint16_t *y, int nthreads) {
    return qgemv(8, x, ldx, m, w, n, k, bias, y, nthreads);
}
int qgemv_available(void) { return 1; }
#elif MINISGL_SKINNY_ISA == 0
int qgemv_q4_bf16(const void *x, long ldx, long m, const void *w, long n, long k, const void *bias,
                  void *y, int nthreads) {
    (void)x, (void)ldx, (void)m, (void)w, (void)n, (void)k, (void)bias, (void)y, (void)nthreads;
    return 0;
}
int qgemv_q8_bf16(const void *x, long ldx, long m, const void *w, long n, long k, const void *bias,
                  void *y, int nthreads) {
    (void)x, (void)ldx, (void)m, (void)w, (void)n, (void)k, (void)bias, (void)y, (void)nthreads;
    return 0;
}
int qgemv_available(void) { return 0; }
#endif
