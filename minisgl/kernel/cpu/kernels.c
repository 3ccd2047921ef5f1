/* Fused CPU kernels for the decode step (engine/cpu_decode.py), called through ctypes.
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

static inline float bf16_to_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
/* exp(x), branch-free so loops over it vectorize (libm's expf
 * does not without -ffast-math): 2^(x log2 e) split into 2^n * 2^f, 2^f by a degree-6
 * polynomial on [-0.5, 0.5]; relative error ~2e-7; x is clamped to [-87, 88]. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f;
    float n = __builtin_rintf(t);
    float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}
static inline float ld_f32(const float *p, long i) { return p[i]; }
static inline void st_f32(float *p, long i, float v) { p[i] = v; }
static inline float rnd_f32(float v) { return v; }
static inline float ld_bf16(const uint16_t *p, long i) { return bf16_to_f(p[i]); }
static inline void st_bf16(uint16_t *p, long i, float v) { p[i] = f_to_bf16(v); }
static inline float rnd_bf16(float v) { return bf16_to_f(f_to_bf16(v)); }

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
/* qkv rows [T, (hq + 2 hk) * d]: q and k normed/rotated in place, then k and v copied into   \
 * the pool slots out_loc[t] (k_cache/v_cache [slots, hk, d]). */                                \
void rope_store_##SUF(T *qkv, const int32_t *positions, const T *cos, const T *sin,             \
                      const T *q_norm, const T *k_norm, float eps, T *k_cache, T *v_cache,      \
                      const int64_t *out_loc, long rows, long hq, long hk, long d) {            \
    long width = (hq + 2 * hk) * d;                                                             \
    _Pragma("omp parallel for if(rows >= 64)")                                                  \
    for (long t = 0; t < rows; t++) {                                                           \
        T *row = qkv + t * width;                                                               \
        const T *c = cos + (long)positions[t] * d, *s = sin + (long)positions[t] * d;           \
        for (long h = 0; h < hq; h++) head_norm_rope_##SUF(row + h * d, q_norm, eps, c, s, d);  \
        for (long h = 0; h < hk; h++)                                                           \
            head_norm_rope_##SUF(row + (hq + h) * d, k_norm, eps, c, s, d);                     \
        memcpy(k_cache + out_loc[t] * hk * d, row + hq * d, hk * d * sizeof(T));                \
        memcpy(v_cache + out_loc[t] * hk * d, row + (hq + hk) * d, hk * d * sizeof(T));         \
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
