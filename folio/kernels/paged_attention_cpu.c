/* Paged attention on the CPU, float32, reading K/V blocks in place (no gather, no padding).
 *
 * One work item = one query row x one KV head: the G = num_heads / num_kv_heads query heads that share the KV
 * head walk the row's blocks twice (scores, then the weighted sum of V), so each K/V row is read once per item
 * straight out of the cache. Items are spread over the OpenMP threads of torch's own runtime (the library is
 * loaded after torch, so "libgomp.so.1" resolves to the copy torch already loaded).
 *
 * The cache holds float32 or bfloat16 (folio_paged_attention_f32 / _bf16); q, scores and out are float32.
 *
 * Layouts (all contiguous):
 *   q, out       [T, H, D]          rows[i] selects the query row of item row i
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

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16; /* bfloat16 is the high half of a float32 */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#ifdef __AVX512F__
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
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
#include "paged_attention_cpu_impl.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_SCALAR
#undef KV_LOAD16

#define KV_T uint16_t
#define KV_SUFFIX bf16
#define KV_SCALAR(x) bf16_to_f32(x)
#define KV_LOAD16 load16_bf16
#include "paged_attention_cpu_impl.h"
