/* The AVX-512 decode body: included by paged_attention_cpu_impl.h once per cache type (ITEM, KV_T, KV_SUFFIX,
 * KV_IS_BF16, KV_LOAD16 are that instance's) in AVX-512 builds; decode_attention_avx2.h is its AVX2 twin. */

/* One decode row, KV heads [kh0, kh1), head_dim = 16 C, G query heads per KV head (compile-time constants at
 * each call), in three steps over the row's blocks:
 *   1. scores: for each block and KV head, 16 positions at a time, the G heads' scores q . k into
 *      scores[(kh - kh0) G + g][position], with a lane-wise running max (no horizontal op per chunk);
 *   2. softmax: per query head one horizontal max, then exp and a lane-wise sum over the score row;
 *   3. V: for each block and KV head, the G x C output vectors stay in registers through 16 positions.
 * Walking block by block needs one block-table read per block and no per-position index arithmetic; a block's
 * positions of one KV head are consecutive rows (pos_stride apart). Three steps rather than an online softmax:
 * the per-chunk max/exp/rescale chain of an online softmax cost as much as the scores themselves here
 * (docs/performance.md).
 * Scores: one vector of partial sums per position, then one 16-way reduction tree (reduce16) per chunk; with
 * bfloat16 queries and cache the products come from AVX512-BF16 dot instructions on the raw pairs (exact
 * products, float32 sums). V from a bfloat16 cache with AVX512-BF16: the softmax weights are rounded to bf16 (as
 * the prefill tile and Hugging Face's eager bf16 attention do) and two positions go into one dot instruction per
 * 16 dims (v_row_pairs_): half the FMA-port work of float32 FMAs, and 10% off the whole kernel with the cache in
 * L2 (64 rows x 30 layers: 3.51 -> 3.15 ms; docs/performance.md). Without AVX512-BF16: one 32-element load gives
 * the even dims (shift) and the odd dims (mask) as float32; the accumulators keep even and odd dims apart until
 * the end.
 * q: the row's [H, D] float32; q_bf16: the row's raw bf16 query or NULL; out: the row's [H, D] float32;
 * scores: [(kh1 - kh0) G, ctx rounded up to 16] float32; (kh1 - kh0) G <= DECODE_MAX_HEADS. */
/* s[j] = the 16-lane partial sums of q . k_j for the chunk's rows j < 16 (rows j >= n repeat row n - 1: the
 * caller masks them out). With n == 16 at the call, the clamp folds away. q_bf16: the head's raw bf16 query,
 * used (AVX512-BF16 pair dot products on the raw cache) where the cache is bf16, else q (float32). */
static inline __attribute__((always_inline)) void CAT(chunk_scores_, KV_SUFFIX)(
    const KV_T *kc, int64_t pos_stride, int64_t n, const int C, const float *q, const uint16_t *q_bf16,
    __m512 s[16]) {
    (void)q_bf16;
#if KV_IS_BF16 && defined(__AVX512BF16__)
    if (q_bf16 != NULL) {
        __m512bh qb[4];
        for (int h = 0; h < C / 2; ++h) qb[h] = load32_bh(q_bf16 + 32 * h);
        for (int j = 0; j < 16; ++j) {
            const KV_T *k = kc + (j < n ? j : n - 1) * pos_stride;
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[0], load32_bh(k));
            for (int h = 1; h < C / 2; ++h) a = _mm512_dpbf16_ps(a, qb[h], load32_bh(k + 32 * h));
            s[j] = a;
        }
        return;
    }
#endif
    __m512 qv[8];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + c * 16);
    for (int j = 0; j < 16; ++j) {
        const KV_T *k = kc + (j < n ? j : n - 1) * pos_stride;
        __m512 a = _mm512_mul_ps(qv[0], KV_LOAD16(k));
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], KV_LOAD16(k + c * 16), a);
        s[j] = a;
    }
}


#if KV_IS_BF16 && defined(__AVX512BF16__)
#define DECODE_V_DOT 1
/* Two consecutive V rows of one KV head (v1 NULL: a lone last row, paired with zeros) as dot-product operands:
 * vv[c] holds 16 dims, each as the pair (row 0, row 1), so one vdpbf16ps with a broadcast pair of softmax weights
 * (p0, p1) adds p0 v0 + p1 v1 to 16 dims. vv[2h] (the low words of each 128-bit lane of the 32-dim slice h) holds
 * dims 32h + 8L + i, vv[2h + 1] dims 32h + 8L + 4 + i, at dword 4L + i (i < 4); decode_row undoes the order. */
static inline __attribute__((always_inline)) void CAT(v_row_pairs_, KV_SUFFIX)(const KV_T *v0, const KV_T *v1,
                                                                                const int C, __m512bh vv[8]) {
    for (int h = 0; h < C / 2; ++h) {
        const __m512i r0 = _mm512_loadu_si512(v0 + 32 * h);
        const __m512i r1 = v1 != NULL ? _mm512_loadu_si512(v1 + 32 * h) : _mm512_setzero_si512();
        vv[2 * h] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
        vv[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
    }
}
#else
#define DECODE_V_DOT 0
#endif

static inline __attribute__((always_inline)) void CAT(decode_row_avx512_, KV_SUFFIX)(
    const ITEM *it, const int G, const int C, int64_t head_stride, int64_t kh0, int64_t kh1, const float *q,
    const uint16_t *q_bf16, float *out, float *scores) {
    const int64_t ctx = it->ctx, bs = it->block_size, D = 16 * C, pos_stride = it->pos_stride;
    const int64_t ctx16 = (ctx + 15) / 16 * 16; /* score rows are padded to whole chunks */
    const int64_t num_kv = kh1 - kh0;
    const __m512 scale = _mm512_set1_ps(it->scale);
    __m512 row_max[DECODE_MAX_HEADS];
    for (int64_t i = 0; i < num_kv * G; ++i) row_max[i] = _mm512_set1_ps(-FLT_MAX);
    (void)q_bf16;
    /* Both passes ask for the next block's rows of a KV head while they compute this block's, and the scores
     * pass for the row's first K block and, at its last block, the first V block: the cache streams from DRAM
     * (every block of every layer, each step), and neither the hardware prefetcher nor the out-of-order window
     * reaches a block ahead on its own. 64 decode rows x 30 layers, 2 threads: 10.3-11.0 -> 6.8-9.1 ms
     * (docs/performance.md). */
    const int64_t row_blocks = (ctx + bs - 1) / bs;
    for (int64_t kh = kh0; kh < kh1; ++kh) PREFETCH_ROWS(it->k_cache, 0, kh);
    /* 1. scores */
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t block_offset = it->blocks[start / bs] * it->block_stride;
        const int64_t n_block = ctx - start < bs ? ctx - start : bs;
        for (int64_t kh = kh0; kh < kh1; ++kh) {
            const KV_T *kb = it->k_cache + block_offset + kh * head_stride;
            if (start / bs + 1 < row_blocks)
                PREFETCH_ROWS(it->k_cache, start / bs + 1, kh);
            else
                PREFETCH_ROWS(it->v_cache, 0, kh);
            for (int64_t j0 = 0; j0 < n_block; j0 += 16) {
                const int64_t n = n_block - j0 < 16 ? n_block - j0 : 16;
                const __mmask16 mask = (__mmask16)(n == 16 ? 0xFFFFu : (1u << n) - 1u);
                const KV_T *kc = kb + j0 * pos_stride;
                for (int g = 0; g < G; ++g) {
                    const int64_t head = kh * G + g, r = (kh - kh0) * G + g;
                    const uint16_t *qh_bf16 = q_bf16 == NULL ? NULL : q_bf16 + head * D;
                    __m512 s[16];
                    if (n == 16)
                        CAT(chunk_scores_, KV_SUFFIX)(kc, pos_stride, 16, C, q + head * D, qh_bf16, s);
                    else
                        CAT(chunk_scores_, KV_SUFFIX)(kc, pos_stride, n, C, q + head * D, qh_bf16, s);
                    const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), mask, _mm512_mul_ps(reduce16(s), scale));
                    row_max[r] = _mm512_max_ps(row_max[r], sc);
                    _mm512_mask_storeu_ps(scores + r * ctx16 + start + j0, mask, sc);
                }
            }
        }
    }
    /* 2. softmax: probabilities unnormalized (exp(s - max)); the 1 / sum goes into the output at the end */
    float inv_sum[DECODE_MAX_HEADS];
    for (int64_t r = 0; r < num_kv * G; ++r) {
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(row_max[r]));
        float *sr = scores + r * ctx16;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c0 = 0; c0 < ctx16; c0 += 16) {
            const __mmask16 mask = ctx - c0 >= 16 ? (__mmask16)0xFFFFu : (__mmask16)((1u << (ctx - c0)) - 1u);
            const __m512 p = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + c0), mx)));
            sum = _mm512_add_ps(sum, p);
#if DECODE_V_DOT /* the weights as bf16, in the first half of the row's own storage (behind the reads) */
            _mm256_storeu_si256((__m256i *)((uint16_t *)sr + c0), (__m256i)_mm512_cvtneps_pbh(p));
#else
            _mm512_storeu_ps(sr + c0, p);
#endif
        }
        inv_sum[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* 3. V: block by block (all the item's KV heads of a block are one contiguous run in a head-major cache),
     * the G x C accumulators of a KV head in registers through the block, in out between blocks */
    memset(out + kh0 * G * D, 0, sizeof(float) * num_kv * G * D);
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t block_offset = it->blocks[start / bs] * it->block_stride;
        const int64_t n_block = ctx - start < bs ? ctx - start : bs;
        for (int64_t kh = kh0; kh < kh1; ++kh) {
            const KV_T *vb = it->v_cache + block_offset + kh * head_stride;
            if (start / bs + 1 < row_blocks) PREFETCH_ROWS(it->v_cache, start / bs + 1, kh);
            float *acc = out + kh * G * D;
            __m512 a[6][8];
            for (int g = 0; g < G; ++g)
                for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
#if DECODE_V_DOT
            /* two positions per step: the weights of head g for positions j, j + 1 are one bf16 pair */
            const uint16_t *pairs = (const uint16_t *)(scores + (kh - kh0) * G * ctx16) + start;
            for (int64_t j = 0; j < n_block; j += 2) {
                /* a lone last row of the block: its partner's weight meets zeros */
                const KV_T *partner = j + 1 < n_block ? vb + (j + 1) * pos_stride : NULL;
                __m512bh vv[8];
                CAT(v_row_pairs_, KV_SUFFIX)(vb + j * pos_stride, partner, C, vv);
                for (int g = 0; g < G; ++g) {
                    const __m512bh pj = (__m512bh)broadcast_word(pairs + g * 2 * ctx16 + j);
                    for (int c = 0; c < C; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], pj, vv[c]);
                }
            }
#else
            const float *probs = scores + (kh - kh0) * G * ctx16 + start;
            for (int64_t j = 0; j < n_block; ++j) {
                const KV_T *v = vb + j * pos_stride;
                __m512 vv[8];
#if KV_IS_BF16
                /* vv[2h] = even dims 32h, 32h+2, ..; vv[2h+1] = odd dims 32h+1, 32h+3, .. (as float32) */
                for (int h = 0; h < C / 2; ++h) {
                    const __m512i raw = _mm512_loadu_si512(v + 32 * h);
                    vv[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
                    vv[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xFFFF0000u)));
                }
#else
                for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
#endif
                for (int g = 0; g < G; ++g) {
                    const __m512 pj = _mm512_set1_ps(probs[g * ctx16 + j]);
                    for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pj, vv[c], a[g][c]);
                }
            }
#endif
            for (int g = 0; g < G; ++g)
                for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
        }
    }
    for (int64_t r = 0; r < num_kv * G; ++r) {
        const __m512 inv = _mm512_set1_ps(inv_sum[r]);
        float *o = out + (kh0 * G + r) * D;
#if KV_IS_BF16
        /* o holds each 32-dim slice as two vectors in the V pass's order: put the dims back in order */
#if DECODE_V_DOT /* as v_row_pairs_ leaves them */
        const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#else /* the even dims, then the odd ones */
        const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
#endif
        for (int h = 0; h < C / 2; ++h) {
            const __m512 first = _mm512_loadu_ps(o + 32 * h), second = _mm512_loadu_ps(o + 32 * h + 16);
            _mm512_storeu_ps(o + 32 * h, _mm512_mul_ps(_mm512_permutex2var_ps(first, lo, second), inv));
            _mm512_storeu_ps(o + 32 * h + 16, _mm512_mul_ps(_mm512_permutex2var_ps(first, hi, second), inv));
        }
#else
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), inv));
#endif
    }
}

#undef DECODE_V_DOT

#define DEFINE_DECODE_AVX512(G, C)                                                                           \
    static void CAT(decode_g##G##_c##C##_, KV_SUFFIX)(const ITEM *it, int64_t head_stride, int64_t kh0,        \
                                                      int64_t kh1, const float *q, const uint16_t *q_bf16,    \
                                                      float *out, float *state) {                             \
        CAT(decode_row_avx512_, KV_SUFFIX)(it, G, C, head_stride, kh0, kh1, q, q_bf16, out, state);          \
    }
DEFINE_DECODE_AVX512(1, 4)
DEFINE_DECODE_AVX512(2, 4)
DEFINE_DECODE_AVX512(3, 4)
DEFINE_DECODE_AVX512(4, 4)
DEFINE_DECODE_AVX512(5, 4)
DEFINE_DECODE_AVX512(6, 4)
DEFINE_DECODE_AVX512(1, 8)
DEFINE_DECODE_AVX512(2, 8)
DEFINE_DECODE_AVX512(3, 8)
DEFINE_DECODE_AVX512(4, 8)
#undef DEFINE_DECODE_AVX512
