/* The int8 KV cache on the CPU (kvcache/pool.py, kv_cache_dtype="int8"): its quantizing store
 * and the decode attention that reads it.
 *
 * Why: a 64-request decode step of the embedded model streams ~0.4 GB of bf16 K/V, more than
 * the weights; int8 codes with one fp32 scale per (token, KV head) halve that stream.
 *
 * Format (the pool's): scale = absmax / 127, code = round-half-even(x * (127 / absmax)), an
 * all-zero head has scale 0 and codes 0; the dequantized value is code * scale in fp32. The
 * store computes exactly the fp32 operations of quantize_int8_per_head, so its codes and
 * scales are bitwise the reference store's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "attn_common.h"

/* Quantize one head of d fp32 values into codes/scale, and leave in x what the pool now holds
 * (code * scale): callers hand those values to attention over this step's own rows, so every
 * reader sees the same K/V. */
void q8_head(float *x, long d, int8_t *codes, float *scale) {
#ifdef __AVX512F__
    if (d % 16 == 0) { /* the same operations 16 lanes wide (a 500-token prefill stores 5.8M values) */
        __m512 m = _mm512_setzero_ps();
        for (long i = 0; i < d; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
        float amax = _mm512_reduce_max_ps(m);
        float inv = amax > 0.f ? 127.0f / amax : 0.f, s = amax / 127.0f;
        const __m512 vinv = _mm512_set1_ps(inv), vs = _mm512_set1_ps(s), lim = _mm512_set1_ps(127.f);
        for (long i = 0; i < d; i += 16) {
            __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm512_min_ps(_mm512_max_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
            _mm512_storeu_ps(x + i, _mm512_mul_ps(r, vs));
        }
        *scale = s;
        return;
    }
#endif
    float amax = 0.f;
    for (long i = 0; i < d; i++) amax = fmaxf(amax, fabsf(x[i]));
    float inv = amax > 0.f ? 127.0f / amax : 0.f, s = amax / 127.0f;
    for (long i = 0; i < d; i++) {
        float r = rintf(x[i] * inv); /* the default rounding mode: to nearest, ties to even */
        r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
        codes[i] = (int8_t)r;
        x[i] = r * s;
    }
    *scale = s;
}

/* One (query row, KV head) task: the g query heads qf [g][d] (fp32, already times the softmax
 * scale) over n keys of the pool's slots; out [g][d] fp32. */
static void attn_q8_generic(const float *qf, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale,
                            const float *v_scale, const int32_t *slots, long n, long hk, long kh, long g, long d,
                            float *out) {
    float mx[8], den[8];
    for (long j = 0; j < g; j++) {
        mx[j] = -INFINITY, den[j] = 0.f;
        for (long i = 0; i < d; i++) out[j * d + i] = 0.f;
    }
    for (long s = 0; s < n; s++) {
        long row = (long)slots[s] * hk + kh;
        const int8_t *kr = k_cache + row * d, *vr = v_cache + row * d;
        float ks = k_scale[row], vs = v_scale[row];
        for (long j = 0; j < g; j++) {
            float dot = 0.f;
            for (long i = 0; i < d; i++) dot += qf[j * d + i] * (float)kr[i];
            dot *= ks;
            if (dot > mx[j]) {
                float corr = fast_exp(mx[j] - dot);
                den[j] *= corr;
                for (long i = 0; i < d; i++) out[j * d + i] *= corr;
                mx[j] = dot;
            }
            float p = fast_exp(dot - mx[j]);
            den[j] += p;
            float w = p * vs;
            for (long i = 0; i < d; i++) out[j * d + i] += w * (float)vr[i];
        }
    }
    for (long j = 0; j < g; j++) {
        float inv = n > 0 ? 1.0f / den[j] : 0.f;
        for (long i = 0; i < d; i++) out[j * d + i] *= inv;
    }
}

#ifdef __AVX512F__
/* head_dim D in {64, 128}: keys in blocks of 16. Each key's codes are widened to fp32 once and
 * dotted with every query head of the group; the 16 partial-sum vectors of a block reduce in
 * one shuffle tree, then the K scales apply lane-wise. V rows: acc += (p * v_scale) * codes. */
#define DEFINE_Q8_ATTN(D)                                                                         \
static void attn_q8_task_##D(const float *qf, const int8_t *k_cache, const int8_t *v_cache,      \
                             const float *k_scale, const float *v_scale, const int32_t *slots,    \
                             long n, long hk, long kh, long g, float *out) {                      \
    enum { V = D / 16 };                                                                          \
    __m512 qv[8][V], acc[8][V];                                                                   \
    float mx[8], den[8];                                                                          \
    for (long j = 0; j < g; j++) {                                                                \
        for (int c = 0; c < V; c++) {                                                             \
            qv[j][c] = _mm512_loadu_ps(qf + j * D + c * 16);                                      \
            acc[j][c] = _mm512_setzero_ps();                                                      \
        }                                                                                         \
        mx[j] = -INFINITY, den[j] = 0.f;                                                          \
    }                                                                                             \
    for (long s0 = 0; s0 < n; s0 += 16) {                                                         \
        int nb = n - s0 < 16 ? (int)(n - s0) : 16;                                                \
        __mmask16 live = (__mmask16)((1u << nb) - 1u);                                            \
        /* the next blocks' scattered rows and scales, so the loads below stream */               \
        PREFETCH_KV_ROWS(k_cache, v_cache, k_scale, v_scale, slots, s0 + 16, s0 + 32, n, hk, kh, D, _MM_HINT_T0) \
        PREFETCH_KV_ROWS(k_cache, v_cache, k_scale, v_scale, slots, s0 + ATTN_PF_FAR_INT8, s0 + ATTN_PF_FAR_INT8 + 16, \
                         n, hk, kh, D, _MM_HINT_T1)                                               \
        float ks[16], vs[16];                                                                     \
        __m512 part[8][16];                                                                       \
        for (int b = 0; b < 16; b++) {                                                            \
            if (b >= nb) { /* padding lanes: masked out below */                                  \
                for (long j = 0; j < g; j++) part[j][b] = _mm512_setzero_ps();                    \
                ks[b] = vs[b] = 0.f;                                                              \
                continue;                                                                         \
            }                                                                                     \
            long row = (long)slots[s0 + b] * hk + kh;                                             \
            ks[b] = k_scale[row], vs[b] = v_scale[row];                                           \
            const int8_t *kr = k_cache + row * D;                                                 \
            __m512 kf[V];                                                                         \
            for (int c = 0; c < V; c++)                                                           \
                kf[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(kr + c * 16)))); \
            for (long j = 0; j < g; j++) {                                                        \
                __m512 t = _mm512_mul_ps(qv[j][0], kf[0]);                                        \
                for (int c = 1; c < V; c++) t = _mm512_fmadd_ps(qv[j][c], kf[c], t);              \
                part[j][b] = t;                                                                   \
            }                                                                                     \
        }                                                                                         \
        const __m512 ksv = _mm512_loadu_ps(ks);                                                   \
        float pj[8][16];                                                                          \
        for (long j = 0; j < g; j++) {                                                            \
            __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(hsum16x16(part[j]), ksv)); \
            __m512 pv = softmax_block(sv, live, mx + j, den + j, acc[j], V);                      \
            _mm512_storeu_ps(pj[j], _mm512_mul_ps(pv, _mm512_loadu_ps(vs)));                      \
        }                                                                                         \
        for (int b = 0; b < nb; b++) {                                                            \
            const int8_t *vr = v_cache + ((long)slots[s0 + b] * hk + kh) * D;                     \
            __m512 vf[V];                                                                         \
            for (int c = 0; c < V; c++)                                                           \
                vf[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(vr + c * 16)))); \
            for (long j = 0; j < g; j++) {                                                        \
                __m512 w = _mm512_set1_ps(pj[j][b]);                                              \
                for (int c = 0; c < V; c++) acc[j][c] = _mm512_fmadd_ps(w, vf[c], acc[j][c]);     \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (long j = 0; j < g; j++) {                                                                \
        float inv = n > 0 ? 1.0f / den[j] : 0.f;                                                  \
        for (int c = 0; c < V; c++) _mm512_storeu_ps(out + j * D + c * 16, _mm512_mul_ps(acc[j][c], _mm512_set1_ps(inv))); \
    }                                                                                             \
}
DEFINE_Q8_ATTN(64)
DEFINE_Q8_ATTN(128)
#endif

static inline float ld_f32(const float *p, long i) { return p[i]; }
static inline void st_f32(float *p, long i, float v) { p[i] = v; }
static inline float ld_bf16(const uint16_t *p, long i) { return bf16_to_f(p[i]); }
static inline void st_bf16(uint16_t *p, long i, float v) { p[i] = f_to_bf16(v); }

/* Query row t (q [T, hq, d], rows q_stride apart) attends to the kv_len[t] slots
 * page_table[table_row[t], 0 : kv_len[t]] of the int8 pool (k/v_cache [slots, hk, d] codes,
 * k/v_scale [slots, hk]); fp32 scores, softmax and sums; out [T, hq * d] in T. */
#define DEFINE_Q8_ENTRY(SUF, T)                                                                   \
void paged_attention_q8_##SUF(const T *q, long q_stride, const int8_t *k_cache, const int8_t *v_cache, \
                              const float *k_scale, const float *v_scale, const int32_t *page_table, \
                              long pt_stride, const int64_t *table_row, const int64_t *kv_len, T *out, \
                              long rows, long hq, long hk, long d, float scale, int nthreads) {   \
    long g = hq / hk, work = 0;                                                                   \
    for (long t = 0; t < rows; t++) work += kv_len[t];                                            \
    int nt = (work * hk * d < 65536) ? 1 : nthreads;                                              \
    /* a request's KV heads on one thread, one after another (see kernels.c's FAST_ATTN) */        \
    long chunk_ = rows >= 2 * nt ? hk : 1; /* (a batch of one keeps a head per thread) */         \
    _Pragma("omp parallel for num_threads(nt) schedule(dynamic, chunk_)")                         \
    for (long task = 0; task < rows * hk; task++) {                                               \
        long t = task / hk, kh = task % hk;                                                       \
        const int32_t *slots = page_table + table_row[t] * pt_stride;                             \
        float qf[8 * 256], of[8 * 256];                                                           \
        for (long i = 0; i < g * d; i++) qf[i] = ld_##SUF(q + t * q_stride + kh * g * d, i) * scale; \
        Q8_FAST                                                                                   \
        attn_q8_generic(qf, k_cache, v_cache, k_scale, v_scale, slots, kv_len[t], hk, kh, g, d, of); \
    store:                                                                                        \
        for (long i = 0; i < g * d; i++) st_##SUF(out + t * hq * d + kh * g * d, i, of[i]);       \
    }                                                                                             \
}
#ifdef __AVX512F__
#define Q8_FAST                                                                                   \
    if (d == 64) { attn_q8_task_64(qf, k_cache, v_cache, k_scale, v_scale, slots, kv_len[t], hk, kh, g, of); goto store; } \
    if (d == 128) { attn_q8_task_128(qf, k_cache, v_cache, k_scale, v_scale, slots, kv_len[t], hk, kh, g, of); goto store; }
#else
#define Q8_FAST
#endif
DEFINE_Q8_ENTRY(f32, float)
DEFINE_Q8_ENTRY(bf16, uint16_t)
