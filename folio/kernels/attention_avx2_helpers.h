/* The helpers of the AVX2 + FMA attention bodies (decode_attention_avx2.h, prefill_attention_avx2.h), shared
 * by both cache types: included once by paged_attention_cpu.c where PAGED_ATTN_AVX2 is set. 8-float vectors;
 * named attn_*; the bfloat16 conversions, exp256 and reduce8_add are cpu_common.h's (its AVX2 block). */

/* all-ones in lanes j < n, zeros elsewhere (n may be <= 0 or > 8): tails of context chunks */
static inline __m256 attn_lanes_below(int64_t n) {
    const int clamped = n < 0 ? 0 : n > 8 ? 8 : (int)n;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(clamped), lane));
}

static inline float attn_hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* lane j of the result = the sum of the 8 lanes of s[j]: one reduction tree (7 hadds and 2 lane swaps for 8
 * sums, where 8 separate horizontal sums take about 40 operations) */
static inline __m256 attn_reduce8(const __m256 s[8]) {
    const __m256 t0 = _mm256_hadd_ps(s[0], s[1]), t1 = _mm256_hadd_ps(s[2], s[3]);
    const __m256 t2 = _mm256_hadd_ps(s[4], s[5]), t3 = _mm256_hadd_ps(s[6], s[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* per 128-bit lane: s[0..3] / s[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The AVX2 decode's softmax: each score row (ctx16 = ctx rounded up to 16 apart) -> its unnormalized
 * probabilities exp(s - max) in place (zeros past ctx, up to the next multiple of 8), and 1 / their sum into
 * inv_sum; the 1 / sum goes into the output at the end. */
static inline void attn_softmax_rows_avx2(float *scores, int64_t num_rows, int64_t ctx, const __m256 *row_max,
                                          float *inv_sum) {
    const int64_t ctx16 = (ctx + 15) / 16 * 16;
    for (int64_t r = 0; r < num_rows; ++r) {
        const __m256 mx = _mm256_set1_ps(attn_hmax8(row_max[r]));
        float *sr = scores + r * ctx16;
        __m256 sum = _mm256_setzero_ps();
        for (int64_t c0 = 0; c0 < ctx; c0 += 8) { /* the row's padding past ctx is read, then zeroed */
            const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + c0), mx)),
                                           attn_lanes_below(ctx - c0));
            sum = _mm256_add_ps(sum, p);
            _mm256_storeu_ps(sr + c0, p);
        }
        inv_sum[r] = 1.0f / reduce8_add(sum);
    }
}

/* The AVX2 prefill tile's softmax (prefill_attention_avx2.h, step 3), one pair's step over the block's first
 * `visible` positions (the rest weigh 0): updates its running max and sum in state, writes its probabilities
 * (n8 positions) and returns the factor by which the output so far must shrink. */
static inline float attn_block8_softmax(const float *scores, int64_t visible, int64_t n8, float *state,
                                        float *probs) {
    if (visible <= 0) {
        memset(probs, 0, sizeof(float) * n8);
        return 1.0f;
    }
    const __m256 lowest = _mm256_set1_ps(-FLT_MAX);
    __m256 vmax = lowest;
    for (int64_t c0 = 0; c0 < visible; c0 += 8)
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(lowest, _mm256_loadu_ps(scores + c0),
                                                     attn_lanes_below(visible - c0)));
    const float m_old = state[0], block_max = attn_hmax8(vmax);
    const float m_new = block_max > m_old ? block_max : m_old;
    const __m256 mx = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < n8; c0 += 8) {
        const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + c0), mx)),
                                       attn_lanes_below(visible - c0));
        sum = _mm256_add_ps(sum, p);
        _mm256_storeu_ps(probs + c0, p);
    }
    const float rescale = m_old == -FLT_MAX ? 0.0f : expf(m_old - m_new); /* (libm's underflow path is slow) */
    state[0] = m_new;
    state[1] = state[1] * rescale + reduce8_add(sum);
    return rescale;
}

/* r[i] <- column i of the 8 x 8 block whose rows are r[0..7] */
static inline void attn_transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);     /* a0 b0 a1 b1 | a4 b4 a5 b5 */
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]); /* a2 b2 a3 b3 | a6 b6 a7 b7 */
    }
    for (int i = 0; i < 2; ++i) { /* u[4i + k], lane L: rows 4i..4i+3 of column k + 4L */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[k + 4] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}
