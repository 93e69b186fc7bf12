/* The kernel body for one K/V element type, included once per type by paged_attention_cpu.c with
 *   KV_T        the cache's element type           KV_SUFFIX  the name suffix (f32, bf16)
 *   KV_SCALAR   one element -> float               KV_LOAD16  16 elements -> __m512 (AVX-512 builds)
 * Queries, scores and outputs are float32 whatever the cache holds. */
#define ITEM CAT(item_, KV_SUFFIX)

typedef struct {
    const KV_T *k_cache, *v_cache;
    const int32_t *blocks; /* the row's block-table row */
    int64_t ctx, group, head_dim, block_size, pos_stride, block_stride; /* strides in elements */
    float scale;
} ITEM;

/* Plain loops: any group size and head_dim. acc [group, head_dim]. */
static void CAT(attend_generic_, KV_SUFFIX)(const ITEM *it, const float *q, float *out, float *scores, float *acc) {
    const int64_t G = it->group, D = it->head_dim, ctx = it->ctx, bs = it->block_size;
    const int64_t pos_stride = it->pos_stride, block_stride = it->block_stride;
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        const KV_T *kb = it->k_cache + (int64_t)it->blocks[start / bs] * block_stride;
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t g = 0; g < G; ++g) {
                const float *qg = q + g * D;
                const KV_T *k = kb + t * pos_stride;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; ++d) s += qg[d] * KV_SCALAR(k[d]);
                scores[g * ctx + start + t] = s * it->scale;
            }
        }
    }
    softmax_rows(scores, G, ctx);
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        const KV_T *vb = it->v_cache + (int64_t)it->blocks[start / bs] * block_stride;
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t g = 0; g < G; ++g) {
                const float p = scores[g * ctx + start + t];
                const KV_T *v = vb + t * pos_stride;
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ag[d] += p * KV_SCALAR(v[d]);
            }
        }
    }
    memcpy(out, acc, sizeof(float) * G * D);
}

#ifdef __AVX512F__
/* G query heads x C chunks of 16 floats (head_dim = 16 C), all loops of compile-time length: gcc unrolls them
 * and keeps q (scores pass) and the accumulators (V pass) in zmm registers. */
#define DEFINE_ATTEND_AVX512(G, C)                                                                          \
    static void CAT(attend_g##G##_c##C##_, KV_SUFFIX)(const ITEM *it, const float *q, float *out, float *scores) {          \
        const int64_t ctx = it->ctx, bs = it->block_size;                                                    \
        const int64_t pos_stride = it->pos_stride, block_stride = it->block_stride;                          \
        __m512 qv[G][C];                                                                                     \
        for (int g = 0; g < G; ++g)                                                                          \
            for (int c = 0; c < C; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + (g * C + c) * 16),      \
                                                                 _mm512_set1_ps(it->scale));                 \
        for (int64_t start = 0; start < ctx; start += bs) {                                                  \
            const int64_t n = ctx - start < bs ? ctx - start : bs;                                           \
            const KV_T *kb = it->k_cache + (int64_t)it->blocks[start / bs] * block_stride;                 \
            for (int64_t t = 0; t < n; ++t) {                                                                \
                const KV_T *k = kb + t * pos_stride;                                                         \
                __m512 kv[C];                                                                                \
                for (int c = 0; c < C; ++c) kv[c] = KV_LOAD16(k + c * 16);                               \
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
            const KV_T *vb = it->v_cache + (int64_t)it->blocks[start / bs] * block_stride;                 \
            for (int64_t t = 0; t < n; ++t) {                                                                \
                const KV_T *v = vb + t * pos_stride;                                                         \
                __m512 vv[C];                                                                                \
                for (int c = 0; c < C; ++c) vv[c] = KV_LOAD16(v + c * 16);                               \
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
#undef DEFINE_ATTEND_AVX512
#endif

static void CAT(attend_, KV_SUFFIX)(const ITEM *it, const float *q, float *out, float *scores, float *acc) {
#ifdef __AVX512F__
#define CASE(G, C)                                                                                           \
    if (it->group == G && it->head_dim == 16 * C) return CAT(attend_g##G##_c##C##_, KV_SUFFIX)(it, q, out, scores);
    CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(5, 4) CASE(6, 4) CASE(1, 8) CASE(2, 8) CASE(3, 8)
#undef CASE
#endif
    CAT(attend_generic_, KV_SUFFIX)(it, q, out, scores, acc);
}

/* k_cache / v_cache point at KV head 0 of block 0; a position's row is
 *   cache + block * block_stride + kv_head * head_stride + offset_in_block * pos_stride   (strides in floats),
 * so both [NB, BS, KV, D] (pos_stride KV*D, head_stride D) and [NB, KV, BS, D] (pos_stride D, head_stride BS*D)
 * layouts are served. Returns 0, or -1 if a score buffer could not be allocated. */
int CAT(folio_paged_attention_, KV_SUFFIX)(const float *q, float *out, const KV_T *k_cache, const KV_T *v_cache,
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
                const ITEM it = {k_cache + kv_head * head_stride, v_cache + kv_head * head_stride,
                                   block_table + (int64_t)row_req[i] * bt_stride, row_ctx[i], group, head_dim,
                                   block_size, pos_stride, block_stride, scale};
                CAT(attend_, KV_SUFFIX)(&it, q + offset, out + offset, scores, acc);
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}

#undef ITEM
