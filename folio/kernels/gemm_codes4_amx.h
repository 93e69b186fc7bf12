/* The float32 GEMM over 4-bit codes on AMX (the amx tier, cpu_amx_float32): float32 accuracy from the bfloat16
 * tile unit. Included by gemm_codes4.h, whose layout and scratch it reads.
 *
 * Why: at W1's decode steps (M = 64) the float32 FMA tiles run at the cores' peak (about 125 GFLOP/s a core here),
 * and the projections are most of the step. A tdpbf16ps multiplies bfloat16 pairs exactly and sums in float32 at
 * 8-16x the FMA rate. The codes q (0..15) are exact in bfloat16; x is split into three bfloat16 parts whose sum is
 * x exactly (x_hi = bf16(x), x_mid = bf16(x - x_hi), x_lo = x - x_hi - x_mid: 8 + 8 + 8 significant bits). So
 *   y[r][c] = sum over groups g of d[g][c] * S[r][g][c] + m[g][c] * X[r][g],
 *   S = sum over the group's 32 k of (x_hi + x_mid + x_lo) q   (three tdpbf16ps: every product exact)
 *   X = the group's sum of x                                       (float32)
 * Every product is exact and every sum float32, as in the float32 layout, but in another order: the result is
 * within float32 rounding of it, not the same bits (which is why it is an engine argument, default on).
 * Non-finite x give NaN where the float32 layout may give +-inf (0 * inf inside the tile).
 *
 * Per 16-row tile and 16-column tile of a block: per group, tiles 0-2 = the three parts of x (16 rows x 32 k, one
 * contiguous KB each), tile 3 = the group's codes as bfloat16 pairs (widened once per block into L2), and the sums
 * S alternate between tiles 4 and 5, so one group's S is read back and scaled by d (vector FMAs, accumulators in
 * registers) while the next group's tdpbf16ps run. */
#if GEMM_AMX
#define CODES4_AMX_PART 512 /* bfloat16 of one part of x in a row tile's group: 16 rows x 32 k */
/* side lines (the fused decoder's next K/V, SidePrefetch) per group and column tile. One fetches about a tenth of
 * W1's next-layer K/V; eight (the float32 tiles' rate per FLOP) fetched all of it; W1 ran as fast with one, with
 * eight and with no side prefetch at all (benchmarks/ab_offline.py, docs/performance.md, session 36). */
#define CODES4_AMX_SIDE_LINES 1

/* Each thread's split of x (its chunk's row tiles: [tile][group][part][16][32] bfloat16, then the group sums
 * [tile][group][16] float32) and its block of codes widened to bfloat16 pairs ([k / 2][BLOCK_N][2]). */
static _Thread_local ThreadScratch codes4_amx_scratch;

static inline __m512 codes4_amx_widen16(__m256bh v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

/* x's rows [rows, k] (lda apart) -> the row tiles' three parts and group sums (layout above). Each step is exact:
 * x - bf16(x) and the next remainder are representable, so barriers keep -ffast-math from reassociating them. */
static void codes4_amx_split(const float *x, int64_t lda, int64_t rows, int64_t k, uint16_t *parts, float *sums) {
    const int64_t groups = k / CODES4_GROUP;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t tile_group = (r / AMX_TILE_M) * groups + g;
            uint16_t *dst = parts + tile_group * 3 * CODES4_AMX_PART + (r % AMX_TILE_M) * CODES4_GROUP;
            __m512 sum = _mm512_setzero_ps();
            for (int h = 0; h < 2; ++h) {
                const __m512 v = _mm512_loadu_ps(x + r * lda + g * CODES4_GROUP + 16 * h);
                sum = _mm512_add_ps(sum, v);
                const __m256bh hi = _mm512_cvtneps_pbh(v);
                __m512 rest = _mm512_sub_ps(v, codes4_amx_widen16(hi));
                __asm__("" : "+v"(rest));
                const __m256bh mid = _mm512_cvtneps_pbh(rest);
                __m512 last = _mm512_sub_ps(rest, codes4_amx_widen16(mid));
                __asm__("" : "+v"(last));
                _mm256_storeu_si256((__m256i *)(dst + 16 * h), (__m256i)hi);
                _mm256_storeu_si256((__m256i *)(dst + CODES4_AMX_PART + 16 * h), (__m256i)mid);
                _mm256_storeu_si256((__m256i *)(dst + 2 * CODES4_AMX_PART + 16 * h), (__m256i)_mm512_cvtneps_pbh(last));
            }
            sums[tile_group * AMX_TILE_M + r % AMX_TILE_M] = _mm512_reduce_add_ps(sum);
        }
}

/* A block's codes -> bfloat16 pairs, tdpbf16ps's B layout: pair p of group g, column c at [(16 g + p) BLOCK_N + c].
 * A code byte b (k even in its low nibble, k odd in its high) becomes the dword b | b << 12: its low word holds the
 * even k's code in bits 0-3, its high word the odd k's; vpermw reads the low 5 bits of each word, so a table of the
 * bfloat16 of 0..15, twice, turns both into their bfloat16 values at once. */
static void codes4_amx_widen_block(const uint8_t *src, int64_t k, uint16_t *dst) {
    const __m512i table = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0,
                                           0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0, 0x4170, 0x4160, 0x4150,
                                           0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080,
                                           0x4040, 0x4000, 0x3f80, 0);
    for (int64_t g = 0; g < k / CODES4_GROUP; ++g, src += CODES4_GROUP_BYTES) {
        const uint8_t *codes = src + 2 * BLOCK_N * sizeof(float);
        for (int p = 0; p < CODES4_GROUP / 2; ++p, dst += 2 * BLOCK_N)
            for (int j = 0; j < 3; ++j) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + p * BLOCK_N + 16 * j)));
                const __m512i index = _mm512_or_si512(b, _mm512_slli_epi32(b, 12));
                _mm512_storeu_si512(dst + 32 * j, _mm512_permutexvar_epi16(index, table));
            }
    }
}

/* One group's S (tile 4 or 5) on tdpbf16ps: zeroed, then the three parts of x times the codes (tile 3). */
#define CODES4_AMX_GROUP(C)                                                                                       \
    _tile_zero(C);                                                                                                \
    _tile_dpbf16ps(C, 0, 3);                                                                                      \
    _tile_dpbf16ps(C, 1, 3);                                                                                      \
    _tile_dpbf16ps(C, 2, 3);

/* rows (<= 16) x the block's 48 columns, over K. parts / sums: this row tile's split; block: the codes (for d and
 * m); wide: the block widened. One column tile at a time, so that its 16 float32 accumulators stay in registers:
 * per group the codes' tile and x's three parts load, three tdpbf16ps sum into S (tiles 4 and 5 in turn), and the
 * previous group's S is stored and scaled into the accumulators. (x's parts loaded once per group for all three
 * column tiles, the accumulators then in L1, ran 5-10% slower here: benchmarks/cpu_gemm.py, docs/performance.md.) */
static void tile_codes4_amx(const uint16_t *parts, const float *sums, const uint8_t *block, const uint16_t *wide,
                            int64_t k, int64_t rows, const Epilogue *e, int64_t row0, int64_t col0, SidePrefetch *sp) {
    amx_configure_tiles(AMX_TILE_M + 1 + rows, rows, 0x8u, 6); /* A: 0-2, B: 3, S: 4-5 */
    AMX_MEMORY_BARRIER();
    const int64_t groups = k / CODES4_GROUP;
    float s[2][AMX_TILE_M * 16] __attribute__((aligned(64)));
    for (int j = 0; j < 3; ++j) {
        __m512 acc[AMX_TILE_M];
        _Pragma("GCC unroll 16") for (int r = 0; r < AMX_TILE_M; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g <= groups; ++g) {
            if (g < groups) {
                const uint16_t *a = parts + g * 3 * CODES4_AMX_PART;
                _tile_loadd(3, wide + (g * (CODES4_GROUP / 2) * BLOCK_N + 16 * j) * 2, BLOCK_N * 4);
                _tile_loadd(0, a, 64);
                _tile_loadd(1, a + CODES4_AMX_PART, 64);
                _tile_loadd(2, a + 2 * CODES4_AMX_PART, 64);
                if (g & 1) {
                    CODES4_AMX_GROUP(5)
                } else {
                    CODES4_AMX_GROUP(4)
                }
                for (int line = 0; line < CODES4_AMX_SIDE_LINES && sp != NULL && sp->index < sp->count; ++line)
                    side_prefetch_step(sp);
            }
            if (g > 0) { /* the previous group's S, scaled by its d, and its m times x's group sums */
                const int64_t h = g - 1;
                float *sh = s[h & 1];
                if (h & 1)
                    _tile_stored(5, sh, 64);
                else
                    _tile_stored(4, sh, 64);
                AMX_MEMORY_BARRIER();
                const float *d = (const float *)(block + h * CODES4_GROUP_BYTES) + 16 * j;
                const __m512 dv = _mm512_loadu_ps(d), mv = _mm512_loadu_ps(d + BLOCK_N);
                _Pragma("GCC unroll 16") for (int r = 0; r < AMX_TILE_M; ++r) {
                    if (r < rows) {
                        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(sh + 16 * r), dv, acc[r]);
                        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[h * AMX_TILE_M + r]), mv, acc[r]);
                    }
                }
            }
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < AMX_TILE_M; ++r) { /* constant indices: acc stays in registers */
            if (r < rows) store16(e, row0 + r, col0 + 16 * j, acc[r]);
        }
    }
}

/* gemm_body_codes4 on AMX, for more rows than one vector tile: each thread splits the x rows of each chunk it
 * works on (once: items are chunk-major) and widens each block it takes, then runs the block's row tiles. */
static void gemm_body_codes4_amx(const float *x, int64_t lda, const uint8_t *packed, const float *bias, void *out,
                                 int out_is_bf16, int64_t ldc, int64_t m, int64_t n, int64_t k, SidePrefetch *side) {
    const Epilogue e = {out, out_is_bf16, ldc, bias, n, NULL, NULL, NULL};
    /* chunks of at most ~1 MiB of split x (half the L2): at K = 1536, 256 rows (2.4 MB) ran the down projection
     * at 215-224 GFLOP/s, 112-128 rows at 269-325 (M = 256 and 2048) */
    int64_t most_rows = (1 << 20) / (k * 3 * (int64_t)sizeof(uint16_t)) / AMX_TILE_M * AMX_TILE_M;
    most_rows = most_rows < 64 ? 64 : most_rows > CHUNK_M ? CHUNK_M : most_rows;
    const int64_t blocks = num_blocks(n), chunks = (m + most_rows - 1) / most_rows, groups = k / CODES4_GROUP;
    const int64_t chunk_rows = ((m + chunks - 1) / chunks + AMX_TILE_M - 1) / AMX_TILE_M * AMX_TILE_M;
    const int64_t chunk_tiles = chunk_rows / AMX_TILE_M, block_bytes = codes4_block_bytes(k);
    const int64_t parts_bytes = chunk_tiles * groups * 3 * CODES4_AMX_PART * (int64_t)sizeof(uint16_t);
    const int64_t sums_bytes = chunk_tiles * groups * AMX_TILE_M * (int64_t)sizeof(float);
    const int64_t wide_bytes = k * BLOCK_N * (int64_t)sizeof(uint16_t);
    uint8_t *scratch = thread_scratch(&codes4_amx_scratch, parts_bytes + sums_bytes + wide_bytes);
    if (scratch == NULL) abort(); /* a few MB per thread, once */
    uint16_t *parts = (uint16_t *)scratch, *wide = (uint16_t *)(scratch + parts_bytes + sums_bytes);
    float *sums = (float *)(scratch + parts_bytes);
    int64_t split_chunk = -1;
    AMX_FORGET();
#pragma omp for schedule(static)
    for (int64_t item = 0; item < blocks * chunks; ++item) {
        const int64_t b = item % blocks, chunk = item / blocks;
        const int64_t row_start = chunk * chunk_rows;
        const int64_t row_end = row_start + chunk_rows < m ? row_start + chunk_rows : m;
        if (row_end <= row_start) continue;
        if (chunk != split_chunk) {
            codes4_amx_split(x + row_start * lda, lda, row_end - row_start, k, parts, sums);
            split_chunk = chunk;
        }
        codes4_amx_widen_block(packed + b * block_bytes, k, wide);
        for (int64_t row = row_start; row < row_end; row += AMX_TILE_M) {
            const int64_t t = (row - row_start) / AMX_TILE_M;
            const int64_t rows = row_end - row < AMX_TILE_M ? row_end - row : AMX_TILE_M;
            tile_codes4_amx(parts + t * groups * 3 * CODES4_AMX_PART, sums + t * groups * AMX_TILE_M,
                            packed + b * block_bytes, wide, k, rows, &e, row, b * BLOCK_N, side);
        }
    }
}
#endif /* GEMM_AMX */
