/* The greedy LM head over 8-bit codes, screened in int8 through AVX512-VNNI's vpdpbusd (included by cpu_gemm.c after
 * gemm_codes8_screen.h, whose exact path, epilogue and rescore it shares).
 *
 * Why: where the library has AVX512-VNNI and no AMX (Zen 4 / 5 at their tier; Cascade Lake and Ice Lake at
 * avx512+avx512_vnni) one vpdpbusd multiplies and adds 64 int8 pairs: 4x the float32 FMA's multiply-adds, 2x
 * vdpbf16ps's. A Q8_0 head's weights are int8 codes q times a step d per group of 32 k; x rounded to 8 bits with a
 * step of its own per row and group (s_g >= max |x_g| / 127: W1's hidden states have outliers, and one step per
 * row left a mean of 1423 of SmolLM2's 49152 columns as candidates, one per group 4; docs/performance.md, session
 * 53) makes each group's dot product one exact int32 sum I_g = sum xq q, and S = sum_g s_g d_g I_g is within a
 * bound of the float32 logit. As gemm_codes8_screen.h: candidates are the columns whose S + b reaches the row's
 * largest S - b, each rescored through the float32 tile: the identical token, ties included.
 *
 * vpdpbusd multiplies unsigned bytes by signed ones: the codes go in as q + 128 (0..255, the quads layout below) and
 * x as signed; each group's int32 sums start at -128 sum_k xq_k instead of 0, so they end at I_g exactly (|I_g| <=
 * 32 x 128 x 127 < 2^24: exact in float32 too).
 *
 * The bound, u = 2^-24, G groups of K, g(j) = j u / (1 - j u), n_v >= ||w_v||_1, n_vg >= the group's, a = max |x|:
 *   rounding x: |x_k - s_g xq_k| <= s_g (1/2 + 128 u) (the quotient rounded once; |x_k / s_g| <= 127 (1 + 2u) rounds
 *   to at most 127), so the exact sum moves by <= sum_g h_g n_vg, h_g = 0.50001 s_g: the per-column vector B, summed
 *   in float32 by G FMAs (within g(G) of its value: B (1 + 1e-5) covers it and the roundings of S +- b); each term
 *   s_g d_g I_g is two roundings of an exact product, |s_g d_g I_g| <= (a + s_g / 2) n_vg <= 1.004 a n_vg, added by
 *   G FMAs: <= g(G + 2) 1.004 a n_v; the float32 tile's own FMA chain is within g(K) a n_v of the exact dot product;
 *   a step d not a float16: <= u a n_v. So |L - S| <= B + c a n_v, c = (g(G + 2) 1.004 + g(K) + 4 u) 1.01. Steps
 *   are floored at a 2^-40 (>= 2^-100 for a row the screen takes), so no step is subnormal; a flushed subnormal
 *   product moves a term by < 2^-126 (1 + max |w| + a), as the int16 screen's `slack`. */
#if GEMM_VEC_BITS == 512 && defined(__AVX512VNNI__) && !GEMM_AMX
#define GEMM_I8_SCREEN 1
#define I8_QUADS (CODES4_GROUP / 4) /* vpdpbusd's 4-k dwords per group */
#define I8_X_MAX 127

/* One row's group of x rounded: the int32 sums' start (-128 sum xq), the step s_g and the bound's h_g. */
typedef struct {
    int32_t start;
    float step;
    float half;
} I8Group;

/* The screen of one tile of R (1 or 2) rows over a block's 48 columns: every group's int32 sums in registers, then
 * scaled into float32 sums S and the rounding bound B. xq: [group][row][32] int8; groups: [group][row];
 * quads: the block in folio_gemm_pack_codes8_quads' layout; group_abs: [group][n_pad] n_vg from this block's col. */
static inline __attribute__((always_inline)) void tile_i8(const int R, const int8_t *xq, const I8Group *groups,
                                                          int64_t m, int64_t ngroups, const uint8_t *quads,
                                                          const float *group_abs, int64_t n_pad, __m512 acc[2][3],
                                                          __m512 bnd[2][3]) {
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < 3; ++j) acc[i][j] = bnd[i][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngroups; ++g) {
        const uint8_t *group = quads + g * CODES8_GROUP_BYTES;
        const float *d = (const float *)group;
        const uint8_t *w = group + BLOCK_N * sizeof(float);
        __m512i sum[2][3];
        for (int i = 0; i < R; ++i)
            for (int j = 0; j < 3; ++j) sum[i][j] = _mm512_set1_epi32(groups[g * m + i].start);
        _Pragma("GCC unroll 8") for (int q = 0; q < I8_QUADS; ++q) {
            for (int i = 0; i < R; ++i) {
                int32_t quad;
                memcpy(&quad, xq + (g * m + i) * CODES4_GROUP + 4 * q, sizeof quad);
                const __m512i b = _mm512_set1_epi32(quad);
                for (int j = 0; j < 3; ++j) sum[i][j] = _mm512_dpbusd_epi32(sum[i][j], _mm512_loadu_si512(w + 64 * (3 * q + j)), b);
            }
        }
        for (int i = 0; i < R; ++i) {
            const __m512 s = _mm512_set1_ps(groups[g * m + i].step), h = _mm512_set1_ps(groups[g * m + i].half);
            for (int j = 0; j < 3; ++j) {
                const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(sum[i][j]), s);
                acc[i][j] = _mm512_fmadd_ps(t, _mm512_loadu_ps(d + 16 * j), acc[i][j]);
                bnd[i][j] = _mm512_fmadd_ps(h, _mm512_loadu_ps(group_abs + g * n_pad + 16 * j), bnd[i][j]);
            }
        }
    }
}

/* The screen over one block (48 columns from col0) for all m rows, 2 rows a tile, into the screening epilogue. */
static void screen_block_i8(const int8_t *xq, const I8Group *groups, int64_t m, int64_t ngroups, const uint8_t *quads,
                            const float *group_abs, int64_t n_pad, ScreenState *st, int64_t col0, int64_t n,
                            const uint8_t *next) {
    const __m512 widen = _mm512_set1_ps(1.0f + 1e-5f);
    const int64_t lines = ngroups * CODES8_GROUP_BYTES / 64, tiles = (m + 1) / 2;
    const int64_t per_tile = (lines + tiles - 1) / tiles;
    int64_t line = 0;
    for (int64_t row = 0; row < m; row += 2) {
        const int rows = m - row < 2 ? 1 : 2;
        if (next != NULL)
            for (int64_t l = 0; l < per_tile && line < lines; ++l, ++line)
                _mm_prefetch((const char *)next + 64 * line, _MM_HINT_T1);
        __m512 acc[2][3], bnd[2][3];
        const int8_t *x = xq + row * CODES4_GROUP;
        if (rows == 2)
            tile_i8(2, x, groups + row, m, ngroups, quads, group_abs + col0, n_pad, acc, bnd);
        else
            tile_i8(1, x, groups + row, m, ngroups, quads, group_abs + col0, n_pad, acc, bnd);
        for (int i = 0; i < rows; ++i)
            for (int j = 0; j < 3; ++j) {
                const int64_t col = col0 + 16 * j;
                if (col >= n) break;
                const __mmask16 mask = n - col >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - col)) - 1u);
                screen_store16_plus(st, row + i, col, acc[i][j], _mm512_mul_ps(bnd[i][j], widen), mask);
            }
    }
}
#else
#define GEMM_I8_SCREEN 0
#endif

int folio_gemm_codes8_has_i8_screen(void) { return GEMM_I8_SCREEN; }

/* The codes of folio_gemm_pack_codes8's layout (`packed`, n x k) in the int8 screen's: per block and group the same
 * float32 steps d[BLOCK_N], then for each of the group's 8 quads of k, BLOCK_N dwords of 4 codes + 128 (vpdpbusd's
 * unsigned operand): byte 4c + t of quad q is column c's code at k 4q + t. Same size. */
void folio_gemm_pack_codes8_quads(const uint8_t *packed, int64_t n, int64_t k, uint8_t *out) {
    const int64_t groups = num_blocks(n) * (k / CODES4_GROUP);
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *src = packed + g * CODES8_GROUP_BYTES;
        uint8_t *dst = out + g * CODES8_GROUP_BYTES;
        memcpy(dst, src, BLOCK_N * sizeof(float));
        const int8_t *codes = (const int8_t *)(src + BLOCK_N * sizeof(float));
        uint8_t *quads = dst + BLOCK_N * sizeof(float);
        for (int q = 0; q < CODES4_GROUP / 4; ++q)
            for (int c = 0; c < BLOCK_N; ++c)
                for (int t = 0; t < 4; ++t)
                    quads[(q * BLOCK_N + c) * 4 + t] = (uint8_t)(codes[(4 * q + t) * BLOCK_N + c] + 128);
    }
}

/* out_ids as folio_gemm_argmax_codes8 over the same codes (`packed`; `quads` the same in the layout above; the
 * rescore reads packed_f32, the same weight in the float32 layout, where given, else widens `packed`'s blocks), for
 * TILE_M < m <= CHUNK_M rows, by screening in int8 and rescoring in float32; col_abs_sum[v] >= ||w_v||_1,
 * group_abs_sum[g * n_pad + v] >= the L1 norm of column v's group g (n_pad = the blocks' columns, zero past n) and
 * w_abs_max >= max |w|. Returns 0 when screened, 1 when it took the exact path (non-finite, huge or tiny rows, too
 * many candidates), -1 when neither ran (m out of range, no memory), -2 in a library without the body. The next
 * block's codes are asked for (prefetcht1), a share per row tile: 789-805 -> 911-917 GFLOP/s at 64 rows. */
int folio_gemm_argmax_codes8_screened_i8(const float *x, int64_t lda, const uint8_t *packed, const uint8_t *quads,
                                         const float *packed_f32, const float *col_abs_sum,
                                         const float *group_abs_sum, float w_abs_max, int64_t m, int64_t n, int64_t k,
                                         int64_t *out_ids, int num_threads) {
#if GEMM_I8_SCREEN
    /* one row tile or fewer: folio_gemm_argmax_codes8 in registers is faster (SmolLM2's head at 8 rows 356 against
     * 306 GFLOP/s, at 16 368 against 524: benchmarks/lm_head_argmax.py, Zen 5) */
    if (m <= TILE_M || m > CHUNK_M || k < CODES4_GROUP || k % CODES4_GROUP) return -1;
    const int64_t nblocks = num_blocks(n), threads = num_threads, ngroups = k / CODES4_GROUP;
    const int64_t block_bytes = ngroups * CODES8_GROUP_BYTES, n_pad = nblocks * BLOCK_N;
    int8_t *xq = aligned_alloc(64, ((size_t)(m * k) + 63) & ~(size_t)63);
    I8Group *groups = malloc(sizeof(I8Group) * (size_t)(m * ngroups));
    ScreenBuffers buf;
    if (xq == NULL || groups == NULL || screen_buffers_alloc(&buf, threads, m, nblocks) != 0) {
        free(xq);
        free(groups);
        return -1;
    }
    int status = -1;
    const double u = 0x1p-24, gk = (double)k * u / (1.0 - (double)k * u);
    const double gg = (double)(ngroups + 2) * u / (1.0 - (double)(ngroups + 2) * u);
    const double c = (gg * 1.004 + gk + 4.0 * u) * 1.01;
    int sane = screen_sane(w_abs_max);
    for (int64_t r = 0; r < m; ++r) {
        double amax;
        sane &= screen_row(x + r * lda, k, c, w_abs_max, &buf, r, &amax);
        for (int64_t g = 0; g < ngroups; ++g) {
            const float *xg = x + r * lda + g * CODES4_GROUP;
            double gmax = 0.0;
            for (int i = 0; i < CODES4_GROUP; ++i) gmax = fabs((double)xg[i]) > gmax ? fabs((double)xg[i]) : gmax;
            const float step = (float)fmax(gmax / I8_X_MAX, amax * 0x1p-40);
            int32_t sum = 0;
            for (int i = 0; i < CODES4_GROUP; ++i) {
                double q = sane ? rint((double)xg[i] / (double)step) : 0.0;
                q = q > I8_X_MAX ? I8_X_MAX : (q < -I8_X_MAX ? -I8_X_MAX : q);
                xq[(g * m + r) * CODES4_GROUP + i] = (int8_t)q;
                sum += (int32_t)q;
            }
            groups[g * m + r] = (I8Group){-128 * sum, step, (float)(0.50001 * (double)step)};
        }
    }
    int overflow = !sane;
    if (sane) {
#pragma omp parallel num_threads(num_threads) reduction(| : overflow)
        {
            ScreenState state = screen_state(&buf, col_abs_sum, omp_get_thread_num(), m);
            GEMM_ITEMS
            for (int64_t b = 0; b < nblocks; ++b)
                screen_block_i8(xq, groups, m, ngroups, quads + b * block_bytes, group_abs_sum, n_pad, &state,
                                b * BLOCK_N, n, b + 1 < nblocks ? quads + (b + 1) * block_bytes : NULL);
            overflow |= state.overflow;
        }
    }
    if (overflow) {
        status = folio_gemm_argmax_codes8(x, lda, packed, m, n, k, 1, out_ids, num_threads) == 0 ? 1 : -1;
        goto done;
    }
    screen_rescore(x, lda, packed_f32, packed, &buf, screen_pairs(&buf, threads, m, nblocks, BLOCK_N), m, n, k,
                   num_threads, out_ids);
    status = 0;
done:
    free(xq);
    free(groups);
    screen_buffers_free(&buf);
    return status;
#else
    (void)x, (void)lda, (void)packed, (void)quads, (void)packed_f32, (void)col_abs_sum, (void)group_abs_sum, (void)m;
    (void)w_abs_max;
    (void)n, (void)k, (void)out_ids, (void)num_threads;
    return -2;
#endif
}
