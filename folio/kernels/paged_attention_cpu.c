/* Paged attention on the CPU, float32, reading K/V blocks in place (no gather, no padding).
 *
 * One work item = one query row x one KV head: the G = num_heads / num_kv_heads query heads that share the KV
 * head walk the row's blocks twice (scores, then the weighted sum of V), so each K/V row is read once per item
 * straight out of the cache. Items are spread over the OpenMP threads of torch's own runtime (the library is
 * loaded after torch, so "libgomp.so.1" resolves to the copy torch already loaded).
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

typedef struct {
    const float *k_cache, *v_cache;
    const int32_t *blocks; /* the row's block-table row */
    int64_t ctx, group, head_dim, block_size, pos_stride, block_stride; /* strides in floats */
    float scale;
} item_t;

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

/* Plain loops: any group size and head_dim. acc [group, head_dim]. */
static void attend_generic(const item_t *it, const float *q, float *out, float *scores, float *acc) {
    const int64_t G = it->group, D = it->head_dim, ctx = it->ctx, bs = it->block_size;
    const int64_t pos_stride = it->pos_stride, block_stride = it->block_stride;
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        const float *kb = it->k_cache + (int64_t)it->blocks[start / bs] * block_stride;
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t g = 0; g < G; ++g) {
                const float *qg = q + g * D, *k = kb + t * pos_stride;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
                scores[g * ctx + start + t] = s * it->scale;
            }
        }
    }
    softmax_rows(scores, G, ctx);
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        const float *vb = it->v_cache + (int64_t)it->blocks[start / bs] * block_stride;
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t g = 0; g < G; ++g) {
                const float p = scores[g * ctx + start + t], *v = vb + t * pos_stride;
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
            }
        }
    }
    memcpy(out, acc, sizeof(float) * G * D);
}

#ifdef __AVX512F__
/* G query heads x C chunks of 16 floats (head_dim = 16 C), all loops of compile-time length: gcc unrolls them
 * and keeps q (scores pass) and the accumulators (V pass) in zmm registers. */
#define DEFINE_ATTEND_AVX512(G, C)                                                                          \
    static void attend_g##G##_c##C(const item_t *it, const float *q, float *out, float *scores) {          \
        const int64_t ctx = it->ctx, bs = it->block_size;                                                    \
        const int64_t pos_stride = it->pos_stride, block_stride = it->block_stride;                          \
        __m512 qv[G][C];                                                                                     \
        for (int g = 0; g < G; ++g)                                                                          \
            for (int c = 0; c < C; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + (g * C + c) * 16),      \
                                                                 _mm512_set1_ps(it->scale));                 \
        for (int64_t start = 0; start < ctx; start += bs) {                                                  \
            const int64_t n = ctx - start < bs ? ctx - start : bs;                                           \
            const float *kb = it->k_cache + (int64_t)it->blocks[start / bs] * block_stride;                 \
            for (int64_t t = 0; t < n; ++t) {                                                                \
                const float *k = kb + t * pos_stride;                                                        \
                __m512 kv[C];                                                                                \
                for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(k + c * 16);                             \
                for (int g = 0; g < G; ++g) {                                                                \
                    __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);                                               \
                    for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(qv[g][c], kv[c], s);                     \
                    scores[g * ctx + start + t] = _mm512_reduce_add_ps(s);                                   \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        softmax_rows(scores, G, ctx);                                                                        \
        __m512 acc[G][C];                                                                                    \
        for (int g = 0; g < G; ++g)                                                                          \
            for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();                                     \
        for (int64_t start = 0; start < ctx; start += bs) {                                                  \
            const int64_t n = ctx - start < bs ? ctx - start : bs;                                           \
            const float *vb = it->v_cache + (int64_t)it->blocks[start / bs] * block_stride;                 \
            for (int64_t t = 0; t < n; ++t) {                                                                \
                const float *v = vb + t * pos_stride;                                                        \
                __m512 vv[C];                                                                                \
                for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + c * 16);                             \
                for (int g = 0; g < G; ++g) {                                                                \
                    const __m512 p = _mm512_set1_ps(scores[g * ctx + start + t]);                            \
                    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);            \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int g = 0; g < G; ++g)                                                                          \
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (g * C + c) * 16, acc[g][c]);                 \
    }

DEFINE_ATTEND_AVX512(1, 4)
DEFINE_ATTEND_AVX512(2, 4)
DEFINE_ATTEND_AVX512(3, 4)
DEFINE_ATTEND_AVX512(4, 4)
DEFINE_ATTEND_AVX512(5, 4)
DEFINE_ATTEND_AVX512(6, 4)
DEFINE_ATTEND_AVX512(1, 8)
DEFINE_ATTEND_AVX512(2, 8)
DEFINE_ATTEND_AVX512(3, 8)
#endif

static void attend(const item_t *it, const float *q, float *out, float *scores, float *acc) {
#ifdef __AVX512F__
#define CASE(G, C)                                                                                           \
    if (it->group == G && it->head_dim == 16 * C) return attend_g##G##_c##C(it, q, out, scores);
    CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(5, 4) CASE(6, 4) CASE(1, 8) CASE(2, 8) CASE(3, 8)
#undef CASE
#endif
    attend_generic(it, q, out, scores, acc);
}

/* k_cache / v_cache point at KV head 0 of block 0; a position's row is
 *   cache + block * block_stride + kv_head * head_stride + offset_in_block * pos_stride   (strides in floats),
 * so both [NB, BS, KV, D] (pos_stride KV*D, head_stride D) and [NB, KV, BS, D] (pos_stride D, head_stride BS*D)
 * layouts are served. Returns 0, or -1 if a score buffer could not be allocated. */
int folio_paged_attention_f32(const float *q, float *out, const float *k_cache, const float *v_cache,
                              int64_t block_stride, int64_t head_stride, int64_t pos_stride,
                              const int32_t *block_table, int64_t bt_stride, const int64_t *rows,
                              const int32_t *row_req, const int32_t *row_ctx, int64_t num_rows, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                              int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_ctx = 1;
    for (int64_t i = 0; i < num_rows; ++i) max_ctx = row_ctx[i] > max_ctx ? row_ctx[i] : max_ctx;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * max_ctx);
        float *acc = malloc(sizeof(float) * group * head_dim);
        if (scores == NULL || acc == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_rows; ++i) {
            if (failed) continue;
            for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
                const int64_t offset = rows[i] * num_heads * head_dim + kv_head * group * head_dim;
                const item_t it = {k_cache + kv_head * head_stride, v_cache + kv_head * head_stride,
                                   block_table + (int64_t)row_req[i] * bt_stride, row_ctx[i], group, head_dim,
                                   block_size, pos_stride, block_stride, scale};
                attend(&it, q + offset, out + offset, scores, acc);
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
