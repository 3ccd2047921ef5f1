/* bf16 <-> fp32 scalars shared by the CPU kernels: bf16 is the top half of an fp32, and the
 * rounding is torch's (to nearest even, NaN kept quiet), so every kernel rounds as the torch ops
 * it replaces. */
#ifndef MINISGL_BF16_H
#define MINISGL_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Which skinny decode GEMMs this build has (gemv_bf16, qgemv_q4/q8_bf16): 512, the VDPBF16PS
 * ones (gemv.c, qgemv.c); 2, the AVX2 + FMA ones (skinny_avx2.c); 0, none (torch's GEMMs). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__F16C__)
#define MINISGL_SKINNY_ISA 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MINISGL_SKINNY_ISA 2
#else
#define MINISGL_SKINNY_ISA 0
#endif
#endif
