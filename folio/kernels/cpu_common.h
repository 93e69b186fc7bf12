/* What every CPU kernel source shares: includes, name pasting, and the bfloat16 <-> float32 conversions.
 * All kernel sources are compiled as one translation unit (cpu_kernels.c), so each helper is defined once here. */
#ifndef FOLIO_CPU_COMMON_H
#define FOLIO_CPU_COMMON_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* sysconf: the L3 size (llama_cpu.c) */
#if defined(__AVX2__) || defined(__AVX512F__)
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

#ifdef __AVX512F__
/* 16 consecutive elements as float32 */
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 16 float32 rounded to bfloat16 (nearest even, as f32_to_bf16 and torch; finite inputs) */
static inline __m256i f32x16_to_bf16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16));
#endif
}
static inline void store16_f32(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16_bf16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, f32x16_to_bf16(v)); }
/* v rounded to bfloat16 precision, kept as float32 */
static inline __m512 round16_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32x16_to_bf16(v)), 16));
}
static inline __m512 round16_f32(__m512 v) { return v; }

/* exp(x) of 16 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, then
 * scaled by 2^n); within 2 ulp of expf for x in [-87, 88], 0 below -87 and +inf above 88.7. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln2 in two parts (Cody-Waite) */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* silu(g) = g / (1 + exp(-g)) of 16 floats. exp's argument stops at 80: with -ffast-math gcc divides by a
 * reciprocal estimate and a Newton step, which made 0 * inf = NaN of exp(-g) = inf (g < -88.7); silu(g) there is
 * within a float32 denormal of 0 either way. */
static inline __m512 silu16(__m512 g) {
    const __m512 minus_g = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(80.0f));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(minus_g)));
}
#endif

#endif
