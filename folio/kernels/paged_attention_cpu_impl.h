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

#if defined(__AVX512F__) || PAGED_ATTN_AVX2
/* Asks for the K or V rows of one KV head of one block (rows positions, pos_stride elements apart), all at once:
 * the decode passes call it one block ahead of the block they compute. Into L2 (prefetcht1), not L1: a block-head
 * is 32-64 lines, more than L1's miss buffers hold, and a T0 prefetch that finds them full stalls the core
 * (perf put a quarter of the kernel's samples on prefetcht0). With blocks scattered over a 2-core Zen 5 VM's
 * DRAM, 12 rows of 800-1800 positions x 30 layers: float32 46-52 -> 31-36 ms a step, bfloat16 39.6 -> 21.2,
 * at the avx2 tier 64.6 -> 40.2 (docs/performance.md, session 28). always_inline: gcc takes a function whose
 * only effect is prefetching for one without effects, and deletes the calls to it. */
static inline __attribute__((always_inline)) void CAT(prefetch_block_head_, KV_SUFFIX)(
    const KV_T *rows_start, int64_t rows, int64_t pos_stride, int64_t head_dim) {
    const char *first = (const char *)rows_start;
    const int64_t row_bytes = head_dim * (int64_t)sizeof(KV_T);
    if (pos_stride == head_dim) { /* head-major: the rows are one run */
        for (int64_t byte = 0; byte < rows * row_bytes; byte += 64) _mm_prefetch(first + byte, _MM_HINT_T1);
        return;
    }
    for (int64_t j = 0; j < rows; ++j)
        for (int64_t byte = 0; byte < row_bytes; byte += 64)
            _mm_prefetch(first + j * pos_stride * (int64_t)sizeof(KV_T) + byte, _MM_HINT_T1);
}
#endif

/* The decode bodies' block prefetch of KV head kh's rows of the row's block `block` (their locals it, ctx, bs,
 * head_stride, pos_stride, D): asked one block ahead of the block they compute. */
#define PREFETCH_ROWS(cache, block, kh)                                                                        \
    CAT(prefetch_block_head_, KV_SUFFIX)((cache) + it->blocks[block] * it->block_stride + (kh) * head_stride, \
                                         ctx - (block) * bs < bs ? ctx - (block) * bs : bs, pos_stride, D)
#ifdef __AVX512F__
#include "decode_attention_avx512.h"
#elif PAGED_ATTN_AVX2
#include "decode_attention_avx2.h"
#endif
#undef PREFETCH_ROWS

/* KV heads [kh0, kh1) of one row: the AVX-512 (or AVX2) path where the shape has one, else the plain loops head
 * by head. q, out: the row's [H, D] float32; q_bf16: the row's raw bf16 query or NULL; acc: scratch [G, D]. */
static void CAT(attend_, KV_SUFFIX)(const ITEM *it, int64_t head_stride, int64_t kh0, int64_t kh1, const float *q,
                                    const uint16_t *q_bf16, float *out, float *scores, float *acc) {
    (void)q_bf16;
#ifdef __AVX512F__
#define CASE(G, C)                                                                                           \
    if (it->group == G && it->head_dim == 16 * C) {                                                          \
        for (int64_t k0 = kh0; k0 < kh1; k0 += DECODE_MAX_HEADS / G) {                                       \
            const int64_t k1 = k0 + DECODE_MAX_HEADS / G < kh1 ? k0 + DECODE_MAX_HEADS / G : kh1;             \
            CAT(decode_g##G##_c##C##_, KV_SUFFIX)(it, head_stride, k0, k1, q, q_bf16, out, scores);          \
        }                                                                                                    \
        return;                                                                                              \
    }
    CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(5, 4) CASE(6, 4) CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8)
#undef CASE
#elif PAGED_ATTN_AVX2
#define CASE(G, C)                                                                                           \
    if (it->group == G && it->head_dim == 8 * C) {                                                           \
        for (int64_t k0 = kh0; k0 < kh1; k0 += DECODE_MAX_HEADS / G) {                                       \
            const int64_t k1 = k0 + DECODE_MAX_HEADS / G < kh1 ? k0 + DECODE_MAX_HEADS / G : kh1;             \
            CAT(decode_avx2_g##G##_c##C##_, KV_SUFFIX)(it, head_stride, k0, k1, q, out, scores);             \
        }                                                                                                    \
        return;                                                                                              \
    }
    CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8) CASE(5, 8) CASE(6, 8) CASE(7, 8) CASE(8, 8)
    CASE(1, 16) CASE(2, 16) CASE(3, 16) CASE(4, 16) CASE(5, 16) CASE(6, 16) CASE(7, 16) CASE(8, 16)
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

/* The decode rows of a step (single-token queries): row i is query row rows[i] of request row_req[i] and sees
 * positions 0 .. row_ctx[i] - 1. Work items: one per row with all its KV heads when there are rows enough for
 * every thread of the team, else one per (row, KV head) so that a single long decode still spreads. */
static void CAT(decode_body_, KV_SUFFIX)(const PagedArgs *a, const DecodeRows *d, const AttnScratch *scratch) {
    const int64_t group = a->num_heads / a->num_kv_heads, head_dim = a->head_dim;
    const int64_t row_size = a->num_heads * head_dim;
    const int64_t heads_per_item = d->num_rows >= 2 * (int64_t)omp_get_num_threads() ? a->num_kv_heads : 1;
    const int64_t items_per_row = a->num_kv_heads / heads_per_item;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < d->num_rows * items_per_row; ++item) {
        const int64_t i = item / items_per_row;
        const int64_t kh0 = (item % items_per_row) * heads_per_item, kh1 = kh0 + heads_per_item;
        const int64_t first = kh0 * group * head_dim, size = (kh1 - kh0) * group * head_dim;
        load_as_f32(a->q, a->q_bf16, d->rows[i] * a->q_row_stride + first, size, scratch->q_row + first);
        const uint16_t *q_raw = a->q_bf16 ? (const uint16_t *)a->q + d->rows[i] * a->q_row_stride : NULL;
        const ITEM it = {(const KV_T *)a->k_cache, (const KV_T *)a->v_cache,
                         a->block_table + (int64_t)d->row_req[i] * a->bt_stride, d->row_ctx[i], group, head_dim,
                         a->block_size, a->pos_stride, a->block_stride, a->scale};
        CAT(attend_, KV_SUFFIX)(&it, a->head_stride, kh0, kh1, scratch->q_row, q_raw, scratch->out_row,
                                scratch->scores, scratch->acc);
        store_from_f32(a->out, a->out_bf16, d->rows[i] * row_size + first, size, scratch->out_row + first);
    }
}

/* k_cache / v_cache point at KV head 0 of block 0; a position's row is
 *   cache + block * block_stride + kv_head * head_stride + offset_in_block * pos_stride   (strides in elements),
 * so both [NB, BS, KV, D] (pos_stride KV*D, head_stride D) and [NB, KV, BS, D] (pos_stride D, head_stride BS*D)
 * layouts are served. q is [T, H, D] with its heads packed and rows q_row_stride apart (a view of a fused q|k|v
 * output is); out is [T, H, D] contiguous. Each is float32 or, where its flag is set, bfloat16.
 * Returns 0, or -1 if a buffer could not be allocated. */
int CAT(folio_paged_attention_, KV_SUFFIX)(const void *q, int64_t q_row_stride, int q_bf16, void *out, int out_bf16,
                              const KV_T *k_cache, const KV_T *v_cache,
                              int64_t block_stride, int64_t head_stride, int64_t pos_stride,
                              const int32_t *block_table, int64_t bt_stride, const int64_t *rows,
                              const int32_t *row_req, const int32_t *row_ctx, int64_t num_rows, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                              int num_threads) {
    const PagedArgs a = {q, q_row_stride, q_bf16, out, out_bf16, k_cache, v_cache, block_stride, head_stride,
                         pos_stride, block_size, block_table, bt_stride, num_heads, num_kv_heads, head_dim, scale};
    const DecodeRows d = {rows, row_req, row_ctx, num_rows};
    int64_t max_ctx = 1;
    for (int64_t i = 0; i < num_rows; ++i) max_ctx = row_ctx[i] > max_ctx ? row_ctx[i] : max_ctx;
    const int64_t per_thread = attn_scratch_floats(num_heads, num_kv_heads, head_dim, max_ctx);
    float *arena = attn_arena(per_thread, num_threads);
    if (arena == NULL) return -1;
#pragma omp parallel num_threads(num_threads)
    {
        AttnScratch scratch;
        attn_scratch_carve(&scratch, arena + per_thread * omp_get_thread_num(), num_heads, num_kv_heads, head_dim,
                           max_ctx);
        CAT(decode_body_, KV_SUFFIX)(&a, &d, &scratch);
    }
    free(arena);
    return 0;
}

/* k[j], v[j] = the cache rows of context position c0 + j, j < n (one chunk of a prefill tile). */
static inline void CAT(chunk_rows_, KV_SUFFIX)(const ITEM *it, int64_t c0, int64_t n, const KV_T **k,
                                               const KV_T **v) {
    const int64_t bs = it->block_size;
    for (int64_t j = 0; j < n; ++j) {
        const int64_t p = c0 + j;
        const int64_t off = (int64_t)it->blocks[p / bs] * it->block_stride + (p % bs) * it->pos_stride;
        k[j] = it->k_cache + off;
        v[j] = it->v_cache + off;
    }
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
    const int64_t G = it->group, pairs = rows * G;
    const int64_t max_ctx = prefill_tile_begin(ctx_of_row, rows, pairs, D, out_tile, state);
    for (int64_t c0 = 0; c0 < max_ctx; c0 += 16) {
        const int64_t n = max_ctx - c0 < 16 ? max_ctx - c0 : 16;
        const KV_T *krow[16], *vrow[16];
        CAT(chunk_rows_, KV_SUFFIX)(it, c0, n, krow, vrow);
        for (int64_t j = 0; j < 16; ++j) {
            if (j < n) {
                for (int64_t d = 0; d < D; ++d) {
                    kt[d * 16 + j] = KV_SCALAR(krow[j][d]);
                    vc[j * D + d] = KV_SCALAR(vrow[j][d]);
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
#include "prefill_attention_blocks.h"
#elif PAGED_ATTN_AVX2
#include "prefill_attention_avx2.h"
#endif

/* One prefill tile with float32 maths (any cache type, any head_dim): q rows converted, then the AVX-512 (or
 * AVX2) block tile for head_dim 64 / 128 or the plain loops (which want q pre-scaled). */
static void CAT(prefill_tile_f32_math_, KV_SUFFIX)(const PagedArgs *a, const ITEM *it, int64_t first_row,
                                                   int64_t q_offset, const int32_t *ctx_of_row, int64_t rows,
                                                   const AttnScratch *scratch) {
    const int64_t pair_size = it->group * it->head_dim;
    for (int64_t r = 0; r < rows; ++r)
        load_as_f32(a->q, a->q_bf16, (first_row + r) * a->q_row_stride + q_offset, pair_size,
                    scratch->q_tile + r * pair_size);
#ifdef __AVX512F__
    if (it->head_dim == 64 || it->head_dim == 128) {
        (it->head_dim == 64 ? CAT(prefill_tile_c4_dp0_, KV_SUFFIX) : CAT(prefill_tile_c8_dp0_, KV_SUFFIX))(
            it, a->scale, ctx_of_row, rows, scratch);
        return;
    }
#elif PAGED_ATTN_AVX2
    if (it->head_dim == 64 || it->head_dim == 128) {
        (it->head_dim == 64 ? CAT(prefill_tile8_c8_, KV_SUFFIX) : CAT(prefill_tile8_c16_, KV_SUFFIX))(
            it, a->scale, ctx_of_row, rows, scratch);
        return;
    }
#endif
    for (int64_t i = 0; i < rows * pair_size; ++i) scratch->q_tile[i] *= a->scale;
    PREFILL_ITEM_FN(it, it->head_dim, scratch->q_tile, ctx_of_row, rows, scratch->out_tile, scratch->kt, scratch->vc,
                    scratch->state);
}

/* The prefill tiles of a step (see PrefillSegs), one work item per (tile, KV head): bf16 queries on a bf16 cache
 * take the dot-product block tile (prefill_attention_blocks.h) where the CPU has AVX512-BF16, the rest float32
 * maths. */
static void CAT(prefill_body_, KV_SUFFIX)(const PagedArgs *a, const PrefillSegs *p, const AttnScratch *scratch) {
    const int64_t group = a->num_heads / a->num_kv_heads, head_dim = a->head_dim, pair_size = group * head_dim;
    const int64_t num_items = p->num_tiles * a->num_kv_heads;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
        const int64_t tile = item / a->num_kv_heads, kv_head = item % a->num_kv_heads, s = p->tile_seg[tile];
        const int64_t first = p->tile_first[tile], first_row = p->seg_row[s] + first;
        const int64_t rows = p->seg_len[s] - first < PREFILL_TILE ? p->seg_len[s] - first : PREFILL_TILE;
        int32_t ctx_of_row[PREFILL_TILE];
        for (int64_t r = 0; r < rows; ++r) ctx_of_row[r] = p->seg_ctx[s] + (int32_t)(first + r);
        const ITEM it = {(const KV_T *)a->k_cache + kv_head * a->head_stride,
                         (const KV_T *)a->v_cache + kv_head * a->head_stride,
                         a->block_table + (int64_t)p->seg_req[s] * a->bt_stride, 0, group, head_dim, a->block_size,
                         a->pos_stride, a->block_stride, a->scale};
#if KV_IS_BF16 && defined(__AVX512BF16__)
        if (a->q_bf16 && (head_dim == 64 || head_dim == 128)) {
            uint16_t *q_tile = (uint16_t *)scratch->q_tile; /* raw bf16 rows: [rows][G][D] */
            for (int64_t r = 0; r < rows; ++r)
                memcpy(q_tile + r * pair_size, (const uint16_t *)a->q + (first_row + r) * a->q_row_stride + kv_head * pair_size,
                       sizeof(uint16_t) * pair_size);
            (head_dim == 64 ? prefill_tile_c4_dp1_bf16 : prefill_tile_c8_dp1_bf16)(
                &it, a->scale, ctx_of_row, rows, scratch);
        } else
#endif
            CAT(prefill_tile_f32_math_, KV_SUFFIX)(a, &it, first_row, kv_head * pair_size, ctx_of_row, rows, scratch);
        for (int64_t r = 0; r < rows; ++r)
            store_from_f32(a->out, a->out_bf16, (first_row + r) * a->num_heads * head_dim + kv_head * pair_size,
                           pair_size, scratch->out_tile + r * pair_size);
    }
}

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
    const PagedArgs a = {q, q_row_stride, q_bf16, out, out_bf16, k_cache, v_cache, block_stride, head_stride,
                         pos_stride, block_size, block_table, bt_stride, num_heads, num_kv_heads, head_dim, scale};
    PrefillSegs p = {seg_req, seg_row, seg_ctx, seg_len, num_segs, NULL, NULL, 0};
    const int64_t per_thread = attn_scratch_floats(num_heads, num_kv_heads, head_dim, 1);
    float *arena = attn_arena(per_thread, num_threads);
    if (arena == NULL || prefill_plan_tiles(&p) != 0) {
        free(arena);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        AttnScratch scratch;
        attn_scratch_carve(&scratch, arena + per_thread * omp_get_thread_num(), num_heads, num_kv_heads, head_dim, 1);
        CAT(prefill_body_, KV_SUFFIX)(&a, &p, &scratch);
    }
    prefill_free_tiles(&p);
    free(arena);
    return 0;
}

#undef PREFILL_ITEM_FN
#undef ITEM
