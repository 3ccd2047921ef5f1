/* Vector math the CPU kernels share (kernels.c, kv_int8.c, amx.c): a branch-free exp, the bf16
 * roundings of 16 fp32 lanes and the SiLU of bf16 activations. One copy, so a kernel that fuses
 * SiLU into its store (amx.c) rounds exactly as the separate silu_mul kernel does. */
#ifndef MINISGL_VEC_MATH_H
#define MINISGL_VEC_MATH_H
#include <stdint.h>
#include <string.h>

/* fast_exp's polynomial for 2^f, f in [-0.5, 0.5] (highest degree first), shared by its vector
 * forms so that all of them compute the same function */
#define EXP_C6 1.535336188319500e-4f
#define EXP_C5 1.339887440266574e-3f
#define EXP_C4 9.618437357674640e-3f
#define EXP_C3 5.550332471162809e-2f
#define EXP_C2 2.402264791363012e-1f
#define EXP_C1 6.931472028550421e-1f

/* exp(x), branch-free so loops over it vectorize (libm's expf
 * does not without -ffast-math): 2^(x log2 e) split into 2^n * 2^f, 2^f by a degree-6
 * polynomial on [-0.5, 0.5]; relative error ~2e-7; x is clamped to [-87, 88]. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f;
    float n = __builtin_rintf(t);
    float f = t - n;
    float p = EXP_C6;
    p = p * f + EXP_C5;
    p = p * f + EXP_C4;
    p = p * f + EXP_C3;
    p = p * f + EXP_C2;
    p = p * f + EXP_C1;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* fast_exp on 8 lanes (attn_avx2.c's softmax): the same clamp, split and polynomial. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* 8 bf16 -> fp32 lanes (a bf16 is an fp32's top half) */
static inline __m256 ld8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* f_to_bf16 on 8 lanes (round to nearest even, NaN kept quiet), in the lanes' low halves */
static inline __m256i bf16_bits8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_srli_epi32(r, 16);
}
static inline __m256 rnd8_bf16(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }
static inline void st8_bf16(uint16_t *p, __m256 v) {
    __m256i b = bf16_bits8(v);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif
#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n); /* p * 2^n, exact (n in [-126, 127] after the clamp) */
}
/* f_to_bf16 on 16 lanes, denormals included (round to nearest even, NaN kept quiet): where a
 * result must be bitwise torch's rounding whatever the values */
static inline __m256i f32_to_bf16x16_exact(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
/* fp32 -> bf16 bits, 16 lanes, round to nearest even as f_to_bf16. With AVX512-BF16 that is one
 * VCVTNEPS2BF16, which differs from f_to_bf16 only on denormals (flushed to zero; below 1.2e-38,
 * not a value activations take); without it, the bit arithmetic of f_to_bf16. */
static inline __m256i f16_to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    return f32_to_bf16x16_exact(v);
}
static inline __m512 bf16x16_to_f(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
static inline __m512 rnd16_bf16(__m512 v) { return bf16x16_to_f(f16_to_bf16x16(v)); }

/* silu(a) of 16 bf16 activations a (fp32 lanes holding bf16 values), rounded to bf16 as torch's
 * silu output is: a / (1 + exp(-a)) without the divide (half of the loop's time): VRCP14, one
 * Newton step, then the quotient corrected by its exact residual (q + (a - q den) / den), which
 * is within an ulp of the divide, so bf16 roundings agree but for near-ties. */
static inline __m512 silu16_bf16(__m512 a) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
    __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), e), inv = _mm512_rcp14_ps(den);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.0f)));
    __m512 q = _mm512_mul_ps(a, inv);
    q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, den, a), inv, q);
    return rnd16_bf16(q);
}
#endif
#endif
