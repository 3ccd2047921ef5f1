/* bf16 GEMM on AMX tiles for prefill and large decode batches: y[m, n] = bf16(x[m, :] . w[n, :]
 * (+ bias[n])), x and w row-major bf16 (the module's own weight, no packed copy kept).
 *
 * Why: oneDNN's bf16 linear on a plain weight re-packs the whole weight into a buffer on every
 * call (the weight crosses memory three times), which dominates at decode-batch row counts.
 * Here one of the two operands is packed into the tile unit's pair-interleaved (VNNI) B layout,
 * whichever is cheaper, and only transiently (a per-thread scratch buffer):
 * - few rows: y^T = w x^T, the weight's rows loaded as A tiles straight from the module's
 *   weight (never packed), x packed once per call, each C tile transposed back on store;
 * - many rows: the weight packed a 1 MiB chunk of column pairs at a time (one pass over the
 *   weight), every 32-row block of x passing the chunk.
 * Both use 2 x 2 tiles (4 C, 2 A, 2 B: all 8) and round the previous block's C tiles to bf16
 * while the next block's products run. fp32 accumulation, one rounding to bf16 (results differ
 * from oneDNN's by summation order). docs/PERFORMANCE.md ("CPU forward") has the measurements,
 * including why this lands only a little above oneDNN at 500 rows (one operand streams from L2).
 *
 * Returns 0 (caller falls back to torch) without AMX at compile time, when Linux refuses the tile
 * state, for shapes it does not tile (k % 32, n % 16), above 640 rows (oneDNN is faster there),
 * or when a scratch buffer cannot be had.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <omp.h>
#include <unistd.h>

#include "amx_tiles.h"
#include "vec_math.h"


/* 16 rows (stride ld elements) of a row-major bf16 matrix as k / 32 B tiles: out[q][p][i] = the
 * bf16 pair row i [32 q + 2 p .. + 1]. */
static void pack_rows16(const uint16_t *base, long ld, long k, uint32_t *out) {
    for (long q = 0; q < k / 32; q++) transpose16(base + q * 32, ld * 2, out + q * 256);
}

static void store_tile(const float *c, long row0, long m, long col0, long n, const uint16_t *bias, uint16_t *y) {
    __m512 b = _mm512_setzero_ps();
    if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + col0))), 16));
    for (int r = 0; r < 16 && row0 + r < m; r++) {
        __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b));
        _mm256_storeu_si256((__m256i *)(y + (row0 + r) * n + col0), (__m256i)v);
    }
}

/* C tiles c (columns col0..+15) and c + 256 (the next 16, when two) of rows row0..+15 as whole
 * 64-byte rows of y: one rounding of both halves, one store per row */
static void store_tiles2(const float *c, int two, long row0, long m, long col0, long n, const uint16_t *bias,
                         uint16_t *y) {
    if (!two) {
        store_tile(c, row0, m, col0, n, bias, y);
        return;
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
    if (bias) {
        __m512i bb = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + col0)));
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(bb, 16));
        bb = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + col0 + 16)));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(bb, 16));
    }
    for (int r = 0; r < 16 && row0 + r < m; r++) {
        __m512 lo = _mm512_add_ps(_mm512_loadu_ps(c + r * 16), b0), hi = _mm512_add_ps(_mm512_loadu_ps(c + 256 + r * 16), b1);
        _mm512_storeu_si512(y + (row0 + r) * n + col0, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* A per-thread scratch buffer that only grows: a malloc above glibc's mmap threshold would
 * fault its pages in on every call. */

/* y^T = w x^T for few rows (m up to a few hundred): w's rows are the A operand, loaded straight
 * from the module's weight, and x is packed into B tiles once per call (m x k, small) instead of
 * the weight (n x k) once per call; the C tiles come out transposed and are turned back per
 * 16 x 16 block on store. Per thread: 32 weight rows (two A tiles) at a time against every pair
 * of 16-row blocks of x. */
/* C tile t = 2 a + b of the transposed product holds y[row0 + 16 b + c][col0 + 16 a + r] at
 * row r, column c: turned back into rows of y */
static inline void wa_store(const float *cb, int t, long row0, long col0, int two, int two_m, long m, long n,
                            const uint16_t *bias, uint16_t *y, float *tb) {
    int a = t >> 1, b = t & 1;
    if ((a && !two) || (b && !two_m)) return;
    transpose16(cb + t * 256, 64, (uint32_t *)tb);
    store_tile(tb, row0 + 16 * b, m, col0 + 16 * a, n, bias, y);
}

#ifndef WA_PF
#define WA_PF 1
#endif
#ifndef WA_PF_HINT
#define WA_PF_HINT _MM_HINT_T1
#endif
static int gemm_wa(const uint16_t *x, long ldx, long m, const uint16_t *xpad, const uint16_t *w, long n,
                    long k, const uint16_t *bias, uint16_t *y, long p0, long p1) {
    const long mb = (m + 15) / 16, kb = k / 32;
    uint32_t *xt = amx_scratch(mb * kb * 1024 + 9 * 1024);
    if (!xt) return 0;
    /* two buffers of C tiles (the previous block's is turned into rows a tile per step of the
     * next block's K loop, beside the tile unit's work) and one transposed tile */
    float *cbs = (float *)(xt + mb * kb * 256), *tb = cbs + 2048;
    long pend_row = -1, pend_col = 0;
    int pend_two = 0, pend_two_m = 0, flip = 0;
    for (long i = 0; i < mb; i++) {
        const uint16_t *rows = (xpad && i == mb - 1) ? xpad : x + i * 16 * ldx;
        pack_rows16(rows, rows == xpad ? k : ldx, k, xt + i * kb * 256);
    }
    for (long j = p0; j < p1; j++) { /* weight rows [32 j, 32 j + 32): two A tiles */
        long n0 = j * 32;
        int two = n0 + 16 < n;
        const uint16_t *w0 = w + n0 * k, *w1 = w0 + 16 * k;
        for (long i = 0; i < mb; i += 2) { /* x rows [16 i, 16 i + 32): two B tiles */
            int two_m = i + 1 < mb;
            const uint32_t *b0 = xt + i * kb * 256, *b1 = b0 + kb * 256;
            float *cb = cbs + flip * 1024, *pb = cbs + (flip ^ 1) * 1024;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            /* the weight rows WA_PF blocks ahead, this K step's 64 bytes of each, into L2 (the
             * tile loads read 16 rows 1-3 KiB apart: the hardware prefetcher does not follow) */
            const char *pf = (const char *)(w0 + WA_PF * 32 * k);
            const int do_pf = i == 0 && j + WA_PF < p1;
            for (long q = 0; q < kb; q++) {
                if (do_pf)
                    for (int r = 0; r < 32; r++) _mm_prefetch(pf + r * k * 2 + q * 64, WA_PF_HINT);
                _tile_loadd(4, w0 + q * 32, k * 2);
                _tile_loadd(6, b0 + q * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two_m) {
                    _tile_loadd(7, b1 + q * 256, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two) {
                    _tile_loadd(5, w1 + q * 32, k * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_m) _tile_dpbf16ps(3, 5, 7);
                }
                if (pend_row >= 0 && q < 4) wa_store(pb, (int)q, pend_row, pend_col, pend_two, pend_two_m, m, n, bias, y, tb);
            }
            for (long q = kb; pend_row >= 0 && q < 4; q++) /* K loops shorter than 4 steps */
                wa_store(pb, (int)q, pend_row, pend_col, pend_two, pend_two_m, m, n, bias, y, tb);
            _tile_stored(0, cb, 64);
            _tile_stored(1, cb + 256, 64);
            _tile_stored(2, cb + 512, 64);
            _tile_stored(3, cb + 768, 64);
            pend_row = i * 16, pend_col = n0, pend_two = two, pend_two_m = two_m, flip ^= 1;
        }
    }
    for (int q = 0; pend_row >= 0 && q < 4; q++)
        wa_store(cbs + (flip ^ 1) * 1024, q, pend_row, pend_col, pend_two, pend_two_m, m, n, bias, y, tb);
    return 1;
}

/* The fused gate_up + SiLU product (gemm_amx_vnni_silu_bf16): w = [gate | up], inter rows each, and
 * the output is act = silu(gate) * up, never the gate_up rows. Column pairs are visited as
 * couples, gate pair c then up pair half + c (`wb_pair`), so the up tiles of a 32 x 32 block are
 * rounded while the gate tiles of the same rows and columns wait, already rounded to bf16, in a
 * 2 KiB scratch: the roundings of gemm + silu_mul (gate and up to bf16, silu to bf16, the product
 * to bf16), bitwise, without writing and re-reading the 2 x inter-wide rows. */
static inline long wb_pair(long v, long half) { return half ? ((v & 1) ? half + (v >> 1) : v >> 1) : v; }

/* rows row0..+15 of a pending 2-tile block: plain rows of y, a couple's gate into gs, or its up
 * combined with gs into act (y = act, n = inter then) */
static void wb_store(const float *c, int two, long row0, long m, long col0, long n, const uint16_t *bias,
                     uint16_t *y, long inter, uint16_t *gs, int half_row) {
    if (!inter) {
        store_tiles2(c, two, row0, m, col0, n, bias, y);
        return;
    }
    uint16_t *g = gs + half_row * 16 * 32;
    if (col0 < inter) { /* gate: rounded to bf16 as the unfused GEMM stores it */
        for (int r = 0; r < 16 && row0 + r < m; r++)
            _mm512_storeu_si512(g + r * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(c + 256 + r * 16), _mm512_loadu_ps(c + r * 16)));
        return;
    }
    for (int r = 0; r < 16 && row0 + r < m; r++) {
        __m512i up = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(c + 256 + r * 16), _mm512_loadu_ps(c + r * 16));
        __m512i gate = _mm512_loadu_si512(g + r * 32);
        __m512 out[2];
        for (int h = 0; h < 2; h++) {
            __m512 gv = bf16x16_to_f(h ? _mm512_extracti64x4_epi64(gate, 1) : _mm512_castsi512_si256(gate));
            __m512 uv = bf16x16_to_f(h ? _mm512_extracti64x4_epi64(up, 1) : _mm512_castsi512_si256(up));
            out[h] = _mm512_mul_ps(silu16_bf16(gv), uv);
        }
        _mm512_storeu_si512(y + (row0 + r) * inter + col0 - inter, (__m512i)_mm512_cvtne2ps_pbh(out[1], out[0]));
    }
}

#ifndef AMX_WB_CHUNK
#define AMX_WB_CHUNK (1l << 20)
#endif
/* A VNNI weight is multiplied a chunk of pairs of 16-row blocks at a time against every block of
 * x: for a prefill-sized x (<= 512 rows) the smallest chunk (64 KiB, its tiles stay in L1/L2 while
 * x streams from L2); row groups of up to 1024 rows (x then streams from L3) take 1 MiB chunks.
 * Both sizes won a sweep (docs/PERFORMANCE.md, "CPU forward"). */
#ifndef VNNI_CHUNK
#define VNNI_CHUNK (64l << 10)
#endif
#ifndef VNNI_CHUNK_MANY
#define VNNI_CHUNK_MANY (1l << 20)
#endif
#ifndef VNNI_ROW_GROUP
#define VNNI_ROW_GROUP 1024 /* a multiple of 16 */
#endif
/* y = x w^T for many rows, blocked for the caches: the weight is packed into B tiles a chunk of
 * column pairs at a time (<= 1 MiB, L2; each pair packed on first use, next to its first
 * products), and each 32-row block of x (<= 96 KiB, L1/L2) passes every pair of the chunk while
 * its output rows are written whole. x is read once per chunk, the weight once in all. (Packing
 * per pair and streaming all of x past it was much slower at 2048+ rows: x from L3.)
 * With vnni the weight already is B tiles (gemm_vnni): nothing is packed, the chunks only block
 * for the caches; with inter > 0 the pairs come as gate/up couples and y is the SiLU product. */
static int gemm_wb(const uint16_t *x, long ldx, long m, const uint16_t *xpad, const uint16_t *w, long n,
                   long k, const uint16_t *bias, uint16_t *y, long p0, long p1, long inter, int vnni) {
    const long mb = (m + 15) / 16, kb = k / 32, pair_sz = 2 * kb * 256, half = inter ? n / 64 : 0;
    long cp = (!vnni ? AMX_WB_CHUNK : m > VNNI_ROW_GROUP / 2 ? VNNI_CHUNK_MANY : VNNI_CHUNK) / (pair_sz * 4);
    cp = cp < 1 ? 1 : (cp > p1 - p0 ? p1 - p0 : cp);
    if (inter) cp = cp < 2 ? 2 : cp & ~1l; /* whole couples per chunk (p0, p1 are even) */
    const long packed_words = vnni ? 0 : cp * pair_sz; /* a VNNI weight is read in place */
    uint32_t *wpk = amx_scratch(packed_words * 4 + 2 * 4096 + 2048);
    if (!wpk) return 0;
    float *cbs = (float *)(wpk + packed_words);
    uint16_t *gs = (uint16_t *)(cbs + 2048); /* a couple's rounded gate block (fused SiLU) */
    /* the previous block's C tiles wait in one of two buffers and are rounded to bf16 a tile per
     * step of the next block's K loop: vector work next to the tile unit's, not after it */
    long pend_row = -1, pend_col = 0;
    int pend_two = 0, pend_two_m = 0, flip = 0;
    for (long c0 = p0; c0 < p1; c0 += cp) {
        const long c1 = c0 + cp < p1 ? c0 + cp : p1;
        for (long i = 0; i < mb; i += 2) { /* 32 rows: two A tiles */
            int two_m = i + 1 < mb;
            const uint16_t *a0 = (xpad && i == mb - 1) ? xpad : x + i * 16 * ldx;
            const uint16_t *a1 = (xpad && i + 1 == mb - 1) ? xpad : x + (i + 1) * 16 * ldx;
            long s0 = (a0 == xpad ? k : ldx) * 2, s1 = (a1 == xpad ? k : ldx) * 2;
            for (long j = c0; j < c1; j++) { /* 32 output columns: two B tiles */
                long n0 = wb_pair(j, half) * 32;
                int two = n0 + 16 < n;
                /* the pair's B tiles: in the VNNI weight (16 rows' tiles follow each other) or
                 * in the chunk's scratch */
                const uint32_t *wp = vnni ? (const uint32_t *)w + n0 / 16 * kb * 256 : wpk + (j - c0) * pair_sz;
                float *cb = cbs + flip * 1024, *pb = cbs + (flip ^ 1) * 1024;
                /* packed on first use: the chunk's first pair here, each next one tile pair per K
                 * step of this one's products (transposes next to the tile unit's work) */
                if (!vnni && i == 0 && j == c0) {
                    pack_rows16(w + n0 * k, k, k, wpk);
                    if (two) pack_rows16(w + (n0 + 16) * k, k, k, wpk + kb * 256);
                }
                const int pack_next = !vnni && i == 0 && j + 1 < c1;
                const long nn0 = wb_pair(j + 1, half) * 32;
                const uint16_t *nw = w + nn0 * k;
                const int next_two = nn0 + 16 < n;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (long q = 0; q < kb; q++) {
                    if (pack_next) {
                        uint32_t *nwp = wpk + (j + 1 - c0) * pair_sz;
                        transpose16(nw + q * 32, k * 2, nwp + q * 256);
                        if (next_two) transpose16(nw + 16 * k + q * 32, k * 2, nwp + (kb + q) * 256);
                    }
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
                    /* tiles 2 a, 2 a + 1: rows + 16 a, columns + 0 / + 16 */
                    if (pend_row >= 0 && q < 2 && (q == 0 || pend_two_m))
                        wb_store(pb + q * 512, pend_two, pend_row + 16 * q, m, pend_col, n, bias, y, inter, gs, (int)q);
                }
                if (pend_row >= 0 && kb < 2 && pend_two_m) /* K loops of one step */
                    wb_store(pb + 512, pend_two, pend_row + 16, m, pend_col, n, bias, y, inter, gs, 1);
                _tile_stored(0, cb, 64);
                _tile_stored(1, cb + 256, 64);
                _tile_stored(2, cb + 512, 64);
                _tile_stored(3, cb + 768, 64);
                pend_row = i * 16, pend_col = n0, pend_two = two, pend_two_m = two_m, flip ^= 1;
            }
        }
    }
    if (pend_row >= 0) {
        float *pb = cbs + (flip ^ 1) * 1024;
        wb_store(pb, pend_two, pend_row, m, pend_col, n, bias, y, inter, gs, 0);
        if (pend_two_m) wb_store(pb + 512, pend_two, pend_row + 16, m, pend_col, n, bias, y, inter, gs, 1);
    }
    return 1;
}

#ifndef AMX_MAX_ROWS
#define AMX_MAX_ROWS 640
#endif
#ifndef AMX_WA_ROWS
#define AMX_WA_ROWS 0
#endif
/* x zero-padded past its last full 16-row block (every tile load stays in bounds), or NULL when m
 * is a multiple of 16; *ok = 0 when it cannot be had */
static uint16_t *pad_rows(const uint16_t *x, long ldx, long m, long k, int *ok) {
    *ok = 1;
    if (m % 16 == 0) return NULL;
    uint16_t *xpad = calloc(16 * k, sizeof(uint16_t));
    if (!xpad) {
        *ok = 0;
        return NULL;
    }
    const long mb = (m + 15) / 16;
    for (long r = 0; r < m % 16; r++) memcpy(xpad + r * k, x + ((mb - 1) * 16 + r) * ldx, k * 2);
    return xpad;
}

int gemm_amx_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k,
                  const uint16_t *bias, uint16_t *y, int nthreads) {
    /* above ~640 rows oneDNN's own re-pack is amortized and its kernel is 5-15% faster here
     * (benchmark/cpu_gemm.py, 1 thread, 768-8192 rows): declined, torch's GEMM runs */
    if (k % 32 || n % 16 || m < 1 || m > AMX_MAX_ROWS || k * 2 > (1l << 30) || !amx_request()) return 0;
    const long pairs = (n / 16 + 1) / 2;
    /* packing the side with fewer rows costs less: x (m rows, plus a transpose per output tile)
     * or w (n rows) */
    const int wa = AMX_WA_ROWS ? m <= AMX_WA_ROWS : m * (k + n) < n * k;
    int ok;
    uint16_t *xpad = pad_rows(x, ldx, m, k, &ok);
    if (!ok) return 0;
    int nt = pairs < nthreads ? (int)pairs : nthreads;
#pragma omp parallel num_threads(nt) reduction(& : ok)
    {
        amx_config();
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        long p0 = pairs * t / T, p1 = pairs * (t + 1) / T;
        ok = wa ? gemm_wa(x, ldx, m, xpad, w, n, k, bias, y, p0, p1) : gemm_wb(x, ldx, m, xpad, w, n, k, bias, y, p0, p1, 0, 0);
        _tile_release();
    }
    free(xpad);
    return ok; /* 0 only where a scratch buffer could not be had: the caller recomputes */
}

/* The GEMM on a weight stored in VNNI tiles (`vnni_pack` in layers/quant.py): w[n / 16][k / 32]
 * 1 KiB B tiles, tile row p = the 16 rows' bf16 pairs (2p, 2p + 1) of that 32-column block: the
 * layout the tile unit multiplies, so nothing is transposed per call (re-packing the plain weight
 * was ~25% of a 500-row GEMM here), for any number of rows. With inter > 0, w = [gate | up]
 * (n = 2 inter, no bias) and y = act = silu(gate) * up, the roundings of the GEMM followed by
 * silu_mul, bitwise (wb_store); returns 0 (the caller falls back) only for shapes it does not
 * tile or without a scratch buffer. */
static int gemm_vnni(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k, const uint16_t *bias,
                     uint16_t *y, long inter, int nthreads) {
    if (k % 32 || n % 16 || m < 1 || (inter && (inter % 32 || bias)) || !amx_request()) return 0;
    const long units = inter ? n / 64 : (n / 16 + 1) / 2; /* pairs of 16-row blocks, or gate/up couples */
    int ok;
    uint16_t *xpad = pad_rows(x, ldx, m, k, &ok);
    if (!ok) return 0;
    int nt = units < nthreads ? (int)units : nthreads;
#pragma omp parallel num_threads(nt) reduction(& : ok)
    {
        amx_config();
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        long u0 = units * t / T, u1 = units * (t + 1) / T, per = inter ? 2 : 1, ldy = inter ? inter : n;
        /* rows in groups that stay in L2 while the weight passes: each pair multiplies every block of
         * x, so a 4096-row x would stream from L3 once per pair (the weight is re-read per group) */
        for (long g0 = 0; g0 < m && ok; g0 += VNNI_ROW_GROUP) {
            long mg = m - g0 < VNNI_ROW_GROUP ? m - g0 : VNNI_ROW_GROUP;
            ok = gemm_wb(x + g0 * ldx, ldx, mg, g0 + mg == m ? xpad : NULL, w, n, k, bias, y + g0 * ldy, u0 * per,
                         u1 * per, inter, 1);
        }
        _tile_release();
    }
    free(xpad);
    return ok;
}
int gemm_amx_vnni_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long n, long k,
                       const uint16_t *bias, uint16_t *y, int nthreads) {
    return gemm_vnni(x, ldx, m, w, n, k, bias, y, 0, nthreads);
}
/* act[m, inter] = silu(x w_gate^T) * (x w_up^T), w the VNNI tiles of [gate | up] ([2 inter, k]) */
int gemm_amx_vnni_silu_bf16(const uint16_t *x, long ldx, long m, const uint16_t *w, long inter, long k,
                            uint16_t *act, int nthreads) {
    return gemm_vnni(x, ldx, m, w, 2 * inter, k, NULL, act, inter, nthreads);
}
int amx_available(void) { return amx_request(); }
#else
int gemm_amx_bf16(const void *x, long ldx, long m, const void *w, long n, long k, const void *bias,
                  void *y, int nthreads) {
    (void)x, (void)ldx, (void)m, (void)w, (void)n, (void)k, (void)bias, (void)y, (void)nthreads;
    return 0;
}
int gemm_amx_vnni_bf16(const void *x, long ldx, long m, const void *w, long n, long k, const void *bias,
                       void *y, int nthreads) {
    (void)x, (void)ldx, (void)m, (void)w, (void)n, (void)k, (void)bias, (void)y, (void)nthreads;
    return 0;
}
int gemm_amx_vnni_silu_bf16(const void *x, long ldx, long m, const void *w, long inter, long k, void *act,
                            int nthreads) {
    (void)x, (void)ldx, (void)m, (void)w, (void)inter, (void)k, (void)act, (void)nthreads;
    return 0;
}
int amx_available(void) { return 0; }
#endif
