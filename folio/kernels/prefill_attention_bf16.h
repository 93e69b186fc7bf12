/* The prefill tile (see folio_prefill_attention_*) for a bfloat16 cache and bfloat16 queries, on AVX512-BF16 dot
 * products: included by paged_attention_cpu_impl.h inside its bfloat16 instance (ITEM is that instance's).
 *
 * Why: the float32 tile converts every K/V chunk to float32 and spends 64 FMAs per (query head, row) and 16
 * positions on the scores and as many on the weighted V; vdpbf16ps multiplies bf16 pairs and adds both products
 * into a float32 lane, so the same work takes half the instructions. Per chunk of 16 positions the K and V rows
 * are rearranged once into dot-product operands, shared by every (row, head) pair of the tile:
 *   kp[dp]        lane j = (K[j][2 dp], K[j][2 dp + 1])          (a 16 x 16 transpose of 32-bit pairs)
 *   vp[i][2h]     lane 4L + t = (V[2i][d], V[2i + 1][d]), d = 32h + 8L + t       (16-bit unpack, low half)
 *   vp[i][2h + 1] lane 4L + t = (V[2i][d], V[2i + 1][d]), d = 32h + 8L + 4 + t   (high half)
 * so a pair's 16 scores are D/2 dot products of its broadcast (q[2 dp], q[2 dp + 1]) with kp[dp], and its
 * output gains, per position pair i, C dot products of the broadcast (p[2i], p[2i + 1]) with vp[i]. The output
 * accumulators hold dims in vp's order until the end, where they are put back in place.
 * Rounding: the softmax runs in float32 as in the float32 tile; the probabilities enter the V products rounded to
 * bf16 (as flash-attention kernels on GPUs round them), a relative error of at most 2^-9 per weight. */

#define DEFINE_PREFILL_DP(C)                                                                                     \
    static void prefill_tile_dp_c##C(const ITEM *it, const uint16_t *q_tile, /* [rows][G][D] raw bf16 */       \
                                     float scale, const int32_t *ctx_of_row, int64_t rows,                      \
                                     float *out_tile, /* [rows][G][D] */ float *state) {                       \
        const int64_t G = it->group, pairs = rows * G, D = 16 * C;                                             \
        const int64_t max_ctx = prefill_tile_begin(ctx_of_row, rows, pairs, D, out_tile, state);               \
        __m512i kp[8 * C], vp[8][C];                                                                            \
        const __m512i zero = _mm512_setzero_si512();                                                            \
        for (int64_t c0 = 0; c0 < max_ctx; c0 += 16) {                                                          \
            const int64_t n = max_ctx - c0 < 16 ? max_ctx - c0 : 16;                                            \
            const uint16_t *krow[16], *vrow[16];                                                                \
            chunk_rows_bf16(it, c0, n, krow, vrow);                                                             \
            for (int h = 0; h < C / 2; ++h) { /* dims 32h .. 32h + 31 of each row: 16 pairs */                   \
                __m512 r[16];                                                                                   \
                for (int64_t j = 0; j < 16; ++j)                                                                \
                    r[j] = j < n ? _mm512_loadu_ps(krow[j] + 32 * h) : _mm512_setzero_ps();                     \
                transpose16(r);                                                                                 \
                for (int i = 0; i < 16; ++i) kp[16 * h + i] = _mm512_castps_si512(r[i]);                        \
                for (int i = 0; i < 8; ++i) {                                                                   \
                    const __m512i a = 2 * i < n ? _mm512_loadu_si512(vrow[2 * i] + 32 * h) : zero;              \
                    const __m512i b = 2 * i + 1 < n ? _mm512_loadu_si512(vrow[2 * i + 1] + 32 * h) : zero;      \
                    vp[i][2 * h] = _mm512_unpacklo_epi16(a, b);                                                 \
                    vp[i][2 * h + 1] = _mm512_unpackhi_epi16(a, b);                                             \
                }                                                                                               \
            }                                                                                                   \
            for (int64_t row = 0; row < rows; ++row) {                                                          \
                const int64_t visible = ctx_of_row[row] - c0;                                                   \
                if (visible <= 0) continue;                                                                     \
                const int64_t used = visible < 16 ? visible : 16;                                               \
                const __mmask16 mask = (__mmask16)(used == 16 ? 0xFFFFu : (1u << used) - 1u);                  \
                for (int64_t g = 0; g < G; ++g) {                                                               \
                    const int64_t pair = row * G + g;                                                           \
                    const uint16_t *qp = q_tile + pair * D;                                                     \
                    int32_t q2[8 * C]; /* the query's dims as bf16 pairs */                                    \
                    memcpy(q2, qp, sizeof q2);                                                                  \
                    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0; /* 4 independent chains */      \
                    for (int dp = 0; dp < 8 * C; dp += 4) {                                                     \
                        s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_set1_epi32(q2[dp]), (__m512bh)kp[dp]);       \
                        s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_set1_epi32(q2[dp + 1]), (__m512bh)kp[dp + 1]); \
                        s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_set1_epi32(q2[dp + 2]), (__m512bh)kp[dp + 2]); \
                        s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_set1_epi32(q2[dp + 3]), (__m512bh)kp[dp + 3]); \
                    }                                                                                           \
                    __m512 sc = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)),     \
                                              _mm512_set1_ps(scale));                                           \
                    sc = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), mask, sc);                                \
                    const float m_old = state[2 * pair], chunk_max = _mm512_reduce_max_ps(sc);                  \
                    const float m_new = chunk_max > m_old ? chunk_max : m_old;                                  \
                    const float rescale = expf(m_old - m_new);                                                  \
                    const __m512 probs = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m_new)))); \
                    state[2 * pair] = m_new;                                                                    \
                    state[2 * pair + 1] = state[2 * pair + 1] * rescale + _mm512_reduce_add_ps(probs);          \
                    int32_t p2[8]; /* the probabilities as bf16 pairs (p[2i], p[2i + 1]) */                     \
                    _mm256_storeu_si256((__m256i *)p2, (__m256i)_mm512_cvtneps_pbh(probs));                     \
                    float *o = out_tile + pair * D;                                                             \
                    __m512 acc[C];                                                                              \
                    for (int c = 0; c < C; ++c) acc[c] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), _mm512_set1_ps(rescale)); \
                    for (int64_t i = 0; 2 * i < used; ++i) {                                                    \
                        const __m512bh pi = (__m512bh)_mm512_set1_epi32(p2[i]);                                 \
                        for (int c = 0; c < C; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], pi, (__m512bh)vp[i][c]); \
                    }                                                                                           \
                    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);                          \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        /* normalize, and put the dims back in place: accumulators 2h, 2h + 1 hold dims 32h + 8L + t and */   \
        /* 32h + 8L + 4 + t in lane 4L + t; dims 32h .. 32h + 15 are their 128-bit quarters 0, 0, 1, 1 */     \
        const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);           \
        const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);     \
        for (int64_t i = 0; i < pairs; ++i) {                                                                   \
            const __m512 inv = _mm512_set1_ps(1.0f / state[2 * i + 1]);                                         \
            float *o = out_tile + i * D;                                                                        \
            for (int h = 0; h < C / 2; ++h) {                                                                   \
                const __m512 even = _mm512_loadu_ps(o + 32 * h), odd = _mm512_loadu_ps(o + 32 * h + 16);        \
                _mm512_storeu_ps(o + 32 * h, _mm512_mul_ps(_mm512_permutex2var_ps(even, lo, odd), inv));        \
                _mm512_storeu_ps(o + 32 * h + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, hi, odd), inv));   \
            }                                                                                                   \
        }                                                                                                       \
    }

DEFINE_PREFILL_DP(4)
DEFINE_PREFILL_DP(8)
#undef DEFINE_PREFILL_DP
