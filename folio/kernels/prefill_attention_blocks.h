/* The AVX-512 prefill tile (see folio_prefill_attention_*) for head_dim = 16 C: included by
 * paged_attention_cpu_impl.h once per cache type (ITEM, KV_T, KV_LOAD16 are that instance's).
 *
 * The tile (up to PREFILL_TILE query rows x G query heads = its pairs) walks the context DP_BLOCK positions at a
 * time, flash-style, and each block is two small GEMMs with a softmax between:
 *   1. the block's K and V are rearranged once into operands shared by every pair (pack_block);
 *   2. scores = scale q . k for 12 / NC pairs x 16 NC positions at a time: 12 independent accumulator chains, each
 *      one multiply-add per 32-bit word of the query (block_scores);
 *   3. per pair, over the whole block at once: the running max, exp, the running sum (block_softmax: one
 *      horizontal max and sum per block; the earlier tiles paid them, an expf and a rescale of the output every
 *      16 positions, and ran at 90-170 GFLOP/s, latency-bound on those chains);
 *   4. out = out * rescale + p . V for 24 / C pairs at a time: 24 accumulators (block_weighted_v).
 * Everything works on 32-bit words, of one of two kinds (DP, a compile-time constant of each instance):
 *   DP = 0, float32 maths (any cache type, float32 queries): a word is a float; K is transposed per chunk of 16
 *     positions (kp[chunk][d] lane j = K[16 chunk + j][d]), V kept as rows (vp[j][c] = V[j][16c .. 16c + 15]);
 *     each step is an FMA of a broadcast float.
 *   DP = 1, bfloat16 queries on a bfloat16 cache with AVX512-BF16: a word is a pair of bf16, and vdpbf16ps
 *     multiplies both and adds the products into a float32 lane: half the instructions.
 *       kp[chunk][w]   lane j = (K[16 chunk + j][2w], K[16 chunk + j][2w + 1])
 *       vp[i][2h]      lane 4L + t = (V[2i][d], V[2i + 1][d]), d = 32h + 8L + t       (16-bit unpack, low half)
 *       vp[i][2h + 1]  the same with d = 32h + 8L + 4 + t                             (high half)
 *     The probabilities enter V rounded to bf16 (as flash-attention kernels on GPUs round them: a relative error
 *     of at most 2^-9 per weight), and the output accumulators hold dims in vp's order until the end.
 * Each position takes D / (1 + DP) words in kp and in vp. Softmax and sums are float32 in both. */

#ifdef __AVX512BF16__
#define WORD_STEP(DP, acc, a, b)                                                                                   \
    ((DP) ? _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))                                               \
          : _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), (acc)))
#else
#define WORD_STEP(DP, acc, a, b) ((void)(DP), _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), (acc)))
#endif

/* 1. Positions b0 .. b0 + n - 1 of the tile's KV head into kp and vp (positions n .. up to the chunk's end: 0). */
static inline __attribute__((always_inline)) void CAT(pack_block_, KV_SUFFIX)(const ITEM *it, int64_t b0, int64_t n,
                                                                             const int C, const int DP,
                                                                             float *kp, float *vp) {
    const int64_t words = 16 * C / (1 + DP); /* per position */
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
        const int64_t m = n - c0 < 16 ? n - c0 : 16;
        const KV_T *krow[16], *vrow[16];
        CAT(chunk_rows_, KV_SUFFIX)(it, c0 + b0, m, krow, vrow);
        float *kc = kp + c0 * words, *vc = vp + c0 * words;
        for (int h = 0; h < C / (1 + DP); ++h) { /* 16 words of each row at a time */
            __m512 r[16];
            for (int64_t j = 0; j < 16; ++j)
                r[j] = j >= m ? _mm512_setzero_ps()
                       : DP   ? _mm512_loadu_ps((const void *)(krow[j] + 32 * h))
                              : KV_LOAD16(krow[j] + 16 * h);
            transpose16(r);
            for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kc + (16 * h + i) * 16, r[i]);
            if (DP) {
                for (int i = 0; i < 8; ++i) {
                    const __m512i a = 2 * i < m ? _mm512_loadu_si512((const void *)(vrow[2 * i] + 32 * h)) : zero;
                    const __m512i b =
                        2 * i + 1 < m ? _mm512_loadu_si512((const void *)(vrow[2 * i + 1] + 32 * h)) : zero;
                    _mm512_storeu_si512(vc + (i * C + 2 * h) * 16, _mm512_unpacklo_epi16(a, b));
                    _mm512_storeu_si512(vc + (i * C + 2 * h + 1) * 16, _mm512_unpackhi_epi16(a, b));
                }
            } else {
                for (int64_t j = 0; j < 16; ++j)
                    _mm512_storeu_ps(vc + (j * C + h) * 16, j < m ? KV_LOAD16(vrow[j] + 16 * h)
                                                                           : _mm512_setzero_ps());
            }
        }
    }
}

/* 2. scores[p][16 (ch + k) + j] for PB pairs from pair0 and NC chunks from ch (compile-time PB, NC, C, DP);
 * q: each pair's query as D / (1 + DP) words. */
static inline __attribute__((always_inline)) void CAT(block_scores_, KV_SUFFIX)(
    const float *q, int64_t pair0, const int PB, const float *kp, int64_t ch, const int NC, const int C,
    const int DP, __m512 scale, float *scores) {
    const int words = 16 * C / (1 + DP);
    __m512 acc[12][4];
    for (int p = 0; p < PB; ++p)
        for (int k = 0; k < NC; ++k) acc[p][k] = _mm512_setzero_ps();
    for (int w = 0; w < words; ++w) {
        __m512i kv[4];
        for (int k = 0; k < NC; ++k) kv[k] = _mm512_loadu_si512(kp + ((ch + k) * words + w) * 16);
        for (int p = 0; p < PB; ++p) {
            const __m512i qw = broadcast_word(q + (pair0 + p) * words + w);
            for (int k = 0; k < NC; ++k) acc[p][k] = WORD_STEP(DP, acc[p][k], qw, kv[k]);
        }
    }
    for (int p = 0; p < PB; ++p)
        for (int k = 0; k < NC; ++k)
            _mm512_storeu_ps(scores + (pair0 + p) * DP_BLOCK + (ch + k) * 16, _mm512_mul_ps(acc[p][k], scale));
}

/* 2. for every pair, chunks ch .. ch + NC - 1: 12 / NC pairs at a time, the rest one by one */
static inline __attribute__((always_inline)) void CAT(block_scores_all_, KV_SUFFIX)(
    const float *q, int64_t pairs, const float *kp, int64_t ch, const int NC, const int C, const int DP,
    __m512 scale, float *scores) {
    int64_t p0 = 0;
    for (; p0 + 12 / NC <= pairs; p0 += 12 / NC)
        CAT(block_scores_, KV_SUFFIX)(q, p0, 12 / NC, kp, ch, NC, C, DP, scale, scores);
    for (; p0 < pairs; ++p0) CAT(block_scores_, KV_SUFFIX)(q, p0, 1, kp, ch, NC, C, DP, scale, scores);
}

/* 3. One pair's softmax step over the block's first `visible` positions (the rest weigh 0): updates its running
 * max and sum in state, writes its probabilities (n16 positions: floats, or bf16 pairs where DP) and returns
 * the factor by which the output so far must shrink. */
static inline __attribute__((always_inline)) float CAT(block_softmax_, KV_SUFFIX)(const float *scores,
                                                                                 int64_t visible, int64_t n16,
                                                                                 const int DP, float *state,
                                                                                 float *probs) {
    if (visible <= 0) {
        memset(probs, 0, sizeof(float) * n16 / (1 + DP));
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
        if (DP)
            _mm256_storeu_si256((__m256i *)(probs + c0 / 2), f32x16_to_bf16(p));
        else
            _mm512_storeu_ps(probs + c0, p);
    }
    const float rescale = m_old == -FLT_MAX ? 0.0f : expf(m_old - m_new); /* (libm's underflow path is slow) */
    state[0] = m_new;
    state[1] = state[1] * rescale + _mm512_reduce_add_ps(sum);
    return rescale;
}

/* 4. out[p] = out[p] * rescale[p] + probs[p] . vp over `steps` words of probabilities, PB pairs from pair0. */
static inline __attribute__((always_inline)) void CAT(block_weighted_v_, KV_SUFFIX)(
    const float *probs, int64_t pair0, const int PB, const float *vp, int64_t steps, const int C, const int DP,
    const float *rescale, float *out) {
    const int64_t D = 16 * C;
    __m512 acc[6][8];
    for (int p = 0; p < PB; ++p) {
        const __m512 r = _mm512_set1_ps(rescale[pair0 + p]);
        for (int c = 0; c < C; ++c) acc[p][c] = _mm512_mul_ps(_mm512_loadu_ps(out + (pair0 + p) * D + 16 * c), r);
    }
    for (int64_t i = 0; i < steps; ++i) {
        __m512i vv[8];
        for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_si512(vp + (i * C + c) * 16);
        for (int p = 0; p < PB; ++p) {
            const __m512i pw = broadcast_word(probs + (pair0 + p) * DP_BLOCK + i);
            for (int c = 0; c < C; ++c) acc[p][c] = WORD_STEP(DP, acc[p][c], pw, vv[c]);
        }
    }
    for (int p = 0; p < PB; ++p)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (pair0 + p) * D + 16 * c, acc[p][c]);
}

/* The tile's queries come in scratch->q_tile ([rows][G][D] words: float32, or raw bf16 where DP; every access
 * goes through broadcast_word) and its output goes to scratch->out_tile ([rows][G][D] float32). */
static inline __attribute__((always_inline)) void CAT(prefill_tile_blocks_, KV_SUFFIX)(
    const ITEM *it, const int C, const int DP, float scale, const int32_t *ctx_of_row, int64_t rows,
    const AttnScratch *scratch) {
    const int64_t G = it->group, pairs = rows * G, D = 16 * C;
    float *out_tile = scratch->out_tile, *state = scratch->state;
    const int64_t max_ctx = prefill_tile_begin(ctx_of_row, rows, pairs, D, out_tile, state);
    const float *q = scratch->q_tile;
    const __m512 scale_v = _mm512_set1_ps(scale);
    float *kp = scratch->kp, *vp = scratch->vp, *probs = scratch->probs;
    float *scores = scratch->block_scores;
    for (int64_t b0 = 0; b0 < max_ctx; b0 += DP_BLOCK) {
        const int64_t n = max_ctx - b0 < DP_BLOCK ? max_ctx - b0 : DP_BLOCK, n16 = (n + 15) / 16 * 16;
        CAT(pack_block_, KV_SUFFIX)(it, b0, n, C, DP, kp, vp);
        const int64_t chunks = n16 / 16, whole = chunks / 4 * 4;
        for (int64_t ch = 0; ch < whole; ch += 4) CAT(block_scores_all_, KV_SUFFIX)(q, pairs, kp, ch, 4, C, DP, scale_v, scores);
        if (chunks - whole == 3) CAT(block_scores_all_, KV_SUFFIX)(q, pairs, kp, whole, 3, C, DP, scale_v, scores);
        if (chunks - whole == 2) CAT(block_scores_all_, KV_SUFFIX)(q, pairs, kp, whole, 2, C, DP, scale_v, scores);
        if (chunks - whole == 1) CAT(block_scores_all_, KV_SUFFIX)(q, pairs, kp, whole, 1, C, DP, scale_v, scores);
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t visible = ctx_of_row[p / G] - b0;
            scratch->rescale[p] = CAT(block_softmax_, KV_SUFFIX)(scores + p * DP_BLOCK, visible < n ? visible : n, n16,
                                                                 DP, state + 2 * p, probs + p * DP_BLOCK);
        }
        const int64_t steps = n16 / (1 + DP);
        int64_t p0 = 0;
        for (; p0 + 24 / C <= pairs; p0 += 24 / C)
            CAT(block_weighted_v_, KV_SUFFIX)(probs, p0, 24 / C, vp, steps, C, DP, scratch->rescale, out_tile);
        for (; p0 < pairs; ++p0)
            CAT(block_weighted_v_, KV_SUFFIX)(probs, p0, 1, vp, steps, C, DP, scratch->rescale, out_tile);
    }
    /* normalize; where DP, also put the dims back in place: accumulators 2h, 2h + 1 hold dims 32h + 8L + t and
     * 32h + 8L + 4 + t in lane 4L + t, so dims 32h .. 32h + 15 are their 128-bit quarters 0, 0, 1, 1 */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t i = 0; i < pairs; ++i) {
        const __m512 inv = _mm512_set1_ps(1.0f / state[2 * i + 1]);
        float *o = out_tile + i * D;
        for (int h = 0; h < C / 2; ++h) {
            const __m512 a = _mm512_loadu_ps(o + 32 * h), b = _mm512_loadu_ps(o + 32 * h + 16);
            _mm512_storeu_ps(o + 32 * h, _mm512_mul_ps(DP ? _mm512_permutex2var_ps(a, lo, b) : a, inv));
            _mm512_storeu_ps(o + 32 * h + 16, _mm512_mul_ps(DP ? _mm512_permutex2var_ps(a, hi, b) : b, inv));
        }
    }
}

/* The instances: float32 maths for head_dim 64 / 128, and where the cache is bf16 and the CPU has AVX512-BF16,
 * the dot-product ones */
#define DEFINE_PREFILL_BLOCKS(C, DP)                                                                           \
    static void CAT(prefill_tile_c##C##_dp##DP##_, KV_SUFFIX)(const ITEM *it, float scale,                     \
                                                               const int32_t *ctx_of_row, int64_t rows,        \
                                                               const AttnScratch *scratch) {                   \
        CAT(prefill_tile_blocks_, KV_SUFFIX)(it, C, DP, scale, ctx_of_row, rows, scratch);                       \
    }
DEFINE_PREFILL_BLOCKS(4, 0)
DEFINE_PREFILL_BLOCKS(8, 0)
#if KV_IS_BF16 && defined(__AVX512BF16__)
DEFINE_PREFILL_BLOCKS(4, 1)
DEFINE_PREFILL_BLOCKS(8, 1)
#endif
#undef DEFINE_PREFILL_BLOCKS
#undef WORD_STEP
