/* The GEMM driver for one element type, included once per type by cpu_gemm.c with
 *   ELEM_T     the element type of x and the packed weight      SUFFIX  the name suffix (f32, bf16)
 *   LOAD       element -> float                                 PACKED_K(k)  packed length of K
 *   PACKED_AT  (k, c) -> offset of W[block col c][k] inside a packed block
 *   HAS_TILES  1 where the vector tiles tile_<SUFFIX>_<1..TILE_M> exist (AVX-512 or AVX2 + FMA)
 *   TILE_ROWS  rows per tile (TILE_M, or AMX_TILE_M where USE_AMX)
 *   USE_AMX    1 where the AMX tile (tile_bf16_amx, up to AMX_TILE_M rows) runs instead of the vector tiles */

#if !HAS_TILES
/* A tile without vectors (the generic tier): the same maths in plain C (exact products, float32 sums in k order). */
static void CAT(tile_scalar_, SUFFIX)(const ELEM_T *x, int64_t lda, const ELEM_T *wb, int64_t k, int64_t rows,
                                      const Epilogue *e, int64_t row0, int64_t col0) {
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t c = 0; c < BLOCK_N && col0 + c < e->n; ++c) {
            float acc = 0.0f;
            for (int64_t kk = 0; kk < k; ++kk) acc += LOAD(x[i * lda + kk]) * LOAD(wb[PACKED_AT(kk, c)]);
            store_scalar(e, row0 + i, col0 + c, acc);
        }
}
#endif

static void CAT(tile_, SUFFIX)(const ELEM_T *x, int64_t lda, const ELEM_T *wb, int64_t k, int64_t rows,
                               const Epilogue *e, int64_t row0, int64_t col0, NextBlock nb, SidePrefetch *side) {
#if USE_AMX
    CAT(CAT(tile_, SUFFIX), _amx)(x, lda, wb, k, rows, e, row0, col0, nb, side);
#elif HAS_TILES
#define TILE_CASE(MR)                                                                                             \
    case MR: CAT(CAT(CAT(tile_, SUFFIX), _), MR)(x, lda, wb, k, e, row0, col0, nb, side); return;
    switch (rows) {
        FOR_EACH_TILE_ROWS(TILE_CASE)
    default: return;
    }
#undef TILE_CASE
#else
    (void)nb;
    (void)side;
    CAT(tile_scalar_, SUFFIX)(x, lda, wb, k, rows, e, row0, col0);
#endif
}

/* out[M, N] = x[M, K] @ W^T (+ bias), W given packed (folio_gemm_pack_*). x rows are lda elements apart, out rows
 * ldc; out is float32, or bfloat16 when out_is_bf16 (rounded to nearest even once, from the float32 sum).
 * The body is an orphaned `omp for` (see cpu_ops_impl.h); folio_gemm_* opens a region of its own. */
static void CAT(gemm_body_, SUFFIX)(const ELEM_T *x, int64_t lda, const ELEM_T *packed, const float *bias, void *out,
                                    int out_is_bf16, int64_t ldc, int64_t m, int64_t n, int64_t k,
                                    SidePrefetch *side) {
    const Epilogue e = {out, out_is_bf16, ldc, bias, n, NULL, NULL, NULL};
    const int64_t blocks = num_blocks(n), chunks = (m + CHUNK_M - 1) / CHUNK_M;
    /* chunks of equal size (in whole tiles): with a short last chunk the static split below left one thread idle
     * for most of a prefill of a few hundred rows (M = 406, float32: 353-387 GFLOP/s against 458-496 at 2048) */
    const int64_t chunk_rows = ((m + chunks - 1) / chunks + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    const int64_t block_elems = PACKED_K(k) * BLOCK_N;
    AMX_FORGET();
    /* item = chunk * blocks + block: a thread's consecutive items share a chunk of x rows, which stays in L2 while
     * the blocks' weights stream past (from L3 for a prefill chunk's layer, which fits it). Block-major order
     * kept a block's weights instead and re-read all of x per block: at M = 2048 gate|up ran at 937 GFLOP/s
     * against 1042 now (benchmarks/cpu_gemm.py). With M <= 256 (one chunk: decodes) both orders are the same. */
    GEMM_ITEMS
    for (int64_t item = 0; item < blocks * chunks; ++item) {
        const int64_t b = item % blocks, chunk = item / blocks;
        const ELEM_T *wb = packed + b * block_elems;
        const ELEM_T *next = item + 1 < blocks * chunks ? packed + ((item + 1) % blocks) * block_elems : NULL;
        const int64_t row_start = chunk * chunk_rows;
        const int64_t row_end = row_start + chunk_rows < m ? row_start + chunk_rows : m;
        const int64_t ntiles = row_end > row_start ? (row_end - row_start + TILE_ROWS - 1) / TILE_ROWS : 0;
        for (int64_t t = 0; t < ntiles; ++t) {
            const int64_t row = row_start + t * TILE_ROWS;
            const int64_t rows = row_end - row < TILE_ROWS ? row_end - row : TILE_ROWS;
            const NextBlock nb = next_block_share(next, block_elems * (int64_t)sizeof(ELEM_T), t, ntiles);
            CAT(tile_, SUFFIX)(x + row * lda, lda, wb, k, rows, &e, row, b * BLOCK_N, nb, side);
        }
    }
}

void CAT(folio_gemm_, SUFFIX)(const ELEM_T *x, int64_t lda, const ELEM_T *packed, const float *bias, void *out,
                              int out_is_bf16, int64_t ldc, int64_t m, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_blocks(n) * ((m + CHUNK_M - 1) / CHUNK_M) > 1)
    CAT(gemm_body_, SUFFIX)(x, lda, packed, bias, out, out_is_bf16, ldc, m, n, k, NULL);
}

/* out_ids[r] = the column of the largest entry of row r of x @ W^T (the first such column, as torch.argmax), for
 * m <= CHUNK_M rows, without writing the [M, N] product: a greedy step's LM head (the sampler would only read the
 * logits back for their arg-max). NaN entries are never chosen. Returns 0, or -1 if it could not allocate. */
int CAT(folio_gemm_argmax_, SUFFIX)(const ELEM_T *x, int64_t lda, const ELEM_T *packed, int64_t m, int64_t n,
                                    int64_t k, int64_t *out_ids, int num_threads) {
    float *best_val;
    int32_t *best_col;
    if (m > CHUNK_M || argmax_start(num_threads, m, &best_val, &best_col) != 0) return -1;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t tid = omp_get_thread_num();
        const Epilogue e = {NULL, 0, 0, NULL, n, best_val + tid * m * 16, best_col + tid * m * 16, NULL};
        const int64_t block_elems = PACKED_K(k) * BLOCK_N;
        const int64_t ntiles = (m + TILE_ROWS - 1) / TILE_ROWS;
        AMX_FORGET();
        GEMM_ITEMS
        for (int64_t b = 0; b < num_blocks(n); ++b) {
            const ELEM_T *next = b + 1 < num_blocks(n) ? packed + (b + 1) * block_elems : NULL;
            for (int64_t t = 0; t < ntiles; ++t) {
                const int64_t row = t * TILE_ROWS, rows = m - row < TILE_ROWS ? m - row : TILE_ROWS;
                const NextBlock nb = next_block_share(next, block_elems * (int64_t)sizeof(ELEM_T), t, ntiles);
                CAT(tile_, SUFFIX)(x + row * lda, lda, packed + b * block_elems, k, rows, &e, row, b * BLOCK_N, nb, NULL);
            }
        }
    }
    argmax_finish(best_val, best_col, num_threads, m, out_ids);
    return 0;
}
