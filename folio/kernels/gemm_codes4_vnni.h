/* The float32 GEMM over 4-bit codes through AVX512-VNNI's vpdpbusd (builds with VNNI and AVX512-BF16 and without
 * AMX: the native avx512_bf16 tier of Zen 4 / 5; cpu_vnni_float32): float32 accuracy from the integer dot-product
 * unit. Included by gemm_codes4.h, whose layout and scratch it reads. Measured on Zen 5 only: Intel's parts with
 * VNNI and without BF16 (Cascade Lake, Ice Lake; the avx512 tier) keep the FMA tiles until a session measures their
 * vpdpbusd against their FMA (benchmarks/dot_instruction_rates.py).
 *
 * Why: on Zen 5 vpdpbusd runs at the float32 FMA's instruction rate with four times its multiply-adds, and the
 * integer ops and conversions around it issue on other pipes (benchmarks/dot_instruction_rates.py,
 * docs/performance.md, session 49). x, per row and group of 32 k, is a fixed point of 22 bits under a power-of-two
 * step s (|x / s| < 2^22, rounded to nearest) split into three balanced int8 limbs X = 65536 hi + 256 mid + lo
 * (hi in -64..64, mid and lo in -128..127); the codes q (0..15) are the unsigned operand. So
 *   y[r][c] = sum over groups g of d[g][c] s[r][g] Q[r][g][c] + m[g][c] X[r][g],
 *   Q = (hi . q << 16) + (mid . q << 8) + lo . q   (three exact int32 sums of 32 products; |Q| < 2^31)
 *   X = the group's float32 sum of x.
 * Per 16 columns and 32 k of a row: 24 vpdpbusd and 3 FMA-pipe ops (the float32 path: 32 FMAs). The error is x's
 * rounding to 22 bits below its group's largest power of two plus float32 sums: float32 accuracy, not the float32
 * layout's bits (an engine argument, default on). A NaN or inf in x makes its row NaN or inf (through X). Groups
 * whose largest |x| is below 2^-100 are rounded on the 2^-100 group's step, so the smallest inputs lose their
 * digits to an absolute error under 2^-122 a weight unit.
 *
 * Per block: each group's codes are widened once into [k / 4][BLOCK_N][4] bytes (four consecutive k of one column
 * in one dword: vpdpbusd's layout) in the thread's scratch; a tile is 2 rows x the block's 3 vectors of 16 columns,
 * its 18 int32 sums and 6 float32 accumulators in registers. The block's row tiles pull the next block's codes
 * toward L2 between them, as the FMA tiles do (W1's decode GEMMs 6-9% faster: docs/performance.md, session 49). */
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && GEMM_VEC_BITS == 512 && !GEMM_AMX
#define GEMM_VNNI 1
#define VNNI_TILE_M 2
#define VNNI_WIDE_GROUP (CODES4_GROUP / 4 * BLOCK_N * 4) /* bytes of one group widened */
/* side lines (the fused decoder's next K/V) per group and row tile: one let the attention find a fifth more of its
 * K/V in DRAM (W1: 1.49 -> 1.84 s); four kept it as with the float32 tiles (docs/performance.md, session 49) */
#define VNNI_SIDE_LINES 4

/* Each thread's split of its chunk's rows (limbs [row][group][3][32] int8, then the step and the sum of x per row
 * and group) and its block of codes widened. */
static _Thread_local ThreadScratch codes4_vnni_scratch;

/* Rows [0, rows) of x (lda apart) -> limbs, steps and sums; rows up to `padded` get zeros (a tile's missing row). */
static void codes4_vnni_split(const float *x, int64_t lda, int64_t rows, int64_t padded, int64_t k, int8_t *limbs,
                              float *step, float *sums) {
    const int64_t groups = k / CODES4_GROUP;
    const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
    for (int64_t r = 0; r < padded; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            int8_t *out = limbs + (r * groups + g) * 3 * CODES4_GROUP;
            if (r >= rows) {
                memset(out, 0, 3 * CODES4_GROUP);
                step[r * groups + g] = sums[r * groups + g] = 0.0f;
                continue;
            }
            const float *xg = x + r * lda + g * CODES4_GROUP;
            const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            int e = 128; /* inf, NaN (no comparison holds) and |x| >= 2^127: not finite or huge through the sum */
            if (amax < 0x1p-100f)
                e = -100;
            else if (amax < 0x1p127f)
                frexpf(amax, &e); /* 2^(e - 1) <= amax < 2^e, so |x / step| <= 2^22 after rounding */
            step[r * groups + g] = ldexpf(1.0f, e - 22);
            sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
            const __m512 inv = _mm512_set1_ps(ldexpf(1.0f, 22 - e));
            for (int h = 0; h < 2; ++h) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(h ? b : a, inv));
                const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128);
                const __m512i v1 = _mm512_srai_epi32(_mm512_sub_epi32(v, lo), 8);
                const __m512i mid = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v1, c128), c255), c128);
                const __m512i hi = _mm512_srai_epi32(_mm512_sub_epi32(v1, mid), 8);
                _mm_storeu_si128((__m128i *)(out + 16 * h), _mm512_cvtepi32_epi8(hi));
                _mm_storeu_si128((__m128i *)(out + CODES4_GROUP + 16 * h), _mm512_cvtepi32_epi8(mid));
                _mm_storeu_si128((__m128i *)(out + 2 * CODES4_GROUP + 16 * h), _mm512_cvtepi32_epi8(lo));
            }
        }
}

/* A block's code nibbles (pair p's byte: k = 2p low, 2p + 1 high) -> per group [k / 4][BLOCK_N][4] bytes. */
static void codes4_vnni_widen_block(const uint8_t *src, int64_t k, uint8_t *dst) {
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < k / CODES4_GROUP; ++g, src += CODES4_GROUP_BYTES) {
        const uint8_t *codes = src + 2 * BLOCK_N * sizeof(float);
        for (int kq = 0; kq < CODES4_GROUP / 4; ++kq)
            for (int j = 0; j < BLOCK_N / 16; ++j) {
                const __m512i even = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 2 * kq * BLOCK_N + 16 * j)));
                const __m512i odd = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + (2 * kq + 1) * BLOCK_N + 16 * j)));
                const __m512i first = _mm512_or_si512(_mm512_and_si512(even, low), _mm512_slli_epi32(_mm512_srli_epi32(even, 4), 8));
                const __m512i second = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(odd, low), 16),
                                                       _mm512_slli_epi32(_mm512_srli_epi32(odd, 4), 24));
                _mm512_store_si512(dst + g * VNNI_WIDE_GROUP + (kq * BLOCK_N + 16 * j) * 4, _mm512_or_si512(first, second));
            }
    }
}

/* rows (<= 2) x the block's 48 columns over K: per group, 8 steps of 4 k (3 code vectors, 2 rows x 3 limbs x 3
 * vectors of vpdpbusd), then each Q converted, times d, added on x's step, and m times the group's sum of x; and
 * the tile's share of the next block's lines (nb), spread over the groups.
 * noipa: one copy for every caller. gcc cloned it per call site, and in the clone for folio_gemm_codes4_vnni (no
 * side prefetch: sp NULL) it kept the 18 sums on the stack (146 stack operands against 33), which halved that entry
 * point's speed (SmolLM2's gate|up at M = 64: 548 -> 273-300 GFLOP/s on Zen 5; docs/performance.md, session 50). */
__attribute__((noipa)) static void tile_codes4_vnni(const int8_t *limbs, const float *step, const float *sums,
                                                    int64_t groups, const uint8_t *block, const uint8_t *wide,
                                                    int64_t rows, const Epilogue *e, int64_t row0, int64_t col0,
                                                    SidePrefetch *sp, NextBlock nb) {
    const int64_t per_group = nb.next != NULL ? ((nb.end - nb.next) / 64 + groups - 1) / groups : 0;
    __m512 acc[VNNI_TILE_M][3];
    for (int r = 0; r < VNNI_TILE_M; ++r)
        for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i s[VNNI_TILE_M][3][3];
        for (int r = 0; r < VNNI_TILE_M; ++r)
            for (int j = 0; j < 3; ++j)
                for (int l = 0; l < 3; ++l) s[r][j][l] = _mm512_setzero_si512();
        const uint8_t *wg = wide + g * VNNI_WIDE_GROUP;
        _Pragma("GCC unroll 8") for (int kq = 0; kq < CODES4_GROUP / 4; ++kq) {
            __m512i c[3];
            for (int j = 0; j < 3; ++j) c[j] = _mm512_load_si512(wg + (kq * BLOCK_N + 16 * j) * 4);
            _Pragma("GCC unroll 2") for (int r = 0; r < VNNI_TILE_M; ++r) {
                _Pragma("GCC unroll 3") for (int l = 0; l < 3; ++l) {
                    int32_t four;
                    memcpy(&four, limbs + ((r * groups + g) * 3 + l) * CODES4_GROUP + 4 * kq, sizeof four);
                    const __m512i xb = _mm512_set1_epi32(four);
                    for (int j = 0; j < 3; ++j) s[r][j][l] = _mm512_dpbusd_epi32(s[r][j][l], c[j], xb);
                }
            }
        }
        const float *d = (const float *)(block + g * CODES4_GROUP_BYTES);
        for (int j = 0; j < 3; ++j) {
            const __m512 dv = _mm512_loadu_ps(d + 16 * j), mv = _mm512_loadu_ps(d + BLOCK_N + 16 * j);
            for (int r = 0; r < VNNI_TILE_M; ++r) {
                const __m512i q = _mm512_add_epi32(_mm512_slli_epi32(s[r][j][0], 16),
                                                   _mm512_add_epi32(_mm512_slli_epi32(s[r][j][1], 8), s[r][j][2]));
                const __m512 dq = _mm512_mul_ps(_mm512_cvtepi32_ps(q), dv);
                acc[r][j] = _mm512_fmadd_ps(dq, _mm512_set1_ps(step[r * groups + g]), acc[r][j]);
                acc[r][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[r * groups + g]), acc[r][j]);
            }
        }
        for (int line = 0; line < VNNI_SIDE_LINES && sp != NULL && sp->index < sp->count; ++line)
            side_prefetch_step(sp);
        for (int64_t line = 0; line < per_group && nb.next < nb.end; ++line, nb.next += 64)
            __builtin_prefetch(nb.next, 0, 2);
    }
    for (int r = 0; r < VNNI_TILE_M; ++r)
        if (r < rows)
            for (int j = 0; j < 3; ++j) store16(e, row0 + r, col0 + 16 * j, acc[r][j]);
}

/* gemm_body_codes4 through vpdpbusd, for more rows than one vector tile: each thread splits the x rows of each
 * chunk it works on (once: items are chunk-major) and widens each block it takes, then runs the block's row tiles. */
static void gemm_body_codes4_vnni(const float *x, int64_t lda, const uint8_t *packed, const float *bias, void *out,
                                  int out_is_bf16, int64_t ldc, int64_t m, int64_t n, int64_t k, SidePrefetch *side) {
    const Epilogue e = {out, out_is_bf16, ldc, bias, n, NULL, NULL, NULL};
    const int64_t blocks = num_blocks(n), chunks = (m + CHUNK_M - 1) / CHUNK_M, groups = k / CODES4_GROUP;
    const int64_t chunk_rows = ((m + chunks - 1) / chunks + VNNI_TILE_M - 1) / VNNI_TILE_M * VNNI_TILE_M;
    const int64_t block_bytes = codes4_block_bytes(k);
    const int64_t limbs_bytes = chunk_rows * k * 3, scalars_bytes = chunk_rows * groups * (int64_t)sizeof(float);
    uint8_t *scratch = thread_scratch(&codes4_vnni_scratch, groups * VNNI_WIDE_GROUP + limbs_bytes + 2 * scalars_bytes);
    if (scratch == NULL) abort(); /* a few hundred KB per thread, once */
    uint8_t *wide = scratch; /* first: the scratch is 64-byte aligned, and so are the widened groups */
    int8_t *limbs = (int8_t *)(scratch + groups * VNNI_WIDE_GROUP);
    float *step = (float *)(scratch + groups * VNNI_WIDE_GROUP + limbs_bytes), *sums = step + chunk_rows * groups;
    int64_t split_chunk = -1;
    GEMM_ITEMS
    for (int64_t item = 0; item < blocks * chunks; ++item) {
        const int64_t b = item % blocks, chunk = item / blocks;
        const int64_t row_start = chunk * chunk_rows;
        const int64_t row_end = row_start + chunk_rows < m ? row_start + chunk_rows : m;
        if (row_end <= row_start) continue;
        const int64_t ntiles = (row_end - row_start + VNNI_TILE_M - 1) / VNNI_TILE_M;
        if (chunk != split_chunk) {
            codes4_vnni_split(x + row_start * lda, lda, row_end - row_start, ntiles * VNNI_TILE_M, k, limbs, step,
                              sums);
            split_chunk = chunk;
        }
        codes4_vnni_widen_block(packed + b * block_bytes, k, wide);
        const uint8_t *next = item + 1 < blocks * chunks ? packed + ((item + 1) % blocks) * block_bytes : NULL;
        for (int64_t row = row_start; row < row_end; row += VNNI_TILE_M) {
            const int64_t t = row - row_start;
            const NextBlock nb = next_block_share(next, block_bytes, t / VNNI_TILE_M, ntiles);
            tile_codes4_vnni(limbs + t * groups * 3 * CODES4_GROUP, step + t * groups, sums + t * groups, groups,
                             packed + b * block_bytes, wide, row_end - row, &e, row, b * BLOCK_N, side, nb);
        }
    }
}
#else
#define GEMM_VNNI 0
#endif
