/* bf16 <-> fp32 for the C kernels (paged_decode.c, decode_ops.c). Branch-free, so that loops over them
 * vectorize. f2bf rounds to nearest even, as torch's CPU kernels do; a NaN stays a (quiet) NaN, as in
 * torch (plain rounding could carry a NaN with a small payload into inf). */
#ifndef BATCHFLEET_BF16_H
#define BATCHFLEET_BF16_H
#include <stdint.h>

static inline float bf2f(uint16_t x) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)x << 16};
    return v.f;
}

static inline uint16_t f2bf(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    const uint16_t r = (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
    return (v.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : r;
}
#endif
