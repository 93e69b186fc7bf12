/* The prefill tile (see folio_prefill_attention_*) for a bfloat16 cache and bfloat16 queries, on AVX512-BF16 dot
 * products: included by paged_attention_cpu_impl.h inside its bfloat16 instance (ITEM is that instance's).
 *
 * Why: vdpbf16ps multiplies bf16 pairs and adds both products into a float32 lane, so the products take half the
 * instructions of float32 FMAs. The tile (up to PREFILL_TILE query rows x G query heads = its pairs) walks the
 * context DP_BLOCK positions at a time, flash-style, and each block is two small GEMMs with a softmax between:
 *   1. the block's K and V are rearranged once into dot-product operands shared by every pair:
 *        kp[chunk][dp]   lane j = (K[16 chunk + j][2 dp], K[16 chunk + j][2 dp + 1])   (16 x 16 transposes)
 *        vp[i][2h]       lane 4L + t = (V[2i][d], V[2i + 1][d]), d = 32h + 8L + t       (16-bit unpack, low half)
 *        vp[i][2h + 1]   the same with d = 32h + 8L + 4 + t                             (high half)
 *   2. scores = scale q . k for 3 pairs x 64 positions at a time: 12 independent accumulators, each a chain of
 *      D / 2 dot products of a broadcast query pair with kp;
 *   3. per pair, over the whole block at once: the running max, exp, the running sum (one horizontal max and one
 *      horizontal sum per block, where a 16-position online softmax paid them, an expf and a rescale of the
 *      output every 16 positions: the old tile ran at ~140 GFLOP/s, latency-bound on those chains);
 *   4. out = out * rescale + p . V for 24 / C pairs at a time: per position pair, C dot products of the broadcast
 *      (p[2i], p[2i + 1]) with vp[i] into 24 accumulators.
 * The output accumulators hold dims in vp's order until the end, where they are put back in place.
 * Rounding: the softmax runs in float32 as in the float32 tile; the probabilities enter the V products rounded to
 * bf16 (as flash-attention kernels on GPUs round them), a relative error of at most 2^-9 per weight. */

/* 1. Positions b0 .. b0 + n - 1 of the tile's KV head into kp and vp (positions n .. up to the chunk's end: 0). */
static inline __attribute__((always_inline)) void dp_pack_block(const ITEM *it, int64_t b0, int64_t n, const int C,
                                                                int32_t *kp, int32_t *vp) {
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
        const int64_t m = n - c0 < 16 ? n - c0 : 16;
        const uint16_t *krow[16], *vrow[16];
        chunk_rows_bf16(it, b0 + c0, m, krow, vrow);
        int32_t *kc = kp + c0 * 8 * C, *vc = vp + c0 * 8 * C; /* both take D / 2 = 8 C pairs per position */
        for (int h = 0; h < C / 2; ++h) {                      /* dims 32h .. 32h + 31 of each row: 16 pairs */
            __m512 r[16];
            for (int64_t j = 0; j < 16; ++j) r[j] = j < m ? _mm512_loadu_ps(krow[j] + 32 * h) : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < 16; ++i) _mm512_storeu_ps((float *)kc + (16 * h + i) * 16, r[i]);
            for (int i = 0; i < 8; ++i) {
                const __m512i a = 2 * i < m ? _mm512_loadu_si512(vrow[2 * i] + 32 * h) : zero;
                const __m512i b = 2 * i + 1 < m ? _mm512_loadu_si512(vrow[2 * i + 1] + 32 * h) : zero;
                _mm512_storeu_si512(vc + (i * C + 2 * h) * 16, _mm512_unpacklo_epi16(a, b));
                _mm512_storeu_si512(vc + (i * C + 2 * h + 1) * 16, _mm512_unpackhi_epi16(a, b));
            }
        }
    }
}

/* 2. scores[p][16 (ch + k) + j] for PB pairs from pair0 and NC chunks from ch (compile-time PB, NC, C). */
static inline __attribute__((always_inline)) void dp_scores(const int32_t *q2, int64_t pair0, const int PB,
                                                            const int32_t *kp, int64_t ch, const int NC,
                                                            const int C, __m512 scale, float *scores) {
    __m512 acc[12][4];
    for (int p = 0; p < PB; ++p)
        for (int k = 0; k < NC; ++k) acc[p][k] = _mm512_setzero_ps();
    for (int dp = 0; dp < 8 * C; ++dp) {
        __m512i kv[4];
        for (int k = 0; k < NC; ++k) kv[k] = _mm512_loadu_si512(kp + ((ch + k) * 8 * C + dp) * 16);
        for (int p = 0; p < PB; ++p) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(q2[(pair0 + p) * 8 * C + dp]);
            for (int k = 0; k < NC; ++k) acc[p][k] = _mm512_dpbf16_ps(acc[p][k], qb, (__m512bh)kv[k]);
        }
    }
    for (int p = 0; p < PB; ++p)
        for (int k = 0; k < NC; ++k)
            _mm512_storeu_ps(scores + (pair0 + p) * DP_BLOCK + (ch + k) * 16, _mm512_mul_ps(acc[p][k], scale));
}

/* 2. for every pair, chunks ch .. ch + NC - 1: 12 / NC pairs at a time (12 accumulators hide the dot products'
 * latency), the rest one by one */
static inline __attribute__((always_inline)) void dp_scores_chunks(const int32_t *q2, int64_t pairs,
                                                                   const int32_t *kp, int64_t ch, const int NC,
                                                                   const int C, __m512 scale, float *scores) {
    int64_t p0 = 0;
    for (; p0 + 12 / NC <= pairs; p0 += 12 / NC) dp_scores(q2, p0, 12 / NC, kp, ch, NC, C, scale, scores);
    for (; p0 < pairs; ++p0) dp_scores(q2, p0, 1, kp, ch, NC, C, scale, scores);
}

/* 3. One pair's softmax step over the block's first `visible` positions (the rest weigh 0): updates its running
 * max and sum in state, writes its probabilities as bf16 pairs (n16 positions) and returns the factor by which
 * the output so far must shrink. */
static inline float dp_softmax_block(const float *scores, int64_t visible, int64_t n16, float *state, int32_t *probs) {
    if (visible <= 0) {
        memset(probs, 0, sizeof(int32_t) * n16 / 2);
        return 1.0f;
    }
    __m512 vmax = _mm512_set1_ps(-FLT_MAX);
    for (int64_t c0 = 0; c0 < visible; c0 += 16) {
        const __mmask16 mask = visible - c0 >= 16 ? (__mmask16)0xFFFFu : (__mmask16)((1u << (visible - c0)) - 1u);
        vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_loadu_ps(scores + c0));
    }
    const float m_old = state[0], block_max = _mm512_reduce_max_ps(vmax);
    const float m_new = block_max > m_old ? block_max : m_old;
    const __m512 mx = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < n16; c0 += 16) {
        const int64_t left = visible - c0;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFFu : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + c0), mx)));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256((__m256i *)(probs + c0 / 2), (__m256i)_mm512_cvtneps_pbh(p));
    }
    const float rescale = m_old == -FLT_MAX ? 0.0f : expf(m_old - m_new); /* (libm's underflow path is slow) */
    state[0] = m_new;
    state[1] = state[1] * rescale + _mm512_reduce_add_ps(sum);
    return rescale;
}

/* 4. out[p] = out[p] * rescale[p] + sum over the block's position pairs of probs . vp, PB pairs from pair0. */
static inline __attribute__((always_inline)) void dp_weighted_v(const int32_t *probs, int64_t pair0, const int PB,
                                                                const int32_t *vp, int64_t position_pairs,
                                                                const int C, const float *rescale, float *out) {
    const int64_t D = 16 * C;
    __m512 acc[6][8];
    for (int p = 0; p < PB; ++p) {
        const __m512 r = _mm512_set1_ps(rescale[pair0 + p]);
        for (int c = 0; c < C; ++c) acc[p][c] = _mm512_mul_ps(_mm512_loadu_ps(out + (pair0 + p) * D + 16 * c), r);
    }
    for (int64_t i = 0; i < position_pairs; ++i) {
        __m512i vv[8];
        for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_si512(vp + (i * C + c) * 16);
        for (int p = 0; p < PB; ++p) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(probs[(pair0 + p) * (DP_BLOCK / 2) + i]);
            for (int c = 0; c < C; ++c) acc[p][c] = _mm512_dpbf16_ps(acc[p][c], pb, (__m512bh)vv[c]);
        }
    }
    for (int p = 0; p < PB; ++p)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (pair0 + p) * D + 16 * c, acc[p][c]);
}

/* pairs at a time in dp_weighted_v: 24 accumulators (C = 4: 6 pairs; C = 8: 3) */
#define DP_V_PAIRS(C) (24 / (C))

static inline __attribute__((always_inline)) void prefill_tile_dp(const ITEM *it, const int C,
                                                                  const uint16_t *q_tile, /* [rows][G][D] raw */
                                                                  float scale, const int32_t *ctx_of_row,
                                                                  int64_t rows, float *out_tile, /* [rows][G][D] */
                                                                  float *state, const AttnScratch *scratch) {
    const int64_t G = it->group, pairs = rows * G, D = 16 * C;
    const int64_t max_ctx = prefill_tile_begin(ctx_of_row, rows, pairs, D, out_tile, state);
    const int32_t *q2 = (const int32_t *)q_tile; /* each pair's query as D / 2 bf16 pairs */
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t b0 = 0; b0 < max_ctx; b0 += DP_BLOCK) {
        const int64_t n = max_ctx - b0 < DP_BLOCK ? max_ctx - b0 : DP_BLOCK, n16 = (n + 15) / 16 * 16;
        dp_pack_block(it, b0, n, C, scratch->kp, scratch->vp);
        const int64_t chunks = n16 / 16, whole = chunks / 4 * 4;
        for (int64_t ch = 0; ch < whole; ch += 4)
            dp_scores_chunks(q2, pairs, scratch->kp, ch, 4, C, scale_v, scratch->block_scores);
        if (chunks - whole == 3) dp_scores_chunks(q2, pairs, scratch->kp, whole, 3, C, scale_v, scratch->block_scores);
        if (chunks - whole == 2) dp_scores_chunks(q2, pairs, scratch->kp, whole, 2, C, scale_v, scratch->block_scores);
        if (chunks - whole == 1) dp_scores_chunks(q2, pairs, scratch->kp, whole, 1, C, scale_v, scratch->block_scores);
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t visible = ctx_of_row[p / G] - b0;
            scratch->rescale[p] = dp_softmax_block(scratch->block_scores + p * DP_BLOCK, visible < n ? visible : n,
                                                   n16, state + 2 * p, scratch->probs + p * (DP_BLOCK / 2));
        }
        int64_t p0 = 0;
        for (; p0 + DP_V_PAIRS(C) <= pairs; p0 += DP_V_PAIRS(C))
            dp_weighted_v(scratch->probs, p0, DP_V_PAIRS(C), scratch->vp, n16 / 2, C, scratch->rescale, out_tile);
        for (; p0 < pairs; ++p0)
            dp_weighted_v(scratch->probs, p0, 1, scratch->vp, n16 / 2, C, scratch->rescale, out_tile);
    }
    /* normalize, and put the dims back in place: accumulators 2h, 2h + 1 hold dims 32h + 8L + t and
     * 32h + 8L + 4 + t in lane 4L + t; dims 32h .. 32h + 15 are their 128-bit quarters 0, 0, 1, 1 */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t i = 0; i < pairs; ++i) {
        const __m512 inv = _mm512_set1_ps(1.0f / state[2 * i + 1]);
        float *o = out_tile + i * D;
        for (int h = 0; h < C / 2; ++h) {
            const __m512 even = _mm512_loadu_ps(o + 32 * h), odd = _mm512_loadu_ps(o + 32 * h + 16);
            _mm512_storeu_ps(o + 32 * h, _mm512_mul_ps(_mm512_permutex2var_ps(even, lo, odd), inv));
            _mm512_storeu_ps(o + 32 * h + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, hi, odd), inv));
        }
    }
}
#undef DP_V_PAIRS

static void prefill_tile_dp_c4(const ITEM *it, const uint16_t *q_tile, float scale, const int32_t *ctx_of_row,
                               int64_t rows, float *out_tile, float *state, const AttnScratch *scratch) {
    prefill_tile_dp(it, 4, q_tile, scale, ctx_of_row, rows, out_tile, state, scratch);
}

static void prefill_tile_dp_c8(const ITEM *it, const uint16_t *q_tile, float scale, const int32_t *ctx_of_row,
                               int64_t rows, float *out_tile, float *state, const AttnScratch *scratch) {
    prefill_tile_dp(it, 8, q_tile, scale, ctx_of_row, rows, out_tile, state, scratch);
}
