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
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void attend_one(const float *restrict q, float *restrict out, const float *restrict k_cache,
                       const float *restrict v_cache, const int32_t *restrict blocks, int64_t ctx, int64_t kv_head,
                       int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                       float *restrict scores /* [group, ctx] */, float *restrict acc /* [group, head_dim] */) {
    const int64_t pos_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * pos_stride;
    /* pass 1: scores[g][p] = scale * q_g . k_p */
    for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const float *kb = k_cache + (int64_t)blocks[start / block_size] * block_stride + kv_head * head_dim;
        for (int64_t t = 0; t < n; ++t) {
            const float *k = kb + t * pos_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = q + g * head_dim;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * k[d];
                scores[g * ctx + start + t] = s * scale;
            }
        }
    }
    /* softmax per query head */
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
    /* pass 2: acc[g] = sum_p probs[g][p] * v_p */
    memset(acc, 0, sizeof(float) * group * head_dim);
    for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const float *vb = v_cache + (int64_t)blocks[start / block_size] * block_stride + kv_head * head_dim;
        for (int64_t t = 0; t < n; ++t) {
            const float *v = vb + t * pos_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float p = scores[g * ctx + start + t];
                float *ag = acc + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * v[d];
            }
        }
    }
    memcpy(out, acc, sizeof(float) * group * head_dim);
}

int folio_paged_attention_f32(const float *q, float *out, const float *k_cache, const float *v_cache,
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
#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < num_rows * num_kv_heads; ++item) {
            if (failed) continue;
            const int64_t i = item / num_kv_heads, kv_head = item % num_kv_heads;
            const int64_t offset = rows[i] * num_heads * head_dim + kv_head * group * head_dim;
            attend_one(q + offset, out + offset, k_cache, v_cache, block_table + (int64_t)row_req[i] * bt_stride,
                       row_ctx[i], kv_head, group, num_kv_heads, head_dim, block_size, scale, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
