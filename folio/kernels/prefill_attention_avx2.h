/* The AVX2 + FMA prefill tile (x86-64-v3 builds) for head_dim = 8 C: included by paged_attention_cpu_impl.h once
 * per cache type (ITEM, KV_T, KV_SUFFIX and kv_load8_ are that instance's), where PAGED_ATTN_AVX2 is set.
 *
 * The AVX-512 block tile's scheme (prefill_attention_blocks.h, its float32 kind) with 8-float vectors: the tile's
 * pairs (up to PREFILL_TILE query rows x G query heads) walk the context DP_BLOCK positions at a time, and each
 * block is two small GEMMs with a softmax between:
 *   1. the block's K is transposed per chunk of 8 positions (kp[chunk][d] lane j = K[8 chunk + j][d]) and V
 *      kept as float32 rows (vp[j][d]), both widened once and shared by every pair (pack_block8_);
 *   2. scores = scale q . k for 6 pairs x 2 chunks at a time: 12 accumulator chains, each one FMA of a broadcast
 *      query element per dim (block8_scores_);
 *   3. per pair, over the whole block: running max, exp, running sum (block8_softmax_);
 *   4. out = out * rescale + p . V for 6 pairs x 2 vectors of dims at a time: 12 accumulators, 2 vectors of V
 *      and one broadcast weight live (block8_weighted_v_), slice after slice of dims.
 * Softmax and sums are float32. */

/* 1. Positions b0 .. b0 + n - 1 of the tile's KV head into kp and vp (positions n .. up to the chunk's end: 0). */
static inline __attribute__((always_inline)) void CAT(pack_block8_, KV_SUFFIX)(const ITEM *it, int64_t b0, int64_t n,
                                                                              const int C, float *kp, float *vp) {
    const int64_t D = 8 * C;
    for (int64_t c0 = 0; c0 < n; c0 += 8) {
        const int64_t m = n - c0 < 8 ? n - c0 : 8;
        const KV_T *krow[16], *vrow[16];
        CAT(chunk_rows_, KV_SUFFIX)(it, c0 + b0, m, krow, vrow);
        float *kc = kp + c0 * D, *vc = vp + c0 * D;
        for (int h = 0; h < C; ++h) { /* 8 dims of the 8 rows at a time */
            __m256 r[8];
            for (int64_t j = 0; j < 8; ++j)
                r[j] = j < m ? CAT(kv_load8_, KV_SUFFIX)(krow[j] + 8 * h) : _mm256_setzero_ps();
            attn_transpose8(r);
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kc + (8 * h + i) * 8, r[i]);
        }
        for (int64_t j = 0; j < 8; ++j)
            for (int h = 0; h < C; ++h)
                _mm256_storeu_ps(vc + j * D + 8 * h,
                                 j < m ? CAT(kv_load8_, KV_SUFFIX)(vrow[j] + 8 * h) : _mm256_setzero_ps());
    }
}

/* 2. scores[p][8 (ch + k) + j] for PB pairs from pair0 and NC chunks from ch (compile-time PB, NC, C);
 * q: each pair's D floats. */
static inline __attribute__((always_inline)) void CAT(block8_scores_, KV_SUFFIX)(const float *q, int64_t pair0,
                                                                                 const int PB, const float *kp,
                                                                                 int64_t ch, const int NC,
                                                                                 const int C, __m256 scale,
                                                                                 float *scores) {
    const int D = 8 * C;
    __m256 acc[6][2];
    for (int p = 0; p < PB; ++p)
        for (int k = 0; k < NC; ++k) acc[p][k] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
        __m256 kv[2];
        for (int k = 0; k < NC; ++k) kv[k] = _mm256_loadu_ps(kp + ((ch + k) * D + d) * 8);
        for (int p = 0; p < PB; ++p) {
            const __m256 qd = _mm256_broadcast_ss(q + (pair0 + p) * D + d);
            for (int k = 0; k < NC; ++k) acc[p][k] = _mm256_fmadd_ps(qd, kv[k], acc[p][k]);
        }
    }
    for (int p = 0; p < PB; ++p)
        for (int k = 0; k < NC; ++k)
            _mm256_storeu_ps(scores + (pair0 + p) * DP_BLOCK + (ch + k) * 8, _mm256_mul_ps(acc[p][k], scale));
}

/* 2. for every pair, chunks ch .. ch + NC - 1: 6 pairs at a time, the rest one by one */
static inline __attribute__((always_inline)) void CAT(block8_scores_all_, KV_SUFFIX)(const float *q, int64_t pairs,
                                                                                     const float *kp, int64_t ch,
                                                                                     const int NC, const int C,
                                                                                     __m256 scale, float *scores) {
    int64_t p0 = 0;
    for (; p0 + 6 <= pairs; p0 += 6) CAT(block8_scores_, KV_SUFFIX)(q, p0, 6, kp, ch, NC, C, scale, scores);
    for (; p0 < pairs; ++p0) CAT(block8_scores_, KV_SUFFIX)(q, p0, 1, kp, ch, NC, C, scale, scores);
}

/* 3. attn_block8_softmax (paged_attention_cpu.c): per pair, shared by both cache types */

/* 4. out[p] = out[p] * rescale[p] + probs[p] . vp over `steps` positions, PB pairs from pair0, two vectors of
 * dims at a time. */
static inline __attribute__((always_inline)) void CAT(block8_weighted_v_, KV_SUFFIX)(
    const float *probs, int64_t pair0, const int PB, const float *vp, int64_t steps, const int C,
    const float *rescale, float *out) {
    const int64_t D = 8 * C;
    for (int s0 = 0; s0 < C; s0 += 2) {
        __m256 acc[6][2];
        for (int p = 0; p < PB; ++p) {
            const __m256 r = _mm256_set1_ps(rescale[pair0 + p]);
            for (int w = 0; w < 2; ++w)
                acc[p][w] = _mm256_mul_ps(_mm256_loadu_ps(out + (pair0 + p) * D + 8 * (s0 + w)), r);
        }
        for (int64_t i = 0; i < steps; ++i) {
            const __m256 v0 = _mm256_loadu_ps(vp + i * D + 8 * s0), v1 = _mm256_loadu_ps(vp + i * D + 8 * s0 + 8);
            for (int p = 0; p < PB; ++p) {
                const __m256 pw = _mm256_broadcast_ss(probs + (pair0 + p) * DP_BLOCK + i);
                acc[p][0] = _mm256_fmadd_ps(pw, v0, acc[p][0]);
                acc[p][1] = _mm256_fmadd_ps(pw, v1, acc[p][1]);
            }
        }
        for (int p = 0; p < PB; ++p)
            for (int w = 0; w < 2; ++w) _mm256_storeu_ps(out + (pair0 + p) * D + 8 * (s0 + w), acc[p][w]);
    }
}

/* The tile's float32 queries come in scratch->q_tile ([rows][G][D], unscaled) and its output goes to
 * scratch->out_tile ([rows][G][D] float32). */
static inline __attribute__((always_inline)) void CAT(prefill_tile8_blocks_, KV_SUFFIX)(
    const ITEM *it, const int C, float scale, const int32_t *ctx_of_row, int64_t rows, const AttnScratch *scratch) {
    const int64_t G = it->group, pairs = rows * G, D = 8 * C;
    float *out_tile = scratch->out_tile, *state = scratch->state;
    const int64_t max_ctx = prefill_tile_begin(ctx_of_row, rows, pairs, D, out_tile, state);
    const float *q = scratch->q_tile;
    const __m256 scale_v = _mm256_set1_ps(scale);
    float *kp = scratch->kp, *vp = scratch->vp, *probs = scratch->probs, *scores = scratch->block_scores;
    for (int64_t b0 = 0; b0 < max_ctx; b0 += DP_BLOCK) {
        const int64_t n = max_ctx - b0 < DP_BLOCK ? max_ctx - b0 : DP_BLOCK, n8 = (n + 7) / 8 * 8;
        CAT(pack_block8_, KV_SUFFIX)(it, b0, n, C, kp, vp);
        const int64_t chunks = n8 / 8, whole = chunks / 2 * 2;
        for (int64_t ch = 0; ch < whole; ch += 2)
            CAT(block8_scores_all_, KV_SUFFIX)(q, pairs, kp, ch, 2, C, scale_v, scores);
        if (chunks > whole) CAT(block8_scores_all_, KV_SUFFIX)(q, pairs, kp, whole, 1, C, scale_v, scores);
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t visible = ctx_of_row[p / G] - b0;
            scratch->rescale[p] = attn_block8_softmax(scores + p * DP_BLOCK, visible < n ? visible : n, n8,
                                                      state + 2 * p, probs + p * DP_BLOCK);
        }
        int64_t p0 = 0;
        for (; p0 + 6 <= pairs; p0 += 6)
            CAT(block8_weighted_v_, KV_SUFFIX)(probs, p0, 6, vp, n8, C, scratch->rescale, out_tile);
        for (; p0 < pairs; ++p0)
            CAT(block8_weighted_v_, KV_SUFFIX)(probs, p0, 1, vp, n8, C, scratch->rescale, out_tile);
    }
    for (int64_t i = 0; i < pairs; ++i) {
        const __m256 inv = _mm256_set1_ps(1.0f / state[2 * i + 1]);
        float *o = out_tile + i * D;
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * c), inv));
    }
}

/* The instances: head_dim 64 and 128 */
static void CAT(prefill_tile8_c8_, KV_SUFFIX)(const ITEM *it, float scale, const int32_t *ctx_of_row, int64_t rows,
                                              const AttnScratch *scratch) {
    CAT(prefill_tile8_blocks_, KV_SUFFIX)(it, 8, scale, ctx_of_row, rows, scratch);
}
static void CAT(prefill_tile8_c16_, KV_SUFFIX)(const ITEM *it, float scale, const int32_t *ctx_of_row,
                                               int64_t rows, const AttnScratch *scratch) {
    CAT(prefill_tile8_blocks_, KV_SUFFIX)(it, 16, scale, ctx_of_row, rows, scratch);
}
