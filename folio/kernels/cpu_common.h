/* What every CPU kernel source shares: includes, name pasting, and the bfloat16 <-> float32 conversions.
 * All kernel sources are compiled as one translation unit (cpu_kernels.c), so each helper is defined once here. */
#ifndef FOLIO_CPU_COMMON_H
#define FOLIO_CPU_COMMON_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <omp.h>

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16; /* bfloat16 is the high half of a float32 */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif
