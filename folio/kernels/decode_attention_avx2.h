/* The AVX2 + FMA decode body (x86-64-v3 builds): included by paged_attention_cpu_impl.h once per cache type
 * (ITEM, KV_T, KV_SUFFIX, KV_IS_BF16 are that instance's), where PAGED_ATTN_AVX2 is set.
 *
 * The AVX-512 body's three passes (decode_row_avx512_) with 8-float vectors and 16 registers, head_dim = 8 C:
 *   1. scores: 8 positions at a time, one vector of partial sums per position (8 independent FMA chains, the
 *      query read from L1 one vector at a time), then one 8-way reduction tree (attn_reduce8) per chunk;
 *   2. softmax: per query head one horizontal max, exp (exp256) and a lane-wise sum over the score row;
 *   3. V: 16 registers do not hold G x C accumulators (G 3, head_dim 64: 24). On a float32 cache the pass walks
 *      the block's rows once per query head (and slice of 64 dims), with 8 accumulators and one broadcast weight
 *      live, the later heads finding the rows in L1 (a KV head's block: 4 KiB); on a bfloat16 cache once per
 *      slice of W vectors of dims for all G heads, each vector widened once.
 * A bfloat16 cache is widened in registers (vpmovzxwd + shift), one 8-dim vector per load. */

static inline __attribute__((always_inline)) __m256 CAT(kv_load8_, KV_SUFFIX)(const KV_T *p) {
#if KV_IS_BF16
    return load8_bf16(p);
#else
    return _mm256_loadu_ps(p);
#endif
}


/* s[j] = the 8-lane partial sums of q . k[j] for the chunk's 8 rows (the caller points rows past the chunk's
 * end at its last row and masks their scores out). One body for whole chunks and tails: the 8 row pointers live
 * in general registers, and a second copy unrolled for whole chunks only doubled the code (and its compile
 * time) for no measured gain. */
static inline __attribute__((always_inline)) void CAT(chunk8_scores_, KV_SUFFIX)(const KV_T *const k[8], const int C,
                                                                                 const float *q, __m256 s[8]) {
    for (int j = 0; j < 8; ++j) s[j] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
        for (int j = 0; j < 8; ++j) s[j] = _mm256_fmadd_ps(qc, CAT(kv_load8_, KV_SUFFIX)(k[j] + 8 * c), s[j]);
    }
}

/* 1. scores[(kh - kh0) G + g][position] = scale q . k, and each score row's lane-wise running max */
static inline __attribute__((always_inline)) void CAT(decode_scores_avx2_, KV_SUFFIX)(
    const ITEM *it, const int G, const int C, int64_t head_stride, int64_t kh0, int64_t kh1, const float *q,
    float *scores, __m256 *row_max) {
    const int64_t ctx = it->ctx, bs = it->block_size, D = 8 * C, pos_stride = it->pos_stride;
    const int64_t ctx16 = (ctx + 15) / 16 * 16, row_blocks = (ctx + bs - 1) / bs;
    const __m256 scale = _mm256_set1_ps(it->scale), lowest = _mm256_set1_ps(-FLT_MAX);
    for (int64_t kh = kh0; kh < kh1; ++kh) PREFETCH_ROWS(it->k_cache, 0, kh);
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t block_offset = it->blocks[start / bs] * it->block_stride;
        const int64_t n_block = ctx - start < bs ? ctx - start : bs;
        for (int64_t kh = kh0; kh < kh1; ++kh) {
            const KV_T *kb = it->k_cache + block_offset + kh * head_stride;
            if (start / bs + 1 < row_blocks)
                PREFETCH_ROWS(it->k_cache, start / bs + 1, kh);
            else /* the V pass starts at block 0 */
                PREFETCH_ROWS(it->v_cache, 0, kh);
            for (int64_t j0 = 0; j0 < n_block; j0 += 8) {
                const int64_t n = n_block - j0 < 8 ? n_block - j0 : 8;
                const __m256 valid = attn_lanes_below(n);
                const KV_T *k[8];
                for (int64_t j = 0; j < 8; ++j) k[j] = kb + (j0 + (j < n ? j : n - 1)) * pos_stride;
                for (int g = 0; g < G; ++g) {
                    const int64_t r = (kh - kh0) * G + g;
                    __m256 s[8];
                    CAT(chunk8_scores_, KV_SUFFIX)(k, C, q + (kh * G + g) * D, s);
                    const __m256 sc = _mm256_blendv_ps(lowest, _mm256_mul_ps(attn_reduce8(s), scale), valid);
                    row_max[r] = _mm256_max_ps(row_max[r], sc);
                    /* masked: with a block size that is not a multiple of 8, a whole vector would run into the
                     * next score row */
                    _mm256_maskstore_ps(scores + r * ctx16 + start + j0, _mm256_castps_si256(valid), sc);
                }
            }
        }
    }
}

#if KV_IS_BF16
/* 3. on a bfloat16 cache: out[kh G + g] += probs . V over one block's n_block rows of KV head kh, dims 8 s0 .. 8
 * (s0 + W) - 1, for all G heads at once: each V vector is widened once, not once per head (walking the rows once
 * per head, as the float32 cache does, took 2.6-2.8 ms more a step from DRAM, about 12%, session 44) */
static inline __attribute__((always_inline)) void CAT(block_v_slice_avx2_, KV_SUFFIX)(
    const KV_T *vb, int64_t pos_stride, int64_t n_block, const float *probs, int64_t ctx16, const int G,
    const int C, const int W, int s0, float *acc) {
    const int64_t D = 8 * C;
    __m256 a[8][4];
    for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) a[g][w] = _mm256_loadu_ps(acc + g * D + 8 * (s0 + w));
    for (int64_t j = 0; j < n_block; ++j) {
        __m256 vv[4];
        for (int w = 0; w < W; ++w) {
            vv[w] = CAT(kv_load8_, KV_SUFFIX)(vb + j * pos_stride + 8 * (s0 + w));
            /* held in a register: else gcc folds the load into each query head's FMA (G loads of it, and the
             * loop bound by loads): 6% less time a float32 step from DRAM on Zen 3 (session 42) */
            __asm__("" : "+x"(vv[w]));
        }
        for (int g = 0; g < G; ++g) {
            const __m256 pj = _mm256_broadcast_ss(probs + g * ctx16 + j);
            for (int w = 0; w < W; ++w) a[g][w] = _mm256_fmadd_ps(pj, vv[w], a[g][w]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + g * D + 8 * (s0 + w), a[g][w]);
}

#else
/* 3. out[g] += probs[g] . V over one block's n_block rows of a KV head, for each query head g in turn and dims 64 at
 * a time (8 accumulators, one broadcast weight, V as the FMAs' memory operand): each head's walk reads the block's
 * rows front to back, the first from L2, the others from L1. Walking the rows once per slice of dims for all G heads
 * at once (fewer loads per FMA) read each row's lines with a stride and ran slower from memory: 64 rows x 30 layers
 * at contexts 110-290, float32, Zen 3: 31.7-33.7 against 30.7-32.2 ms a step (DRAM), 18.9-21.1 against 17.6-20.4 (L3),
 * the same in L2; with scattered blocks 35.9-36.6 against 34.4-35.2 (session 44). Each accumulator sums the rows in
 * the same order either way: the same bits. */
static inline __attribute__((always_inline)) void CAT(block_v_heads_avx2_, KV_SUFFIX)(
    const KV_T *vb, int64_t pos_stride, int64_t n_block, const float *probs, int64_t ctx16, const int G,
    const int C, float *acc) {
    const int64_t D = 8 * C;
    for (int g = 0; g < G; ++g)
        for (int s0 = 0; s0 < C; s0 += 8) {
            float *o = acc + g * D + 8 * s0;
            __m256 a[8];
            for (int w = 0; w < 8; ++w) a[w] = _mm256_loadu_ps(o + 8 * w);
            for (int64_t j = 0; j < n_block; ++j) {
                const __m256 pj = _mm256_broadcast_ss(probs + g * ctx16 + j);
                const KV_T *v = vb + j * pos_stride + 8 * s0;
                for (int w = 0; w < 8; ++w) a[w] = _mm256_fmadd_ps(pj, CAT(kv_load8_, KV_SUFFIX)(v + 8 * w), a[w]);
            }
            for (int w = 0; w < 8; ++w) _mm256_storeu_ps(o + 8 * w, a[w]);
        }
}

#endif

/* One decode row, KV heads [kh0, kh1), G query heads per KV head and head_dim = 8 C (compile-time constants at
 * each call). q, out: the row's [H, D] float32; scores: [(kh1 - kh0) G, ctx rounded up to 16];
 * (kh1 - kh0) G <= DECODE_MAX_HEADS. */
static inline __attribute__((always_inline)) void CAT(decode_row_avx2_, KV_SUFFIX)(
    const ITEM *it, const int G, const int C, int64_t head_stride, int64_t kh0, int64_t kh1, const float *q,
    float *out, float *scores) {
    const int64_t ctx = it->ctx, bs = it->block_size, D = 8 * C, pos_stride = it->pos_stride;
    const int64_t ctx16 = (ctx + 15) / 16 * 16, num_kv = kh1 - kh0, row_blocks = (ctx + bs - 1) / bs;
#if KV_IS_BF16
    /* G x W accumulators + W vectors of V + a broadcast weight within 16 registers */
    const int W = G <= 2 ? 4 : G <= 6 ? 2 : 1;
#endif
    __m256 row_max[DECODE_MAX_HEADS];
    for (int64_t r = 0; r < num_kv * G; ++r) row_max[r] = _mm256_set1_ps(-FLT_MAX);
    CAT(decode_scores_avx2_, KV_SUFFIX)(it, G, C, head_stride, kh0, kh1, q, scores, row_max);
    float inv_sum[DECODE_MAX_HEADS];
    attn_softmax_rows_avx2(scores, num_kv * G, ctx, row_max, inv_sum);
    memset(out + kh0 * G * D, 0, sizeof(float) * num_kv * G * D);
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t block_offset = it->blocks[start / bs] * it->block_stride;
        const int64_t n_block = ctx - start < bs ? ctx - start : bs;
        for (int64_t kh = kh0; kh < kh1; ++kh) {
            if (start / bs + 1 < row_blocks) PREFETCH_ROWS(it->v_cache, start / bs + 1, kh);
            const KV_T *vb = it->v_cache + block_offset + kh * head_stride;
            const float *probs = scores + (kh - kh0) * G * ctx16 + start;
#if KV_IS_BF16
            for (int s0 = 0; s0 < C; s0 += W)
                CAT(block_v_slice_avx2_, KV_SUFFIX)(vb, pos_stride, n_block, probs, ctx16, G, C, W, s0,
                                                    out + kh * G * D);
#else
            CAT(block_v_heads_avx2_, KV_SUFFIX)(vb, pos_stride, n_block, probs, ctx16, G, C, out + kh * G * D);
#endif
        }
    }
    for (int64_t r = 0; r < num_kv * G; ++r) {
        const __m256 inv = _mm256_set1_ps(inv_sum[r]);
        float *o = out + (kh0 * G + r) * D;
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * c), inv));
    }
}

#define DEFINE_DECODE_AVX2(G, C)                                                                             \
    static void CAT(decode_avx2_g##G##_c##C##_, KV_SUFFIX)(const ITEM *it, int64_t head_stride, int64_t kh0,  \
                                                           int64_t kh1, const float *q, float *out,            \
                                                           float *scores) {                                    \
        CAT(decode_row_avx2_, KV_SUFFIX)(it, G, C, head_stride, kh0, kh1, q, out, scores);                    \
    }
/* GQA groups 1-8 at head_dim 64 (C 8) and 128 (C 16) */
DEFINE_DECODE_AVX2(1, 8)
DEFINE_DECODE_AVX2(2, 8)
DEFINE_DECODE_AVX2(3, 8)
DEFINE_DECODE_AVX2(4, 8)
DEFINE_DECODE_AVX2(5, 8)
DEFINE_DECODE_AVX2(6, 8)
DEFINE_DECODE_AVX2(7, 8)
DEFINE_DECODE_AVX2(8, 8)
DEFINE_DECODE_AVX2(1, 16)
DEFINE_DECODE_AVX2(2, 16)
DEFINE_DECODE_AVX2(3, 16)
DEFINE_DECODE_AVX2(4, 16)
DEFINE_DECODE_AVX2(5, 16)
DEFINE_DECODE_AVX2(6, 16)
DEFINE_DECODE_AVX2(7, 16)
DEFINE_DECODE_AVX2(8, 16)
#undef DEFINE_DECODE_AVX2
