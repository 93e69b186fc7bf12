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
/* One decode row, KV heads [kh0, kh1), head_dim = 16 C, G query heads per KV head (compile-time constants at
 * each call). The context is walked 16 positions at a time and, inside a chunk, KV head after KV head: the
 * heads of one position sit side by side in the cache ([.., BS, KV, D]), so the chunk's whole rows are read
 * and the hardware prefetcher sees one sequential stream (walking one KV head's strided slice at a time ran
 * at 12 GB/s where the whole rows reach 22, docs/performance.md).
 * Scores: one vector of partial sums per position, then one 16-way reduction tree (reduce16) per chunk. With a
 * bfloat16 cache and bfloat16 queries the products come from AVX512-BF16 dot instructions on the raw bf16
 * pairs: exact products and float32 sums, as the float32 path computes them, in another summation order.
 * V: the G x C output vectors of a KV head stay in registers through the chunk's 16 positions.
 * q, out: the row's [H, D] float32 (out is overwritten); q_bf16: the row's raw bf16 query or NULL;
 * scores: [(kh1 - kh0) G, ctx]. */
/* Software prefetch of positions [c0, c0 + 16) of cache rows for KV heads [kh0, kh1): issued one chunk ahead,
 * so the chunk's scattered head slices are in flight together instead of one miss at a time. */
static inline void CAT(prefetch_chunk_, KV_SUFFIX)(const ITEM *it, const KV_T *cache, int64_t c0, int64_t head_stride,
                                                   int64_t kh0, int64_t kh1) {
    const int64_t end = c0 + 16 < it->ctx ? c0 + 16 : it->ctx;
    const int64_t bytes = it->head_dim * (int64_t)sizeof(KV_T);
    for (int64_t p = c0; p < end; ++p) {
        const KV_T *row = cache + (int64_t)it->blocks[p / it->block_size] * it->block_stride +
                          (p % it->block_size) * it->pos_stride;
        for (int64_t kh = kh0; kh < kh1; ++kh)
            for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)(row + kh * head_stride) + off, _MM_HINT_T0);
    }
}

static inline __attribute__((always_inline)) void CAT(attend_heads_avx512_, KV_SUFFIX)(
    const ITEM *it, const int G, const int C, int64_t head_stride, int64_t kh0, int64_t kh1, const float *q,
    const uint16_t *q_bf16, float *out, float *scores) {
    const int64_t ctx = it->ctx, bs = it->block_size, D = 16 * C;
    const __m512 scale = _mm512_set1_ps(it->scale);
    (void)q_bf16;
    for (int64_t c0 = 0; c0 < ctx; c0 += 16) {
        const int64_t n = ctx - c0 < 16 ? ctx - c0 : 16;
        const KV_T *kp[16];
        for (int j = 0; j < 16; ++j) {
            const int64_t p = c0 + (j < n ? j : 0); /* past the end: position c0 again, never stored */
            kp[j] = it->k_cache + (int64_t)it->blocks[p / bs] * it->block_stride + (p % bs) * it->pos_stride;
        }
        const __mmask16 mask = (__mmask16)(n == 16 ? 0xFFFFu : (1u << n) - 1u);
        CAT(prefetch_chunk_, KV_SUFFIX)(it, it->k_cache, c0 + 16, head_stride, kh0, kh1);
        for (int64_t kh = kh0; kh < kh1; ++kh) {
            for (int g = 0; g < G; ++g) {
                const int64_t head = kh * G + g;
                float *dst = scores + ((kh - kh0) * G + g) * ctx + c0;
                __m512 s[16];
#if KV_IS_BF16 && defined(__AVX512BF16__)
                if (q_bf16 != NULL) {
                    __m512bh qb[4];
                    for (int h = 0; h < C / 2; ++h) qb[h] = (__m512bh)_mm512_loadu_si512(q_bf16 + head * D + 32 * h);
                    for (int j = 0; j < 16; ++j) {
                        const KV_T *k = kp[j] + kh * head_stride;
                        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[0], (__m512bh)_mm512_loadu_si512(k));
                        for (int h = 1; h < C / 2; ++h)
                            acc = _mm512_dpbf16_ps(acc, qb[h], (__m512bh)_mm512_loadu_si512(k + 32 * h));
                        s[j] = acc;
                    }
                    _mm512_mask_storeu_ps(dst, mask, _mm512_mul_ps(reduce16(s), scale));
                    continue;
                }
#endif
                __m512 qv[8];
                for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + head * D + c * 16);
                for (int j = 0; j < 16; ++j) {
                    const KV_T *k = kp[j] + kh * head_stride;
                    __m512 acc = _mm512_mul_ps(qv[0], KV_LOAD16(k));
                    for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], KV_LOAD16(k + c * 16), acc);
                    s[j] = acc;
                }
                _mm512_mask_storeu_ps(dst, mask, _mm512_mul_ps(reduce16(s), scale));
            }
        }
    }
    softmax_rows(scores, (kh1 - kh0) * G, ctx);
    for (int64_t i = kh0 * G * D; i < kh1 * G * D; ++i) out[i] = 0.0f;
    for (int64_t c0 = 0; c0 < ctx; c0 += 16) {
        const int64_t n = ctx - c0 < 16 ? ctx - c0 : 16;
        const KV_T *vp[16];
        for (int j = 0; j < n; ++j) {
            const int64_t p = c0 + j;
            vp[j] = it->v_cache + (int64_t)it->blocks[p / bs] * it->block_stride + (p % bs) * it->pos_stride;
        }
        CAT(prefetch_chunk_, KV_SUFFIX)(it, it->v_cache, c0 + 16, head_stride, kh0, kh1);
        for (int64_t kh = kh0; kh < kh1; ++kh) {
            __m512 acc[6][8];
            for (int g = 0; g < G; ++g)
                for (int c = 0; c < C; ++c) acc[g][c] = _mm512_loadu_ps(out + (kh * G + g) * D + c * 16);
            const float *probs = scores + (kh - kh0) * G * ctx + c0;
            for (int64_t j = 0; j < n; ++j) {
                const KV_T *v = vp[j] + kh * head_stride;
                __m512 vv[8];
                for (int c = 0; c < C; ++c) vv[c] = KV_LOAD16(v + c * 16);
                for (int g = 0; g < G; ++g) {
                    const __m512 pj = _mm512_set1_ps(probs[g * ctx + j]);
                    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(pj, vv[c], acc[g][c]);
                }
            }
            for (int g = 0; g < G; ++g)
                for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (kh * G + g) * D + c * 16, acc[g][c]);
        }
    }
}

#define DEFINE_ATTEND_AVX512(G, C)                                                                           \
    static void CAT(attend_g##G##_c##C##_, KV_SUFFIX)(const ITEM *it, int64_t head_stride, int64_t kh0,       \
                                                      int64_t kh1, const float *q, const uint16_t *q_bf16,    \
                                                      float *out, float *scores) {                            \
        CAT(attend_heads_avx512_, KV_SUFFIX)(it, G, C, head_stride, kh0, kh1, q, q_bf16, out, scores);       \
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

/* KV heads [kh0, kh1) of one row: the AVX-512 path where the shape has one, else the plain loops head by head.
 * q, out: the row's [H, D] float32; q_bf16: the row's raw bf16 query or NULL. */
static void CAT(attend_, KV_SUFFIX)(const ITEM *it, int64_t head_stride, int64_t kh0, int64_t kh1, const float *q,
                                    const uint16_t *q_bf16, float *out, float *scores, float *acc) {
    (void)q_bf16;
#ifdef __AVX512F__
#define CASE(G, C)                                                                                           \
    if (it->group == G && it->head_dim == 16 * C)                                                            \
        return CAT(attend_g##G##_c##C##_, KV_SUFFIX)(it, head_stride, kh0, kh1, q, q_bf16, out, scores);
    CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(5, 4) CASE(6, 4) CASE(1, 8) CASE(2, 8) CASE(3, 8)
#undef CASE
#endif
    const int64_t item_size = it->group * it->head_dim;
    for (int64_t kh = kh0; kh < kh1; ++kh) {
        ITEM head_item = *it;
        head_item.k_cache += kh * head_stride;
        head_item.v_cache += kh * head_stride;
        CAT(attend_generic_, KV_SUFFIX)(&head_item, q + kh * item_size, out + kh * item_size, scores, acc);
    }
}

/* k_cache / v_cache point at KV head 0 of block 0; a position's row is
 *   cache + block * block_stride + kv_head * head_stride + offset_in_block * pos_stride   (strides in elements),
 * so both [NB, BS, KV, D] (pos_stride KV*D, head_stride D) and [NB, KV, BS, D] (pos_stride D, head_stride BS*D)
 * layouts are served. q is [T, H, D] with its heads packed and rows q_row_stride apart (a view of a fused q|k|v
 * output is); out is [T, H, D] contiguous. Each is float32 or, where its flag is set, bfloat16.
 * Work items: one per row with all its KV heads when there are rows enough for every thread, else one per
 * (row, KV head) so that a single long decode still spreads over the threads.
 * Returns 0, or -1 if a buffer could not be allocated. */
int CAT(folio_paged_attention_, KV_SUFFIX)(const void *q, int64_t q_row_stride, int q_bf16, void *out, int out_bf16,
                              const KV_T *k_cache, const KV_T *v_cache,
                              int64_t block_stride, int64_t head_stride, int64_t pos_stride,
                              const int32_t *block_table, int64_t bt_stride, const int64_t *rows,
                              const int32_t *row_req, const int32_t *row_ctx, int64_t num_rows, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                              int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_size = num_heads * head_dim;
    const int64_t heads_per_item = num_rows >= 2 * (int64_t)num_threads ? num_kv_heads : 1;
    const int64_t items_per_row = num_kv_heads / heads_per_item;
    int64_t max_ctx = 1;
    for (int64_t i = 0; i < num_rows; ++i) max_ctx = row_ctx[i] > max_ctx ? row_ctx[i] : max_ctx;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * heads_per_item * group * max_ctx);
        float *acc = malloc(sizeof(float) * group * head_dim);
        float *q_row = malloc(sizeof(float) * row_size);
        float *out_row = malloc(sizeof(float) * row_size);
        if (scores == NULL || acc == NULL || q_row == NULL || out_row == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows * items_per_row; ++item) {
            if (failed) continue;
            const int64_t i = item / items_per_row;
            const int64_t kh0 = (item % items_per_row) * heads_per_item, kh1 = kh0 + heads_per_item;
            const int64_t first = kh0 * group * head_dim, size = (kh1 - kh0) * group * head_dim;
            load_as_f32(q, q_bf16, rows[i] * q_row_stride + first, size, q_row + first);
            const uint16_t *q_raw = q_bf16 ? (const uint16_t *)q + rows[i] * q_row_stride : NULL;
            const ITEM it = {k_cache, v_cache, block_table + (int64_t)row_req[i] * bt_stride, row_ctx[i], group,
                             head_dim, block_size, pos_stride, block_stride, scale};
            CAT(attend_, KV_SUFFIX)(&it, head_stride, kh0, kh1, q_row, q_raw, out_row, scores, acc);
            store_from_f32(out, out_bf16, rows[i] * row_size + first, size, out_row + first);
        }
        free(scores);
        free(acc);
        free(q_row);
        free(out_row);
    }
    return failed ? -1 : 0;
}

/* ---- Multi-token queries (prefills, prefill chunks): flash-style, a tile of query rows at a time ----------
 * One work item = one tile of up to PREFILL_TILE consecutive query rows of one segment x one KV head. The tile
 * walks the context 16 positions at a time: those K rows are converted once into a transposed float32 chunk
 * Kt[d][16] and V into Vc[16][d], then each of the tile's G x rows (query head, row) pairs gets 16 scores
 * from head_dim broadcast-FMAs (no horizontal sums) and updates its running max, sum and output (online
 * softmax). The chunk's conversion is shared by up to G x PREFILL_TILE pairs. */
#define PREFILL_ITEM_FN CAT(prefill_tile_, KV_SUFFIX)

static void PREFILL_ITEM_FN(
    const ITEM *it, const int64_t D, const float *q_tile, /* [rows][G][D], pre-scaled */
    const int32_t *ctx_of_row, int64_t rows, float *out_tile, /* [rows][G][D] */
    float *kt, float *vc, float *state /* m, l per pair */) {
    const int64_t G = it->group, bs = it->block_size, pairs = rows * G;
    int64_t max_ctx = 0;
    for (int64_t r = 0; r < rows; ++r) max_ctx = ctx_of_row[r] > max_ctx ? ctx_of_row[r] : max_ctx;
    for (int64_t i = 0; i < pairs; ++i) {
        state[2 * i] = -FLT_MAX;
        state[2 * i + 1] = 0.0f;
    }
    memset(out_tile, 0, sizeof(float) * pairs * D);
    for (int64_t c0 = 0; c0 < max_ctx; c0 += 16) {
        const int64_t n = max_ctx - c0 < 16 ? max_ctx - c0 : 16;
        for (int64_t j = 0; j < 16; ++j) {
            if (j < n) {
                const int64_t p = c0 + j;
                const int64_t off = (int64_t)it->blocks[p / bs] * it->block_stride + (p % bs) * it->pos_stride;
                const KV_T *k = it->k_cache + off, *v = it->v_cache + off;
                for (int64_t d = 0; d < D; ++d) {
                    kt[d * 16 + j] = KV_SCALAR(k[d]);
                    vc[j * D + d] = KV_SCALAR(v[d]);
                }
            } else {
                for (int64_t d = 0; d < D; ++d) {
                    kt[d * 16 + j] = 0.0f;
                    vc[j * D + d] = 0.0f;
                }
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t visible = ctx_of_row[r] - c0; /* positions c0 .. c0+visible-1 of this chunk */
            if (visible <= 0) continue;
            for (int64_t g = 0; g < G; ++g) {
                const int64_t pair = r * G + g;
                const float *qp = q_tile + pair * D;
                float s[16];
                for (int64_t j = 0; j < 16; ++j) s[j] = 0.0f;
                for (int64_t d = 0; d < D; ++d) {
                    const float qd = qp[d];
#pragma omp simd
                    for (int64_t j = 0; j < 16; ++j) s[j] += qd * kt[d * 16 + j];
                }
                float chunk_max = -FLT_MAX;
                for (int64_t j = 0; j < 16; ++j) {
                    if (j >= visible) s[j] = -FLT_MAX;
                    chunk_max = s[j] > chunk_max ? s[j] : chunk_max;
                }
                const float m_old = state[2 * pair];
                const float m_new = chunk_max > m_old ? chunk_max : m_old;
                const float rescale = expf(m_old - m_new);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < 16; ++j) {
                    s[j] = j < visible ? expf(s[j] - m_new) : 0.0f;
                    sum += s[j];
                }
                state[2 * pair] = m_new;
                state[2 * pair + 1] = state[2 * pair + 1] * rescale + sum;
                float *o = out_tile + pair * D;
                const int64_t used = visible < 16 ? visible : 16;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) o[d] *= rescale;
                for (int64_t j = 0; j < used; ++j) {
                    const float pj = s[j];
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) o[d] += pj * vc[j * D + d];
                }
            }
        }
    }
    for (int64_t i = 0; i < pairs; ++i) {
        const float inv = 1.0f / state[2 * i + 1];
        for (int64_t d = 0; d < D; ++d) out_tile[i * D + d] *= inv;
    }
}

#ifdef __AVX512F__
/* The same tile for head_dim = 16 C with AVX-512: the chunk's K rows are transposed in registers (16 x 16
 * blocks), each pair's 16 scores come from head_dim broadcast-FMAs over 4 independent accumulators, and the
 * pair's C output vectors stay in registers through the chunk's 16 V rows. */
#define DEFINE_PREFILL_AVX512(C)                                                                             \
    static void CAT(prefill_tile_c##C##_, KV_SUFFIX)(const ITEM *it, const float *q_tile,                   \
                                                      const int32_t *ctx_of_row, int64_t rows, float *out_tile, \
                                                      float *kt, float *vc, float *state) {                 \
        const int64_t G = it->group, bs = it->block_size, pairs = rows * G, D = 16 * C;                     \
        int64_t max_ctx = 0;                                                                                 \
        for (int64_t r = 0; r < rows; ++r) max_ctx = ctx_of_row[r] > max_ctx ? ctx_of_row[r] : max_ctx;    \
        for (int64_t i = 0; i < pairs; ++i) {                                                                \
            state[2 * i] = -FLT_MAX;                                                                         \
            state[2 * i + 1] = 0.0f;                                                                         \
        }                                                                                                    \
        memset(out_tile, 0, sizeof(float) * pairs * D);                                                      \
        for (int64_t c0 = 0; c0 < max_ctx; c0 += 16) {                                                       \
            const int64_t n = max_ctx - c0 < 16 ? max_ctx - c0 : 16;                                         \
            const KV_T *kp[16], *vp[16];                                                                     \
            for (int64_t j = 0; j < n; ++j) {                                                                \
                const int64_t p = c0 + j;                                                                    \
                const int64_t off = (int64_t)it->blocks[p / bs] * it->block_stride + (p % bs) * it->pos_stride; \
                kp[j] = it->k_cache + off;                                                                   \
                vp[j] = it->v_cache + off;                                                                   \
            }                                                                                                \
            for (int c = 0; c < C; ++c) {                                                                    \
                __m512 r[16];                                                                                \
                for (int64_t j = 0; j < 16; ++j) {                                                           \
                    r[j] = j < n ? KV_LOAD16(kp[j] + c * 16) : _mm512_setzero_ps();                          \
                    _mm512_storeu_ps(vc + j * D + c * 16, j < n ? KV_LOAD16(vp[j] + c * 16) : _mm512_setzero_ps()); \
                }                                                                                            \
                transpose16(r);                                                                              \
                for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (c * 16 + i) * 16, r[i]);                 \
            }                                                                                                \
            for (int64_t row = 0; row < rows; ++row) {                                                       \
                const int64_t visible = ctx_of_row[row] - c0;                                                \
                if (visible <= 0) continue;                                                                  \
                const int64_t used = visible < 16 ? visible : 16;                                            \
                const __mmask16 mask = (__mmask16)(used == 16 ? 0xFFFFu : (1u << used) - 1u);               \
                for (int64_t g = 0; g < G; ++g) {                                                            \
                    const int64_t pair = row * G + g;                                                        \
                    const float *qp = q_tile + pair * D;                                                     \
                    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;                              \
                    for (int d = 0; d < D; d += 4) {                                                         \
                        s0 = _mm512_fmadd_ps(_mm512_set1_ps(qp[d]), _mm512_loadu_ps(kt + d * 16), s0);       \
                        s1 = _mm512_fmadd_ps(_mm512_set1_ps(qp[d + 1]), _mm512_loadu_ps(kt + (d + 1) * 16), s1); \
                        s2 = _mm512_fmadd_ps(_mm512_set1_ps(qp[d + 2]), _mm512_loadu_ps(kt + (d + 2) * 16), s2); \
                        s3 = _mm512_fmadd_ps(_mm512_set1_ps(qp[d + 3]), _mm512_loadu_ps(kt + (d + 3) * 16), s3); \
                    }                                                                                        \
                    __m512 sc = _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3));                 \
                    sc = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), mask, sc);                             \
                    const float chunk_max = _mm512_reduce_max_ps(sc);                                        \
                    const float m_old = state[2 * pair];                                                     \
                    const float m_new = chunk_max > m_old ? chunk_max : m_old;                               \
                    const float rescale = expf(m_old - m_new);                                               \
                    float p[16];                                                                             \
                    _mm512_storeu_ps(p, _mm512_sub_ps(sc, _mm512_set1_ps(m_new)));                           \
                    _Pragma("omp simd") for (int j = 0; j < 16; ++j) p[j] = expf(p[j]); /* libmvec, one call */ \
                    const __m512 probs = _mm512_maskz_mov_ps(mask, _mm512_loadu_ps(p));                      \
                    _mm512_storeu_ps(p, probs);                                                              \
                    state[2 * pair] = m_new;                                                                 \
                    state[2 * pair + 1] = state[2 * pair + 1] * rescale + _mm512_reduce_add_ps(probs);       \
                    float *o = out_tile + pair * D;                                                          \
                    __m512 acc[C];                                                                           \
                    for (int c = 0; c < C; ++c) acc[c] = _mm512_mul_ps(_mm512_loadu_ps(o + c * 16), _mm512_set1_ps(rescale)); \
                    for (int64_t j = 0; j < used; ++j) {                                                     \
                        const __m512 pj = _mm512_set1_ps(p[j]);                                              \
                        for (int c = 0; c < C; ++c)                                                          \
                            acc[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + j * D + c * 16), acc[c]);      \
                    }                                                                                        \
                    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + c * 16, acc[c]);                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int64_t i = 0; i < pairs; ++i) {                                                                \
            const __m512 inv = _mm512_set1_ps(1.0f / state[2 * i + 1]);                                      \
            for (int c = 0; c < C; ++c)                                                                      \
                _mm512_storeu_ps(out_tile + i * D + c * 16, _mm512_mul_ps(_mm512_loadu_ps(out_tile + i * D + c * 16), inv)); \
        }                                                                                                    \
    }

DEFINE_PREFILL_AVX512(4)
DEFINE_PREFILL_AVX512(8)
#undef DEFINE_PREFILL_AVX512
#endif

/* Segments are runs of consecutive query rows of one request: segment s has rows seg_row[s] ..
 * seg_row[s] + seg_len[s] - 1, the first of which sees seg_ctx[s] positions and each next one one more
 * (a fresh prefill of 5 tokens: seg_ctx 1; a 3-token chunk after 6 cached tokens: seg_ctx 7). */
int CAT(folio_prefill_attention_, KV_SUFFIX)(const void *q, int64_t q_row_stride, int q_bf16, void *out, int out_bf16,
                              const KV_T *k_cache, const KV_T *v_cache,
                              int64_t block_stride, int64_t head_stride, int64_t pos_stride,
                              const int32_t *block_table, int64_t bt_stride, const int32_t *seg_req,
                              const int64_t *seg_row, const int32_t *seg_ctx, const int32_t *seg_len,
                              int64_t num_segs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads, pair_size = group * head_dim;
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < num_segs; ++s) num_tiles += (seg_len[s] + PREFILL_TILE - 1) / PREFILL_TILE;
    int64_t *tile_seg = malloc(sizeof(int64_t) * (num_tiles > 0 ? num_tiles : 1));
    int64_t *tile_first = malloc(sizeof(int64_t) * (num_tiles > 0 ? num_tiles : 1));
    if (tile_seg == NULL || tile_first == NULL) {
        free(tile_seg);
        free(tile_first);
        return -1;
    }
    /* longest contexts first: the last tiles of long segments cost most, dynamic scheduling then balances */
    int64_t t = 0;
    for (int64_t s = 0; s < num_segs; ++s)
        for (int64_t first = ((seg_len[s] - 1) / PREFILL_TILE) * PREFILL_TILE; first >= 0; first -= PREFILL_TILE) {
            tile_seg[t] = s;
            tile_first[t++] = first;
        }
    const int64_t num_items = num_tiles * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *q_tile = malloc(sizeof(float) * PREFILL_TILE * pair_size);
        float *out_tile = malloc(sizeof(float) * PREFILL_TILE * pair_size);
        float *kt = malloc(sizeof(float) * 16 * head_dim);
        float *vc = malloc(sizeof(float) * 16 * head_dim);
        float *state = malloc(sizeof(float) * 2 * PREFILL_TILE * group);
        if (q_tile == NULL || out_tile == NULL || kt == NULL || vc == NULL || state == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            if (failed) continue;
            const int64_t tile = item / num_kv_heads, kv_head = item % num_kv_heads, s = tile_seg[tile];
            const int64_t first = tile_first[tile];
            const int64_t rows = seg_len[s] - first < PREFILL_TILE ? seg_len[s] - first : PREFILL_TILE;
            int32_t ctx_of_row[PREFILL_TILE];
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t row = seg_row[s] + first + r;
                ctx_of_row[r] = seg_ctx[s] + (int32_t)(first + r);
                load_as_f32(q, q_bf16, row * q_row_stride + kv_head * pair_size, pair_size, q_tile + r * pair_size);
                for (int64_t i = 0; i < pair_size; ++i) q_tile[r * pair_size + i] *= scale;
            }
            const ITEM it = {k_cache + kv_head * head_stride, v_cache + kv_head * head_stride,
                             block_table + (int64_t)seg_req[s] * bt_stride, 0, group, head_dim,
                             block_size, pos_stride, block_stride, scale};
#ifdef __AVX512F__
            if (head_dim == 64)
                CAT(prefill_tile_c4_, KV_SUFFIX)(&it, q_tile, ctx_of_row, rows, out_tile, kt, vc, state);
            else if (head_dim == 128)
                CAT(prefill_tile_c8_, KV_SUFFIX)(&it, q_tile, ctx_of_row, rows, out_tile, kt, vc, state);
            else
#endif
                PREFILL_ITEM_FN(&it, head_dim, q_tile, ctx_of_row, rows, out_tile, kt, vc, state);
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t row = seg_row[s] + first + r;
                store_from_f32(out, out_bf16, row * num_heads * head_dim + kv_head * pair_size, pair_size,
                               out_tile + r * pair_size);
            }
        }
        free(q_tile);
        free(out_tile);
        free(kt);
        free(vc);
        free(state);
    }
    free(tile_seg);
    free(tile_first);
    return failed ? -1 : 0;
}

#undef PREFILL_ITEM_FN
#undef ITEM
