/* A float32 greedy LM head at bfloat16 speed, with the float32 answer: screen in bfloat16, rescore the few
 * columns that could win in float32 (included by cpu_gemm.c after its tiles).
 *
 * Why: a float32 greedy decode step spends about 9% of its time in the LM head (49152 x 576 for SmolLM2), a
 * compute-bound GEMM at M = 64. vdpbf16ps does twice the float32 FMA's work per instruction, but bfloat16 logits
 * alone could pick another token than the float32 engine. So:
 *  1. screen: S = bf16(x) . bf16(w_v) for every column v (vdpbf16ps, float32 sums), and a rigorous bound
 *     |L_v - S_v| <= b_v on its distance from L_v, the float32 tiles' own value for that column;
 *  2. T = max_v (S_v - b_v): every column with S_v + b_v < T has L_v < T <= L_w <= max L for the w that set T,
 *     so the float32 arg-max (and every column tied with it) lies among the candidates S_v + b_v >= T;
 *  3. rescore: each candidate's whole 48-column block through the float32 tile (the same code and so the same
 *     float32 values as folio_gemm_argmax_f32), and the same arg-max merge: the identical token, ties included.
 * On SmolLM2 W1 a row keeps about 9 candidates (at most 96) of 49152 (docs/performance.md, session 13);
 * benchmarks/lm_head_argmax.py times it against the other arg-max paths.
 *
 * The bound, with u = 2^-24 (float32), h = 2^-8 (bfloat16 rounding to nearest), K terms, A = sum |x_k w_k|:
 *   the float32 FMA chain is within K u / (1 - K u) A of the exact dot product; the bfloat16 products are exact
 *   and their sums (2 roundings per pair) within the same of their exact sum; rounding x and w to bfloat16
 *   moves each product by at most (2h + h^2) |x_k w_k|. So |L - S| <= c A with c = g (1 + (1 + h)^2) + 2h + h^2,
 *   g = K u / (1 - K u), and A <= ||x|| ||w_v|| (Cauchy-Schwarz). vdpbf16ps flushes subnormals (inputs and
 *   results) to zero: each flush moves a term by < 2^-126 (1 + max|w| + max|x|), added per row as `slack`.
 *   The bound is enlarged by 0.1% for the float32 rounding of b and S +- b, far below it: |S| <= (1 + c) A.
 * Rows with a non-finite or huge norm, and candidate lists that overflow, take the exact path instead. */

/* where a screen runs: AVX2 (int16), AVX512-BF16 (bfloat16), AVX512-VNNI without AMX (int8) */
#if GEMM_VEC_BITS == 256 || (GEMM_VEC_BITS == 512 && (defined(__AVX512BF16__) || defined(__AVX512VNNI__)))
/* A screen's rescore (both screens'): each (block, row) pair's float32 tile over packed_f32's block or, where
 * packed_f32 is NULL, over codes8's block widened into the thread's float32 block (once per run of a block's
 * pairs: the pairs are block-major); then each row's arg-max into out_ids. The float32 tiles' values, so the
 * float32 arg-max's token. */
static void screen_rescore(const float *x, int64_t lda, const float *packed_f32, const uint8_t *codes8,
                           const ScreenBuffers *buf, int64_t npairs, int64_t m, int64_t n, int64_t k, int num_threads,
                           int64_t *out_ids) {
    argmax_reset(buf->best_val, buf->best_col, num_threads * m * 16);
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t tid = omp_get_thread_num();
        const Epilogue e = {NULL, 0, 0, NULL, n, buf->best_val + tid * m * 16, buf->best_col + tid * m * 16, NULL};
        const NextBlock none = {NULL, NULL, 0};
        float *wide = NULL;
        if (packed_f32 == NULL && (wide = thread_scratch(&codes4_scratch, k * BLOCK_N * (int64_t)sizeof(float))) == NULL)
            abort(); /* a few hundred KB per thread, once */
        int64_t widened_block = -1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < npairs; ++i) {
            const int64_t b = buf->pairs[i] / m, r = buf->pairs[i] % m;
            const float *block = wide;
            if (packed_f32 != NULL) {
                block = packed_f32 + b * k * BLOCK_N;
            } else if (b != widened_block) {
                codes8_widen_block(codes8 + b * (k / CODES4_GROUP) * CODES8_GROUP_BYTES, k, wide);
                widened_block = b;
            }
            tile_f32(x + r * lda, lda, block, k, 1, &e, r, b * BLOCK_N, none, NULL);
        }
    }
    argmax_merge(buf->best_val, buf->best_col, num_threads, m, out_ids);
}
#endif

/* out_ids as folio_gemm_argmax_f32(x, lda, packed_f32, ...), computed by screening with packed_bf16 (the same
 * weight packed for bfloat16, K even) and rescoring in float32. w_norm[v] >= ||w_v||_2 and w_abs_max >= max |w|.
 * Returns 0 when screened, 1 when it took the exact path (non-finite or huge inputs, too many candidates),
 * -1 when neither could run (m > CHUNK_M, no memory), -2 in a library without vdpbf16ps. */
int folio_gemm_argmax_screened_f32(const float *x, int64_t lda, const float *packed_f32, const uint16_t *packed_bf16,
                                   const float *w_norm, float w_abs_max, int64_t m, int64_t n, int64_t k,
                                   int64_t *out_ids, int num_threads) {
#if GEMM_VEC_BITS == 512 && defined(__AVX512BF16__)
    if (m > CHUNK_M || (k & 1)) return -1;
    const int64_t nblocks = num_blocks(n), threads = num_threads;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)m * (size_t)k);
    ScreenBuffers buf;
    if (xb == NULL || screen_buffers_alloc(&buf, threads, m, nblocks) != 0) {
        free(xb);
        return -1;
    }
    int status = -1;
    float *row_scale = buf.row_scale, *row_slack = buf.row_slack;
    /* the bound's factor c (see the top of this file), enlarged 0.1%; norms in double, then rounded up */
    const double u = 0x1p-24, h = 0x1p-8, g = (double)k * u / (1.0 - (double)k * u);
    const double c = (g * (1.0 + (1.0 + h) * (1.0 + h)) + 2.0 * h + h * h) * 1.001;
    int sane = screen_sane(w_abs_max);
    for (int64_t r = 0; r < m; ++r) {
        double sq = 0.0, amax = 0.0;
        for (int64_t kk = 0; kk < k; ++kk) {
            const double v = x[r * lda + kk];
            sq += v * v;
            amax = fabs(v) > amax ? fabs(v) : amax;
            xb[r * k + kk] = f32_to_bf16(x[r * lda + kk]);
        }
        const double norm = sqrt(sq) * (1.0 + 1e-6);
        sane &= screen_sane(norm) & screen_sane(amax);
        row_scale[r] = (float)(c * norm * (1.0 + 1e-6));
        row_slack[r] = (float)((double)k * 0x1p-124 * (1.0 + (double)w_abs_max + amax));
    }
    int overflow = !sane;
    if (sane) {
#pragma omp parallel num_threads(num_threads) reduction(| : overflow)
        {
            ScreenState state = screen_state(&buf, w_norm, omp_get_thread_num(), m);
            const Epilogue e = {NULL, 0, 0, NULL, n, NULL, NULL, &state};
            const int64_t block_elems = k * BLOCK_N, ntiles = (m + BF16_TILE_M - 1) / BF16_TILE_M;
            AMX_FORGET();
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nblocks; ++b) {
                const uint16_t *next = b + 1 < nblocks ? packed_bf16 + (b + 1) * block_elems : NULL;
                for (int64_t t = 0; t < ntiles; ++t) {
                    const int64_t row = t * BF16_TILE_M, rows = m - row < BF16_TILE_M ? m - row : BF16_TILE_M;
                    const NextBlock nb = next_block_share(next, block_elems * (int64_t)sizeof(uint16_t), t, ntiles);
                    tile_bf16(xb + row * k, k, packed_bf16 + b * block_elems, k, rows, &e, row, b * BLOCK_N, nb, NULL);
                }
            }
            overflow |= state.overflow;
        }
    }
    if (overflow) {
        status = folio_gemm_argmax_f32(x, lda, packed_f32, m, n, k, out_ids, num_threads) == 0 ? 1 : -1;
        goto done;
    }
    /* the blocks holding a candidate of each row: S + b at or above the row's threshold over all threads */
    screen_rescore(x, lda, packed_f32, NULL, &buf, screen_pairs(&buf, threads, m, nblocks, BLOCK_N), m, n, k,
                   num_threads, out_ids);
    status = 0;
done:
    free(xb);
    screen_buffers_free(&buf);
    return status;
#else
    (void)x, (void)lda, (void)packed_f32, (void)packed_bf16, (void)w_norm, (void)w_abs_max, (void)m, (void)n, (void)k;
    (void)out_ids, (void)num_threads;
    return -2;
#endif
}
