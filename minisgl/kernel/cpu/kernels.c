/* Fused CPU kernels of the layers' ops (kernel/cpu/ops.py, kernel/cpu/attention.py), called through ctypes.
 *
 * Why C and not torch ops: a decode step of SmolLM2-135M on two cores spends more time in the
 * ~50 torch ops per layer (dispatch, allocation) than in their arithmetic. Each function below
 * replaces a chain of them, with the same roundings as the torch/HF path (every bf16 op result
 * rounded to bf16, reductions in fp32), so bf16 results agree with HF up to summation order.
 *
 * Every kernel exists for T = float (suffix _f32) and T = bf16 stored as uint16_t (_bf16).
 * Parallelism: OpenMP, which resolves to the libgomp torch already loaded (same thread pool).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "attn_common.h"

void q8_head(float *x, long d, int8_t *codes, float *scale); /* kv_int8.c */

static inline float ld_f32(const float *p, long i) { return p[i]; }
static inline void st_f32(float *p, long i, float v) { p[i] = v; }
static inline float rnd_f32(float v) { return v; }
static inline float ld_bf16(const uint16_t *p, long i) { return bf16_to_f(p[i]); }
static inline void st_bf16(uint16_t *p, long i, float v) { p[i] = f_to_bf16(v); }
static inline float rnd_bf16(float v) { return bf16_to_f(f_to_bf16(v)); }


#ifdef __AVX512F__
#include <immintrin.h>
/* The decode attention hot loop in AVX-512 for head_dim D in {64, 128}: the G query heads of one
 * KV head stay in registers; keys go in blocks of 16 whose scores form one vector, so the
 * online-softmax max, exp and rescale run once per block and 16 lanes wide. */
static inline __m512 ld16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 ld16_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

#define LDH(p) bf16x16_to_f(_mm256_loadu_si256((const __m256i *)(p)))
#define STH(p, v) _mm256_storeu_si256((__m256i *)(p), f16_to_bf16x16(v))

/* The bf16 add_rms_norm / silu_mul rows, 16 lanes at a time (h % 16 == 0): the same roundings
 * as the scalar loops, which the compiler does not vectorize (bf16 stores round per element). */
static void rms_row_bf16_v(const uint16_t *xr, uint16_t *rr, const uint16_t *w, uint16_t *orow, long h,
                           float eps, int has_residual) {
    __m512 ss = _mm512_setzero_ps();
    for (long i = 0; i < h; i += 16) {
        __m512 v = LDH(xr + i);
        if (has_residual) v = rnd16_bf16(_mm512_add_ps(v, LDH(rr + i)));
        STH(rr + i, v);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    /* the scalar loop sums in index order; a 16-lane sum differs in the last bits only */
    float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)h + eps);
    __m512 vi = _mm512_set1_ps(inv);
    for (long i = 0; i < h; i += 16) STH(orow + i, _mm512_mul_ps(LDH(w + i), rnd16_bf16(_mm512_mul_ps(LDH(rr + i), vi))));
}
static void silu_row_bf16_v(const uint16_t *g, const uint16_t *u, uint16_t *o, long inter) {
    for (long i = 0; i < inter; i += 16) STH(o + i, _mm512_mul_ps(silu16_bf16(LDH(g + i)), LDH(u + i)));
}
/* head_norm_rope_bf16 16 lanes wide for d % 32 == 0 (rotate-half moves whole 16-lane chunks);
 * the same roundings as the scalar loop. */
static void head_rope_bf16_v(uint16_t *x, const uint16_t *nw, float eps, const uint16_t *cos,
                             const uint16_t *sin, long d) {
    __m512 v[16];
    long n = d / 16, half = n / 2;
    for (long c = 0; c < n; c++) v[c] = LDH(x + c * 16);
    if (nw) {
        __m512 ss = _mm512_setzero_ps();
        for (long c = 0; c < n; c++) ss = _mm512_fmadd_ps(v[c], v[c], ss);
        __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)d + eps));
        for (long c = 0; c < n; c++) v[c] = rnd16_bf16(_mm512_mul_ps(LDH(nw + c * 16), rnd16_bf16(_mm512_mul_ps(v[c], inv))));
    }
    for (long c = 0; c < n; c++) {
        __m512 rot = c < half ? _mm512_sub_ps(_mm512_setzero_ps(), v[c + half]) : v[c - half];
        __m512 a = rnd16_bf16(_mm512_mul_ps(v[c], LDH(cos + c * 16)));
        __m512 b = rnd16_bf16(_mm512_mul_ps(rot, LDH(sin + c * 16)));
        STH(x + c * 16, _mm512_add_ps(a, b));
    }
}
#define ROPE_FAST_bf16                                                                           \
    if (d % 32 == 0 && d <= 256) { head_rope_bf16_v(x, nw, eps, cos, sin, d); return; }
#define RMS_ROW_FAST_bf16                                                                        \
    if (h % 16 == 0) { rms_row_bf16_v(xr, rr, w, orow, h, eps, has_residual); continue; }
#define SILU_ROW_FAST_bf16                                                                       \
    if (inter % 16 == 0) { silu_row_bf16_v(g, u, out + r * inter, inter); continue; }

#define DEFINE_FAST_ATTN(SUF, T, D)                                                              \
static void attn_task_##SUF##_##D(const T *q, const T *k_cache, const T *v_cache,               \
                                  const int32_t *slots, long n, long hk, long kh, long g,         \
                                  float scale, T *out) {                                          \
    enum { V = D / 16 };                                                                          \
    __m512 qv[8][V], acc[8][V];                                                                   \
    float mx[8], den[8];                                                                          \
    for (long j = 0; j < g; j++) {                                                                \
        for (int c = 0; c < V; c++) {                                                             \
            float tmp[16];                                                                        \
            for (int i = 0; i < 16; i++) tmp[i] = ld_##SUF(q + j * D, c * 16 + i) * scale;        \
            qv[j][c] = _mm512_loadu_ps(tmp);                                                      \
            acc[j][c] = _mm512_setzero_ps();                                                      \
        }                                                                                         \
        mx[j] = -INFINITY; den[j] = 0.f;                                                          \
    }                                                                                             \
    for (long s0 = 0; s0 < n; s0 += 16) {                                                         \
        int nb = n - s0 < 16 ? (int)(n - s0) : 16;                                                \
        __mmask16 live = (__mmask16)((1u << nb) - 1u);                                            \
        float sc[8][16];                                                                          \
        /* slots are scattered over the pool: the next blocks' rows, so the loads below stream */ \
        PREFETCH_KV_ROWS(k_cache, v_cache, (const float *)NULL, (const float *)NULL, slots, s0 + 16, s0 + 32, n, hk, kh, \
                         (int)(D * sizeof(T)), _MM_HINT_T0)                                       \
        PREFETCH_KV_ROWS(k_cache, v_cache, (const float *)NULL, (const float *)NULL, slots, s0 + ATTN_PF_FAR_BF16, \
                         s0 + ATTN_PF_FAR_BF16 + 16, n, hk, kh, (int)(D * sizeof(T)), _MM_HINT_T1) \
        for (int b = 0; b < nb; b++) {                                                            \
            const T *kr = k_cache + ((long)slots[s0 + b] * hk + kh) * D;                          \
            __m512 kv[V];                                                                         \
            for (int c = 0; c < V; c++) kv[c] = ld16_##SUF(kr + c * 16);                          \
            for (long j = 0; j < g; j++) {                                                        \
                __m512 dot = _mm512_mul_ps(qv[j][0], kv[0]);                                      \
                for (int c = 1; c < V; c++) dot = _mm512_fmadd_ps(qv[j][c], kv[c], dot);          \
                sc[j][b] = _mm512_reduce_add_ps(dot);                                             \
            }                                                                                     \
        }                                                                                         \
        float pj[8][16];                                                                          \
        for (long j = 0; j < g; j++) {                                                            \
            __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, sc[j]);             \
            _mm512_storeu_ps(pj[j], softmax_block(sv, live, mx + j, den + j, acc[j], V));         \
        }                                                                                         \
        for (int b = 0; b < nb; b++) {                                                            \
            const T *vr = v_cache + ((long)slots[s0 + b] * hk + kh) * D;                          \
            __m512 vv[V];                                                                         \
            for (int c = 0; c < V; c++) vv[c] = ld16_##SUF(vr + c * 16);                          \
            for (long j = 0; j < g; j++) {                                                        \
                __m512 w = _mm512_set1_ps(pj[j][b]);                                              \
                for (int c = 0; c < V; c++) acc[j][c] = _mm512_fmadd_ps(w, vv[c], acc[j][c]);     \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (long j = 0; j < g; j++) {                                                                \
        float inv = n > 0 ? 1.0f / den[j] : 0.f;                                                  \
        float tmp[D];                                                                             \
        for (int c = 0; c < V; c++) _mm512_storeu_ps(tmp + c * 16, _mm512_mul_ps(acc[j][c], _mm512_set1_ps(inv))); \
        for (int i = 0; i < D; i++) st_##SUF(out + j * D, i, tmp[i]);                             \
    }                                                                                             \
}
DEFINE_FAST_ATTN(f32, float, 64)
DEFINE_FAST_ATTN(f32, float, 128)
#if defined(__AVX512BF16__)
/* bf16 decode attention with VDPBF16PS scores: q and k are bf16 already, their products are
 * exact in fp32 and summed in fp32 (what the fp32 path computes, in another order); the scale
 * (a power of two for head_dim 64 / 256, else one fp32 rounding) is applied to the sums. p and
 * V stay fp32, as in the generic kernel. */
#define DEFINE_DP_ATTN(D)                                                                         \
static void attn_task_bf16_##D(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, \
                               const int32_t *slots, long n, long hk, long kh, long g,            \
                               float scale, uint16_t *out) {                                      \
    enum { V = D / 16, W = D / 32 };                                                              \
    __m512bh qb[8][W];                                                                            \
    __m512 acc[8][V];                                                                             \
    float mx[8], den[8];                                                                          \
    for (long j = 0; j < g; j++) {                                                                \
        for (int c = 0; c < W; c++) qb[j][c] = (__m512bh)_mm512_loadu_si512(q + j * D + c * 32);  \
        for (int c = 0; c < V; c++) acc[j][c] = _mm512_setzero_ps();                              \
        mx[j] = -INFINITY; den[j] = 0.f;                                                          \
    }                                                                                             \
    const __m512 vscale = _mm512_set1_ps(scale);                                                  \
    for (long s0 = 0; s0 < n; s0 += 16) {                                                         \
        int nb = n - s0 < 16 ? (int)(n - s0) : 16;                                                \
        __mmask16 live = (__mmask16)((1u << nb) - 1u);                                            \
        PREFETCH_KV_ROWS(k_cache, v_cache, (const float *)NULL, (const float *)NULL, slots, s0 + 16, s0 + 32, n, hk, kh, \
                         D * 2, _MM_HINT_T0)                                                      \
        PREFETCH_KV_ROWS(k_cache, v_cache, (const float *)NULL, (const float *)NULL, slots, s0 + ATTN_PF_FAR_BF16, \
                         s0 + ATTN_PF_FAR_BF16 + 16, n, hk, kh, D * 2, _MM_HINT_T1)               \
        const uint16_t *kr[16];                                                                   \
        for (int b = 0; b < 16; b++) kr[b] = k_cache + ((long)slots[s0 + (b < nb ? b : 0)] * hk + kh) * D; \
        float pj[8][16];                                                                          \
        for (long j = 0; j < g; j++) {                                                            \
            __m512 d[16];                                                                         \
            for (int b = 0; b < 16; b++) {                                                        \
                __m512 t = _mm512_setzero_ps();                                                   \
                for (int c = 0; c < W; c++)                                                       \
                    t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(kr[b] + c * 32), qb[j][c]); \
                d[b] = t;                                                                         \
            }                                                                                     \
            __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(hsum16x16(d), vscale)); \
            _mm512_storeu_ps(pj[j], softmax_block(sv, live, mx + j, den + j, acc[j], V));         \
        }                                                                                         \
        for (int b = 0; b < nb; b++) {                                                            \
            const uint16_t *vr = v_cache + ((long)slots[s0 + b] * hk + kh) * D;                   \
            __m512 vv[V];                                                                         \
            for (int c = 0; c < V; c++) vv[c] = ld16_bf16(vr + c * 16);                           \
            for (long j = 0; j < g; j++) {                                                        \
                __m512 w = _mm512_set1_ps(pj[j][b]);                                              \
                for (int c = 0; c < V; c++) acc[j][c] = _mm512_fmadd_ps(w, vv[c], acc[j][c]);     \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (long j = 0; j < g; j++) {                                                                \
        float inv = n > 0 ? 1.0f / den[j] : 0.f;                                                  \
        float tmp[D];                                                                             \
        for (int c = 0; c < V; c++) _mm512_storeu_ps(tmp + c * 16, _mm512_mul_ps(acc[j][c], _mm512_set1_ps(inv))); \
        for (int i = 0; i < D; i++) st_bf16(out + j * D, i, tmp[i]);                              \
    }                                                                                             \
}
DEFINE_DP_ATTN(64)
DEFINE_DP_ATTN(128)
#else
DEFINE_FAST_ATTN(bf16, uint16_t, 64)
DEFINE_FAST_ATTN(bf16, uint16_t, 128)
#endif
#define FAST_ATTN(SUF)                                                                           \
    if (d == 64 || d == 128) {                                                                   \
        int nt = (work * hk * d < 65536) ? 1 : nthreads;                                         \
        /* a request's KV heads on one thread, one after another: the first one's key and value  \
         * streams bring the others' rows (adjacent in each slot) into L2                        \
         * (docs/PERFORMANCE.md) */                                                              \
        long chunk_ = rows >= 2 * nt ? hk : 1; /* (a batch of one keeps a head per thread) */    \
        _Pragma("omp parallel for num_threads(nt) schedule(dynamic, chunk_)")                    \
        for (long task = 0; task < rows * hk; task++) {                                          \
            long t = task / hk, kh = task % hk;                                                  \
            const int32_t *slots = page_table + table_row[t] * pt_stride;                        \
            const void *qh = q + t * q_stride + kh * g * d;                                      \
            void *o = out + t * hq * d + kh * g * d;                                             \
            if (d == 64) attn_task_##SUF##_64((const void *)qh, k_cache, v_cache, slots, kv_len[t], hk, kh, g, scale, o); \
            else attn_task_##SUF##_128((const void *)qh, k_cache, v_cache, slots, kv_len[t], hk, kh, g, scale, o); \
        }                                                                                        \
        return;                                                                                  \
    }
#elif defined(__AVX2__) && defined(__FMA__)
/* Without AVX-512 the scalar loops vectorize by themselves but for silu_mul's (fast_exp and the
 * divide): on AVX2 its row runs 8 lanes at a time with the scalar loop's exact arithmetic (the
 * same polynomial, the divide, the two roundings), so the same bits; it was 11% of a 500-token
 * prefill (docs/PERFORMANCE.md). */
/* The sum of each of 8 vectors, as the lanes of one: lane b = the sum of a[b]'s 8 lanes. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
/* Decode attention of one (query row, KV head) for bf16 and head_dim % 8 == 0 (the generic loop's
 * per-key horizontal sums were most of its time: 7.6 GFLOP/s at 64 rows x 300 keys): keys in
 * blocks of 8, widened to fp32 once per block and shared by the group's query heads; the 8
 * scores of a head are 8 FMA chains reduced together (hsum8x8), one online-softmax update per
 * block, then acc += p v. Per row and KV head, so a row's result does not depend on the batch. */
static void attn_task_bf16_avx2(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int32_t *slots, long n, long hk, long kh, long g, long d, float scale,
                                uint16_t *out) {
    float qf[8][256] __attribute__((aligned(32))), acc[8][256] __attribute__((aligned(32)));
    float kf[8][256] __attribute__((aligned(32))), mx[8], den[8];
    for (long j = 0; j < g; j++) {
        for (long i = 0; i < d; i++) qf[j][i] = bf16_to_f(q[j * d + i]) * scale, acc[j][i] = 0.f;
        mx[j] = -INFINITY, den[j] = 0.f;
    }
    for (long s0 = 0; s0 < n; s0 += 8) {
        const int nb = n - s0 < 8 ? (int)(n - s0) : 8;
        /* the rows are scattered over the pool: the next block's into L1, one further into L2 */
        for (long b = s0 + 8; b < s0 + 16 && b < n; b++)
            for (long c = 0; c < 2 * d; c += 64) {
                _mm_prefetch((const char *)(k_cache + ((long)slots[b] * hk + kh) * d) + c, _MM_HINT_T0);
                _mm_prefetch((const char *)(v_cache + ((long)slots[b] * hk + kh) * d) + c, _MM_HINT_T0);
            }
        for (long b = s0 + 32; b < s0 + 40 && b < n; b++)
            for (long c = 0; c < 2 * d; c += 64) {
                _mm_prefetch((const char *)(k_cache + ((long)slots[b] * hk + kh) * d) + c, _MM_HINT_T1);
                _mm_prefetch((const char *)(v_cache + ((long)slots[b] * hk + kh) * d) + c, _MM_HINT_T1);
            }
        for (int b = 0; b < 8; b++) {
            const uint16_t *kr = k_cache + ((long)slots[s0 + (b < nb ? b : 0)] * hk + kh) * d;
            for (long c = 0; c < d; c += 8) _mm256_store_ps(kf[b] + c, ld8_bf16(kr + c));
        }
        float pj[8][8];
        for (long j = 0; j < g; j++) {
            __m256 dot[8];
            for (int b = 0; b < 8; b++) {
                __m256 t = _mm256_mul_ps(_mm256_load_ps(kf[b]), _mm256_load_ps(qf[j]));
                for (long c = 8; c < d; c += 8) t = _mm256_fmadd_ps(_mm256_load_ps(kf[b] + c), _mm256_load_ps(qf[j] + c), t);
                dot[b] = t;
            }
            float sc[8];
            _mm256_storeu_ps(sc, hsum8x8(dot));
            float bm = -INFINITY;
            for (int b = 0; b < nb; b++) bm = sc[b] > bm ? sc[b] : bm;
            if (bm > mx[j]) {
                const float corr = fast_exp(mx[j] - bm);
                den[j] *= corr;
                for (long c = 0; c < d; c += 8)
                    _mm256_store_ps(acc[j] + c, _mm256_mul_ps(_mm256_load_ps(acc[j] + c), _mm256_set1_ps(corr)));
                mx[j] = bm;
            }
            __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc), _mm256_set1_ps(mx[j])));
            _mm256_storeu_ps(pj[j], p);
            for (int b = nb; b < 8; b++) pj[j][b] = 0.f;
            for (int b = 0; b < nb; b++) den[j] += pj[j][b];
        }
        for (int b = 0; b < nb; b++) {
            const uint16_t *vr = v_cache + ((long)slots[s0 + b] * hk + kh) * d;
            for (long c = 0; c < d; c += 8) {
                const __m256 vv = ld8_bf16(vr + c);
                for (long j = 0; j < g; j++)
                    _mm256_store_ps(acc[j] + c, _mm256_fmadd_ps(_mm256_set1_ps(pj[j][b]), vv, _mm256_load_ps(acc[j] + c)));
            }
        }
    }
    for (long j = 0; j < g; j++) {
        const float inv = n > 0 ? 1.0f / den[j] : 0.f;
        for (long i = 0; i < d; i++) out[j * d + i] = f_to_bf16(acc[j][i] * inv);
    }
}
#define FAST_ATTN(SUF) FAST_ATTN_##SUF
#define FAST_ATTN_f32
#define FAST_ATTN_bf16                                                                           \
    if (d % 8 == 0) {                                                                            \
        int nt = (work * hk * d < 65536) ? 1 : nthreads;                                         \
        long chunk_ = rows >= 2 * nt ? hk : 1; /* as the AVX-512 build: a row's KV heads in turn */ \
        _Pragma("omp parallel for num_threads(nt) schedule(dynamic, chunk_)")                    \
        for (long task = 0; task < rows * hk; task++) {                                          \
            long t = task / hk, kh = task % hk;                                                  \
            attn_task_bf16_avx2(q + t * q_stride + kh * g * d, k_cache, v_cache, page_table + table_row[t] * pt_stride, \
                                kv_len[t], hk, kh, g, d, scale, out + t * hq * d + kh * g * d);   \
        }                                                                                        \
        return;                                                                                  \
    }
#define RMS_ROW_FAST_bf16
#define ROPE_FAST_bf16
#define SILU_ROW_FAST_bf16                                                                       \
    if (inter % 8 == 0) {                                                                        \
        for (long i = 0; i < inter; i += 8) {                                                    \
            __m256 a = ld8_bf16(g + i);                                                          \
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), a));                            \
            __m256 sv = rnd8_bf16(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));     \
            st8_bf16(out + r * inter + i, _mm256_mul_ps(sv, ld8_bf16(u + i)));                   \
        }                                                                                        \
        continue;                                                                                \
    }
#else
#define FAST_ATTN(SUF)
#define RMS_ROW_FAST_bf16
#define SILU_ROW_FAST_bf16
#define ROPE_FAST_bf16
#endif
#define RMS_ROW_FAST_f32
#define SILU_ROW_FAST_f32
#define ROPE_FAST_f32
/* the int8 store's bf16 <-> fp32 of each K/V head, 16 lanes (a prefill stores millions of
 * values: the scalar loops were a visible part of it); the write-back rounds exactly as st_bf16 does */
#if defined(__AVX512F__)
#define Q8_LOAD_FAST_bf16                                                                        \
    if (d % 16 == 0) { for (long i = 0; i < d; i += 16) _mm512_storeu_ps(f + i, LDH(x + i)); } else
#define Q8_STORE_FAST_bf16                                                                       \
    if (d % 16 == 0) {                                                                           \
        for (long i = 0; i < d; i += 16)                                                         \
            _mm256_storeu_si256((__m256i *)(x + i), f32_to_bf16x16_exact(_mm512_loadu_ps(f + i))); \
    } else
#else
#define Q8_LOAD_FAST_bf16
#define Q8_STORE_FAST_bf16
#endif
#define Q8_LOAD_FAST_f32
#define Q8_STORE_FAST_f32

#define DEFINE_KERNELS(SUF, T)                                                                   \
/* residual = x (+ residual);  out = w * T(residual * rsqrt(mean(residual^2) + eps)).        \
 * has_residual = 0: residual = x (the first layer). x may alias out. */                        \
void add_rms_norm_##SUF(const T *x, T *residual, const T *w, T *out, long rows, long h,         \
                        float eps, int has_residual) {                                          \
    _Pragma("omp parallel for if(rows >= 64)")                                                  \
    for (long r = 0; r < rows; r++) {                                                           \
        const T *xr = x + r * h;                                                                \
        T *rr = residual + r * h;                                                               \
        T *orow = out + r * h;                                                                  \
        RMS_ROW_FAST_##SUF                                                                      \
        float ss = 0.f;                                                                         \
        for (long i = 0; i < h; i++) {                                                          \
            float v = ld_##SUF(xr, i);                                                          \
            if (has_residual) v = rnd_##SUF(v + ld_##SUF(rr, i));                               \
            st_##SUF(rr, i, v);                                                                 \
            ss += v * v;                                                                        \
        }                                                                                       \
        float inv = 1.0f / sqrtf(ss / (float)h + eps);                                          \
        for (long i = 0; i < h; i++)                                                            \
            st_##SUF(orow, i, ld_##SUF(w, i) * rnd_##SUF(ld_##SUF(rr, i) * inv));               \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* out[r, i] = silu(gate) * up over gu = [gate | up] rows of width 2 * inter. */                \
void silu_mul_##SUF(const T *gu, T *out, long rows, long inter) {                               \
    _Pragma("omp parallel for if(rows >= 64)")                                                  \
    for (long r = 0; r < rows; r++) {                                                           \
        const T *g = gu + r * 2 * inter, *u = g + inter;                                        \
        SILU_ROW_FAST_##SUF                                                                     \
        for (long i = 0; i < inter; i++) {                                                      \
            float a = ld_##SUF(g, i);                                                           \
            float s = rnd_##SUF(a / (1.0f + fast_exp(-a)));                                         \
            st_##SUF(out + r * inter, i, s * ld_##SUF(u, i));                                   \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* Optional per-head RMSNorm (q_norm / k_norm may be NULL), then rotate-half rotary, HF's    \
 * roundings: T(x*cos) + T(rot*sin). In place on one head of d values. */                        \
static void head_norm_rope_##SUF(T *x, const T *nw, float eps, const T *cos, const T *sin,      \
                                 long d) {                                                      \
    ROPE_FAST_##SUF                                                                             \
    float buf[1024];                                                                            \
    if (nw) {                                                                                   \
        float ss = 0.f;                                                                         \
        for (long i = 0; i < d; i++) { float v = ld_##SUF(x, i); ss += v * v; }                 \
        float inv = 1.0f / sqrtf(ss / (float)d + eps);                                          \
        for (long i = 0; i < d; i++)                                                            \
            buf[i] = rnd_##SUF(ld_##SUF(nw, i) * rnd_##SUF(ld_##SUF(x, i) * inv));              \
    } else {                                                                                    \
        for (long i = 0; i < d; i++) buf[i] = ld_##SUF(x, i);                                   \
    }                                                                                           \
    long half = d / 2;                                                                          \
    for (long i = 0; i < d; i++) {                                                              \
        float rot = i < half ? -buf[i + half] : buf[i - half];                                  \
        float a = rnd_##SUF(buf[i] * ld_##SUF(cos, i));                                         \
        float b = rnd_##SUF(rot * ld_##SUF(sin, i));                                            \
        st_##SUF(x, i, a + b);                                                                  \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* One qkv row [(hq + 2 hk) * d] at `pos`: its q and k heads normed and rotated in place. */      \
static void rope_row_##SUF(T *row, int32_t pos, const T *cos, const T *sin, const T *q_norm,     \
                           const T *k_norm, float eps, long hq, long hk, long d) {              \
    const T *c = cos + (long)pos * d, *s = sin + (long)pos * d;                                 \
    for (long h = 0; h < hq; h++) head_norm_rope_##SUF(row + h * d, q_norm, eps, c, s, d);      \
    for (long h = 0; h < hk; h++) head_norm_rope_##SUF(row + (hq + h) * d, k_norm, eps, c, s, d); \
}                                                                                               \
                                                                                                \
/* qkv rows [T, (hq + 2 hk) * d]: q and k normed/rotated in place, then k and v copied into   \
 * the pool slots out_loc[t] (k_cache/v_cache [slots, hk, d]). */                                \
void rope_store_##SUF(T *qkv, const int32_t *positions, const T *cos, const T *sin,             \
                      const T *q_norm, const T *k_norm, float eps, T *k_cache, T *v_cache,      \
                      const int64_t *out_loc, long rows, long hq, long hk, long d) {            \
    long width = (hq + 2 * hk) * d;                                                             \
    _Pragma("omp parallel for if(rows >= 64)")                                                  \
    for (long t = 0; t < rows; t++) {                                                           \
        T *row = qkv + t * width;                                                               \
        rope_row_##SUF(row, positions[t], cos, sin, q_norm, k_norm, eps, hq, hk, d);            \
        memcpy(k_cache + out_loc[t] * hk * d, row + hq * d, hk * d * sizeof(T));                \
        memcpy(v_cache + out_loc[t] * hk * d, row + (hq + hk) * d, hk * d * sizeof(T));         \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* rope_store for the int8 pool (kv_int8.c): each K and V head quantized into its slot, and the \
 * row's K/V replaced by the dequantized values (rounded to T) that the pool now holds. */      \
void rope_store_q8_##SUF(T *qkv, const int32_t *positions, const T *cos, const T *sin,          \
                         const T *q_norm, const T *k_norm, float eps, int8_t *k_cache,          \
                         int8_t *v_cache, float *k_scale, float *v_scale, const int64_t *out_loc, \
                         long rows, long hq, long hk, long d) {                                 \
    long width = (hq + 2 * hk) * d;                                                             \
    _Pragma("omp parallel for if(rows >= 64)")                                                  \
    for (long t = 0; t < rows; t++) {                                                           \
        T *row = qkv + t * width;                                                               \
        rope_row_##SUF(row, positions[t], cos, sin, q_norm, k_norm, eps, hq, hk, d);            \
        for (long h = 0; h < 2 * hk; h++) {                                                     \
            T *x = row + (hq + h) * d;                                                          \
            long slot = out_loc[t] * hk + h % hk;                                               \
            float f[256];                                                                       \
            Q8_LOAD_FAST_##SUF                                                                  \
            for (long i = 0; i < d; i++) f[i] = ld_##SUF(x, i);                                 \
            q8_head(f, d, (h < hk ? k_cache : v_cache) + slot * d, (h < hk ? k_scale : v_scale) + slot); \
            Q8_STORE_FAST_##SUF                                                                 \
            for (long i = 0; i < d; i++) st_##SUF(x, i, f[i]);                                  \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* Attention of query rows over the paged pool, read in place. Query row t (q: [T, hq, d],     \
 * taken with stride q_stride between rows) attends to the kv_len[t] slots                      \
 * page_table[table_row[t], 0 : kv_len[t]]. fp32 scores and softmax; out [T, hq * d]. */        \
void paged_attention_##SUF(const T *q, long q_stride, const T *k_cache, const T *v_cache,       \
                           const int32_t *page_table, long pt_stride, const int64_t *table_row,  \
                           const int64_t *kv_len, T *out, long rows, long hq, long hk, long d,   \
                           float scale, int nthreads) {                                         \
    long g = hq / hk;                                                                           \
    long tasks = rows * hk;                                                                     \
    long work = 0;                                                                              \
    for (long t = 0; t < rows; t++) work += kv_len[t];                                          \
    FAST_ATTN(SUF)                                                                              \
    int nt = (work * hk * d < 65536) ? 1 : nthreads;                                            \
    _Pragma("omp parallel for num_threads(nt) schedule(dynamic, 1)")                            \
    for (long task = 0; task < tasks; task++) {                                                 \
        long t = task / hk, kh = task % hk, n = kv_len[t];                                      \
        const int32_t *slots = page_table + table_row[t] * pt_stride;                           \
        float qf[8][256];                                                                       \
        float acc[8][256];                                                                      \
        float mx[8], den[8];                                                                    \
        for (long j = 0; j < g; j++) {                                                          \
            const T *qh = q + t * q_stride + (kh * g + j) * d;                                  \
            for (long i = 0; i < d; i++) { qf[j][i] = ld_##SUF(qh, i) * scale; acc[j][i] = 0.f; } \
            mx[j] = -INFINITY; den[j] = 0.f;                                                    \
        }                                                                                       \
        /* keys in blocks of 16: one max update (rescale) per block, exps as a vector loop */ \
        for (long s0 = 0; s0 < n; s0 += 16) {                                                   \
            long nb = n - s0 < 16 ? n - s0 : 16;                                                \
            float kf[16][256], vf[16][256];                                                     \
            for (long b = 0; b < nb; b++) {                                                     \
                const T *kr = k_cache + ((long)slots[s0 + b] * hk + kh) * d;                    \
                const T *vr = v_cache + ((long)slots[s0 + b] * hk + kh) * d;                    \
                for (long i = 0; i < d; i++) { kf[b][i] = ld_##SUF(kr, i); vf[b][i] = ld_##SUF(vr, i); } \
            }                                                                                   \
            for (long j = 0; j < g; j++) {                                                      \
                float sc[16], bm = -INFINITY;                                                   \
                for (long b = 0; b < nb; b++) {                                                 \
                    float dot = 0.f;                                                            \
                    _Pragma("omp simd reduction(+:dot)")                                        \
                    for (long i = 0; i < d; i++) dot += qf[j][i] * kf[b][i];                    \
                    sc[b] = dot;                                                                \
                    bm = dot > bm ? dot : bm;                                                   \
                }                                                                               \
                if (bm > mx[j]) {                                                               \
                    float corr = fast_exp(mx[j] - bm);                                          \
                    den[j] *= corr;                                                             \
                    for (long i = 0; i < d; i++) acc[j][i] *= corr;                             \
                    mx[j] = bm;                                                                 \
                }                                                                               \
                float m = mx[j], sum = 0.f;                                                     \
                _Pragma("omp simd reduction(+:sum)")                                            \
                for (long b = 0; b < nb; b++) { sc[b] = fast_exp(sc[b] - m); sum += sc[b]; }    \
                den[j] += sum;                                                                  \
                for (long b = 0; b < nb; b++) {                                                 \
                    float p = sc[b];                                                            \
                    _Pragma("omp simd")                                                         \
                    for (long i = 0; i < d; i++) acc[j][i] += p * vf[b][i];                     \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (long j = 0; j < g; j++) {                                                          \
            T *o = out + t * hq * d + (kh * g + j) * d;                                         \
            float inv = n > 0 ? 1.0f / den[j] : 0.f;                                            \
            for (long i = 0; i < d; i++) st_##SUF(o, i, acc[j][i] * inv);                       \
        }                                                                                       \
    }                                                                                           \
}


DEFINE_KERNELS(f32, float)
DEFINE_KERNELS(bf16, uint16_t)

/* Capability probe: the Python side checks the limits it relies on. */
long max_head_dim(void) { return 256; }
long max_group(void) { return 8; }
