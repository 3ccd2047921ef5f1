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
#endif
