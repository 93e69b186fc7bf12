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

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2 + FMA (x86-64-v3): 8 float32 lanes. */
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
/* 8 float32 rounded to bfloat16 (nearest even, as f32_to_bf16 and torch; finite inputs) */
static inline __m128i f32x8_to_bf16(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    /* each lane now holds 0..0xffff: the unsigned-saturating pack keeps it as is */
    return _mm_packus_epi32(_mm256_castsi256_si128(up), _mm256_extracti128_si256(up, 1));
}
static inline void store8_bf16(uint16_t *p, __m256 v) { _mm_storeu_si128((__m128i *)p, f32x8_to_bf16(v)); }
static inline __m256 round8_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(f32x8_to_bf16(v)), 16));
}
static inline float reduce8_add(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) of 8 floats: exp512's Cephes polynomial, x clamped to [-87, 88] (so 2^n stays a normal float: n is at
 * most 127), then scaled by 2^n built in the exponent bits (AVX2 has no scalef). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* silu of 8 floats, exp's argument stopped at 80 as in silu16 */
static inline __m256 silu8(__m256 g) {
    const __m256 minus_g = _mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(80.0f));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(minus_g)));
}
#endif

/* The element-wise vector of the build's widest tier, VF_WIDTH float32 lanes (16 with AVX-512, 8 with AVX2):
 * the fused element-wise ops (cpu_ops_impl.h) are written once against it. Without either, VF_WIDTH is not
 * defined and the ops run their scalar loops. */
#if defined(__AVX512F__)
#define VF_WIDTH 16
typedef __m512 vf32;
static inline vf32 vf_load_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vf32 vf_load_bf16(const uint16_t *p) { return load16_bf16(p); }
static inline void vf_store_f32(float *p, vf32 v) { _mm512_storeu_ps(p, v); }
static inline void vf_store_bf16(uint16_t *p, vf32 v) { store16_bf16(p, v); }
static inline vf32 vf_round_bf16(vf32 v) { return round16_bf16(v); }
static inline vf32 vf_set1(float f) { return _mm512_set1_ps(f); }
static inline vf32 vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf32 vf_add(vf32 a, vf32 b) { return _mm512_add_ps(a, b); }
static inline vf32 vf_sub(vf32 a, vf32 b) { return _mm512_sub_ps(a, b); }
static inline vf32 vf_mul(vf32 a, vf32 b) { return _mm512_mul_ps(a, b); }
static inline vf32 vf_fmadd(vf32 a, vf32 b, vf32 c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_reduce_add(vf32 v) { return _mm512_reduce_add_ps(v); }
static inline vf32 vf_silu(vf32 g) { return silu16(g); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VF_WIDTH 8
typedef __m256 vf32;
static inline vf32 vf_load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline vf32 vf_load_bf16(const uint16_t *p) { return load8_bf16(p); }
static inline void vf_store_f32(float *p, vf32 v) { _mm256_storeu_ps(p, v); }
static inline void vf_store_bf16(uint16_t *p, vf32 v) { store8_bf16(p, v); }
static inline vf32 vf_round_bf16(vf32 v) { return round8_bf16(v); }
static inline vf32 vf_set1(float f) { return _mm256_set1_ps(f); }
static inline vf32 vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf32 vf_add(vf32 a, vf32 b) { return _mm256_add_ps(a, b); }
static inline vf32 vf_sub(vf32 a, vf32 b) { return _mm256_sub_ps(a, b); }
static inline vf32 vf_mul(vf32 a, vf32 b) { return _mm256_mul_ps(a, b); }
static inline vf32 vf_fmadd(vf32 a, vf32 b, vf32 c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf_reduce_add(vf32 v) { return reduce8_add(v); }
static inline vf32 vf_silu(vf32 g) { return silu8(g); }
#endif
#ifdef VF_WIDTH
static inline vf32 vf_round_f32(vf32 v) { return v; }
#endif

/* silu(g) of one float, exp's argument stopped at 80 as in the vector bodies: below g = -88.7 exp(-g) is inf and
 * -ffast-math's reciprocal division turned g / inf into 0 * inf = NaN. */
static inline float silu_f32(float g) { return g / (1.0f + expf(fminf(-g, 80.0f))); }

#endif
