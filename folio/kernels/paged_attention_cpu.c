/* Paged attention on the CPU, float32, reading K/V blocks in place (no gather, no padding).
 *
 * One work item = one query row x one KV head: the G = num_heads / num_kv_heads query heads that share the KV
 * head walk the row's blocks twice (scores, then the weighted sum of V), so each K/V row is read once per item
 * straight out of the cache. Items are spread over the OpenMP threads of torch's own runtime (the library is
 * loaded after torch, so "libgomp.so.1" resolves to the copy torch already loaded).
 *
 * The cache holds float32 or bfloat16 (folio_paged_attention_f32 / _bf16); scores and sums are float32.
 *
 * Layouts:
 *   q, out       [T, H, D]          rows[i] selects the query row of item row i; q's rows may be strided, and q
 *                                   and out may each be float32 or bfloat16 (converted once per item)
 *   k/v_cache    [NB, BS, KV, D]    position p of a request lives at block_table[req][p / BS], offset p % BS
 *   block_table  [R, bt_stride] int32
 *   row_req [N] int32 request of each row; row_ctx [N] int32 positions 0..row_ctx-1 are visible to the row.
 * Example: a decode at context 9 has row_ctx 9; the 3 rows of a chunk at positions 6, 7, 8 have 7, 8, 9.
 *
 * With AVX-512 and head_dim a multiple of 16 (64 and 128 in practice), the per-position work is unrolled for the
 * group size at compile time so the G x head_dim/16 accumulators stay in registers; other shapes take the plain
 * C loops, which the compiler vectorizes over head_dim.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* query rows per prefill work item (see folio_prefill_attention_*) */
#define PREFILL_TILE 16
/* query heads one decode call handles at once (the AVX-512 path keeps a max and a sum per head on the stack) */
#define DECODE_MAX_HEADS 64

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16; /* bfloat16 is the high half of a float32 */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* dst[0..n) = src[offset..offset+n) as float32, src float32 or (is_bf16) bfloat16 */
static void load_as_f32(const void *src, int is_bf16, int64_t offset, int64_t n, float *dst) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_f32(s[j]);
    } else {
        memcpy(dst, (const float *)src + offset, sizeof(float) * n);
    }
}

static void store_from_f32(void *dst, int is_bf16, int64_t offset, int64_t n, const float *src) {
    if (is_bf16) {
        uint16_t *d = (uint16_t *)dst + offset;
        for (int64_t j = 0; j < n; ++j) d[j] = f32_to_bf16(src[j]);
    } else {
        memcpy((float *)dst + offset, src, sizeof(float) * n);
    }
}

#ifdef __AVX512F__
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* r[i] <- column i of the 16 x 16 block whose rows are r[0..15] (unpack, shuffle within and across lanes) */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);     /* a0 b0 a1 b1 | a4 b4 a5 b5 | ... */
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]); /* a2 b2 a3 b3 | ... */
    }
    for (int i = 0; i < 4; ++i) { /* r[4i + k], lane L: rows 4i..4i+3 of column k + 4L */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) { /* column k + 4L = lane L of r[k], r[4 + k], r[8 + k], r[12 + k] */
        const __m512 u0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), u1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
        t[k] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        t[k + 4] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
        t[k + 8] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        t[k + 12] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

#ifdef __AVX512BF16__
/* 32 bf16 from memory as a dot-product operand (a cast of _mm512_loadu_si512's result made gcc 12 bounce every
 * load through the stack) */
static inline __m512bh load32_bh(const void *p) {
    __m512bh v;
    memcpy(&v, p, sizeof v);
    return v;
}
#endif

/* exp(x) of 16 floats (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, then
 * scaled by 2^n); within 2 ulp of expf over the softmax's range x <= 0, and 0 below -87. */
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

/* lane j of the result = the sum of the 16 lanes of s[j]: a reduction tree (45 shuffles and adds for 16 sums,
 * where 16 separate horizontal sums take about 130) */
static inline __m512 reduce16(const __m512 s[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i) /* lane-local pair sums of s[2i], s[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
    for (int i = 0; i < 4; ++i) /* 128-bit lane L of b[i]: the lane-L sums of s[4i .. 4i+3] */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}
#endif

/* probs[g][p] = softmax_p(scores[g][p]) in place, for each of the group's query heads */
static void softmax_rows(float *scores, int64_t group, int64_t ctx) {
    for (int64_t g = 0; g < group; ++g) {
        float *sg = scores + g * ctx;
        float m = -FLT_MAX;
        for (int64_t p = 0; p < ctx; ++p) m = sg[p] > m ? sg[p] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < ctx; ++p) {
            sg[p] = expf(sg[p] - m);
            sum += sg[p];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t p = 0; p < ctx; ++p) sg[p] *= inv;
    }
}

#define KV_T float
#define KV_SUFFIX f32
#define KV_SCALAR(x) (x)
#define KV_LOAD16 load16_f32
#define KV_IS_BF16 0
#include "paged_attention_cpu_impl.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_SCALAR
#undef KV_LOAD16
#undef KV_IS_BF16

#define KV_T uint16_t
#define KV_SUFFIX bf16
#define KV_SCALAR(x) bf16_to_f32(x)
#define KV_LOAD16 load16_bf16
#define KV_IS_BF16 1
#include "paged_attention_cpu_impl.h"
