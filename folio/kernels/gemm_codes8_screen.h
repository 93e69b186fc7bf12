/* The greedy LM head over 8-bit codes, screened in int16 on AVX2 (included by cpu_gemm.c after
 * gemm_codes8_argmax.h, whose layout, widening and exact arg-max it uses, and gemm_argmax_screen.h's rescore).
 *
 * Why: AVX2 has no vdpbf16ps, but vpmaddwd multiplies 16 int16 pairs into 8 int32 lanes: with its vpaddd, 1.6x the
 * float32 FMA's multiply-adds per second on Zen 3 (2 cores of an AMD EPYC, avx2). A Q8_0 head's weights are int8
 * codes q times a step d per 32 k, so with x rounded to int16 per row (x ~ s xq, s = max |x| / 32767) a group's
 * dot product is one exact int32 sum I_g = sum xq q, and S = s sum_g d_g I_g is within a small bound of the float32
 * logit. As the bfloat16 screen (gemm_argmax_screen.h): T = max_v (S_v - b_v), every column with S_v + b_v >= T is
 * a candidate, and each candidate's block is rescored through the float32 tile over the widened block (the values
 * of folio_gemm_argmax_codes8 and folio_gemm_argmax_f32): the identical token, ties included.
 *
 * The bound, u = 2^-24, K terms in G groups, g(j) = j u / (1 - j u), n_v >= ||w_v||_1, a = max |x_r|:
 *   rounding x: |x_k - s xq_k| <= 0.502 s (the quotient rounded, at most 32767 u s more by the clamp), so the
 *   exact sum moves by <= 0.51 s n_v; the int32 sums are exact; float32 converts each, adds G of them with a step
 *   (FMA) and multiplies by s: <= g(G + 2) a n_v (1 + 1e-4); the float32 tile's own FMA chain is within g(K) a n_v
 *   of the exact dot product; a step d not a float16 makes fl(d q) != d q: <= u a n_v. So |L - S| <= c a n_v with
 *   c = 0.51 / 32767 + g(G + 2) + g(K) + 4 u, enlarged 1% for the float32 rounding of b and S +- b (each <= u (|S|
 *   + b) ~ u a n_v against c >= K u). Flushed subnormals move a term by < 2^-126 (1 + max|w| + a): `slack` per
 *   row. On SmolLM2's head about c = 5e-5 relative to a n_v: a row keeps one or two candidate blocks.
 * Rows with a non-finite, huge or tiny max, and candidate lists that overflow, take the exact path instead. */
#if GEMM_VEC_BITS == 256
#define I16_PAIRS (CODES4_GROUP / 2)           /* k pairs per group of 32 */
#define I16_GROUP_VECS (I16_PAIRS * 3)         /* ymm of int16 pairs per group of a block: 3 per pair */
#define I16_X_MAX 32767                        /* |xq| <= this: no vpmaddwd pair reaches 2^31 */

static _Thread_local ThreadScratch codes8_screen_scratch; /* each thread's float32 sums of a block's rows */

/* One group of a block's 8-bit codes -> its int16 k pairs: dst[p][j] holds columns 8j .. 8j + 7 of the group's k 2p
 * and 2p + 1 side by side (vpmaddwd's operand layout). */
static inline void codes8_widen_pairs(const uint8_t *group, __m256i *dst) {
    const uint8_t *codes = group + BLOCK_N * sizeof(float);
    for (int p = 0; p < I16_PAIRS; ++p) {
        const uint8_t *even = codes + 2 * p * BLOCK_N, *odd = even + BLOCK_N;
        const __m128i e16 = _mm_loadu_si128((const __m128i *)even), o16 = _mm_loadu_si128((const __m128i *)odd);
        const __m128i e8 = _mm_loadl_epi64((const __m128i *)(even + 16));
        const __m128i o8 = _mm_loadl_epi64((const __m128i *)(odd + 16));
        _mm256_store_si256(dst + 3 * p, _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(e16, o16)));
        _mm256_store_si256(dst + 3 * p + 1, _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(e16, o16)));
        _mm256_store_si256(dst + 3 * p + 2, _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(e8, o8)));
    }
}

/* One group of one screening tile: MR rows of int16 x (xg: the group's 32 x of each row, rows 32 apart) x the
 * group's 24 columns. MR x 3 exact int32 sums, then converted and added with the group's steps d into the rows'
 * float32 sums in L1 (sums: rows BLOCK_N apart). */
static inline void tile_i16_sums(const __m256i *dot, int rows, const float *d, float *sums) {
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j < 3; ++j) {
            float *at = sums + i * BLOCK_N + 8 * j;
            _mm256_store_ps(at, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[3 * i + j]), _mm256_loadu_ps(d + 8 * j),
                                                _mm256_load_ps(at)));
        }
}

#define DEFINE_TILE_I16(MR)                                                                                       \
    static inline void tile_i16_##MR(const int16_t *xg, const __m256i *pairs, const float *d, float *sums) {      \
        __m256i dot[MR * 3];                                                                                      \
        for (int i = 0; i < MR * 3; ++i) dot[i] = _mm256_setzero_si256();                                         \
        _Pragma("GCC unroll 2") for (int p = 0; p < I16_PAIRS; ++p) {                                             \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                                \
                int32_t pair;                                                                                     \
                memcpy(&pair, xg + i * CODES4_GROUP + 2 * p, sizeof pair);                                        \
                const __m256i a = _mm256_set1_epi32(pair);                                                        \
                for (int j = 0; j < 3; ++j)                                                                       \
                    dot[3 * i + j] = _mm256_add_epi32(dot[3 * i + j], _mm256_madd_epi16(a, pairs[3 * p + j]));    \
            }                                                                                                     \
        }                                                                                                         \
        tile_i16_sums(dot, MR, d, sums);                                                                          \
    }
DEFINE_TILE_I16(3)
DEFINE_TILE_I16(2)
DEFINE_TILE_I16(1)

/* The 4-row tile, the one a decode step's rows run through, in assembly: from C, gcc loaded each pair's 3 vectors
 * into registers once for the 4 rows (3 registers the 12 sums need), spilled 2 sums, and their store-to-load chains
 * held the screen at the float32 arg-max's speed. Here a pair's first two vectors are loaded into registers once
 * for the 4 rows and the third is the last vpmaddwd's memory operand, whose product overwrites the broadcast (12
 * sums, 2 vectors, the broadcast and the product: the 16 registers). With all three as memory operands (12 loads
 * of 32 bytes a pair instead of 6) the screen ran 10% slower: SmolLM2's head at 64 rows, 245-247 against 270-273
 * GFLOP/s (Zen 3, avx2, session 45). The 16 pairs are unrolled with constant offsets (the assembler adds them up):
 * row i's x pair p at 4p + 64i, vector j of pair p at 96p + 32j. The first pair's products are the sums, the
 * others' are added to them. */
#define I16_SET(set, add) set
#define I16_ADD(set, add) add
#ifdef __AVXVNNI__
/* AVX-VNNI's vpdpwssd multiplies and adds in one instruction, with the same wrapping int32 sums: SmolLM2's head at
 * 64 rows 365 -> 403 GFLOP/s (Zen 5, --cpu-isa avx2+avx_vnni; docs/performance.md, session 52) */
#define I16_MADD(OP, w, sum, t)                                                                                   \
    OP("vpmaddwd " w ", %[a], %[" sum "]\n\t", "%{vex%} vpdpwssd " w ", %[a], %[" sum "]\n\t")
#else
#define I16_MADD(OP, w, sum, t)                                                                                   \
    OP("vpmaddwd " w ", %[a], %[" sum "]\n\t", "vpmaddwd " w ", %[a], %[" t "]\n\tvpaddd %[" t "], %[" sum "], %[" sum "]\n\t")
#endif
#define I16_ROW(OP, p, i)                                                                                         \
    "vpbroadcastd 4*" #p "+64*" #i "(%[x]), %[a]\n\t" I16_MADD(OP, "%[w0]", "s" #i "0", "t")                     \
        I16_MADD(OP, "%[w1]", "s" #i "1", "t") I16_MADD(OP, "96*" #p "+64(%[w])", "s" #i "2", "a")
#define I16_PAIR(OP, p)                                                                                           \
    "vmovdqa 96*" #p "(%[w]), %[w0]\n\tvmovdqa 96*" #p "+32(%[w]), %[w1]\n\t" I16_ROW(OP, p, 0) I16_ROW(OP, p, 1) \
        I16_ROW(OP, p, 2) I16_ROW(OP, p, 3)
#define I16_ADD_PAIR(p) I16_PAIR(I16_ADD, p)

static inline void tile_i16_4(const int16_t *xg, const __m256i *pairs, const float *d, float *sums) {
    __m256i dot[12], a, t, w0, w1;
    __asm__(I16_PAIR(I16_SET, 0) I16_ADD_PAIR(1) I16_ADD_PAIR(2) I16_ADD_PAIR(3) I16_ADD_PAIR(4) I16_ADD_PAIR(5)
                I16_ADD_PAIR(6) I16_ADD_PAIR(7) I16_ADD_PAIR(8) I16_ADD_PAIR(9) I16_ADD_PAIR(10) I16_ADD_PAIR(11)
                    I16_ADD_PAIR(12) I16_ADD_PAIR(13) I16_ADD_PAIR(14) I16_ADD_PAIR(15)
            : [s00] "=&x"(dot[0]), [s01] "=&x"(dot[1]), [s02] "=&x"(dot[2]), [s10] "=&x"(dot[3]),
              [s11] "=&x"(dot[4]), [s12] "=&x"(dot[5]), [s20] "=&x"(dot[6]), [s21] "=&x"(dot[7]),
              [s22] "=&x"(dot[8]), [s30] "=&x"(dot[9]), [s31] "=&x"(dot[10]), [s32] "=&x"(dot[11]), [a] "=&x"(a),
              [t] "=&x"(t), [w0] "=&x"(w0), [w1] "=&x"(w1)
            : [x] "r"(xg), [w] "r"(pairs), "m"(*(const int16_t(*)[4 * CODES4_GROUP])xg),
              "m"(*(const __m256i(*)[I16_GROUP_VECS])pairs));
    tile_i16_sums(dot, 4, d, sums);
}

/* The screen over one block (24 columns from col0) for all m rows: group by group, each widened to int16 pairs
 * once and run through every row tile (the group's pairs, the rows' x and sums all stay in L1), then each row's
 * sums, times its step, into the screening epilogue. xq: [group][row][32]. */
static void screen_block_i16(const int16_t *xq, int64_t m, int64_t k, const uint8_t *block, const float *row_step,
                             float *sums, __m256i *pairs, ScreenState *st, int64_t col0, int64_t n) {
    memset(sums, 0, sizeof(float) * (size_t)m * BLOCK_N);
    for (int64_t g = 0; g < k / CODES4_GROUP; ++g) {
        const uint8_t *group = block + g * CODES8_GROUP_BYTES;
        codes8_widen_pairs(group, pairs);
        for (int64_t row = 0; row < m; row += TILE_M) {
            const int16_t *xg = xq + (g * m + row) * CODES4_GROUP;
#define TILE_CASE(MR)                                                                                             \
    case MR: tile_i16_##MR(xg, pairs, (const float *)group, sums + row * BLOCK_N); break;
            switch (m - row < TILE_M ? m - row : TILE_M) {
                FOR_EACH_TILE_ROWS(TILE_CASE)
            default: break;
            }
#undef TILE_CASE
        }
    }
    for (int64_t r = 0; r < m; ++r) {
        const __m256 s = _mm256_set1_ps(row_step[r]);
        const float *at = sums + r * BLOCK_N;
        const __m256 acc[3] = {_mm256_mul_ps(_mm256_load_ps(at), s), _mm256_mul_ps(_mm256_load_ps(at + 8), s),
                               _mm256_mul_ps(_mm256_load_ps(at + 16), s)};
        screen_store24(st, r, col0, acc, n);
    }
}
#endif

/* out_ids as folio_gemm_argmax_codes8 over the same 8-bit codes (`packed`), for 1 <= m <= CHUNK_M rows, by
 * screening in int16 and rescoring in float32; col_abs_sum[v] >= ||w_v||_1 and w_abs_max >= max |w|. Returns 0
 * when screened, 1 when it took the exact path (non-finite, huge or tiny rows, too many candidates), -1 when
 * neither ran (m out of range, no memory), -2 in a library without the AVX2 body. */
int folio_gemm_argmax_codes8_screened(const float *x, int64_t lda, const uint8_t *packed, const float *col_abs_sum,
                                      float w_abs_max, int64_t m, int64_t n, int64_t k, int64_t *out_ids,
                                      int num_threads) {
#if GEMM_VEC_BITS == 256
    if (m < 1 || m > CHUNK_M || k < CODES4_GROUP || k % CODES4_GROUP) return -1;
    const int64_t nblocks = num_blocks(n), threads = num_threads, groups = k / CODES4_GROUP;
    const int64_t block_bytes = groups * CODES8_GROUP_BYTES;
    int16_t *xq = aligned_alloc(64, (sizeof(int16_t) * (size_t)(m * k) + 63) & ~(size_t)63);
    ScreenBuffers buf;
    if (xq == NULL || screen_buffers_alloc(&buf, threads, m, nblocks) != 0) {
        free(xq);
        return -1;
    }
    int status = -1;
    float *row_step = buf.row_step;
    const double u = 0x1p-24, gk = (double)k * u / (1.0 - (double)k * u);
    const double gg = (double)(groups + 2) * u / (1.0 - (double)(groups + 2) * u);
    const double c = (0.51 / I16_X_MAX + gg * (1.0 + 1e-4) + gk + 4.0 * u) * 1.01;
    int sane = screen_sane(w_abs_max);
    for (int64_t r = 0; r < m; ++r) {
        double amax;
        sane &= screen_row(x + r * lda, k, c, w_abs_max, &buf, r, &amax);
        const float step = (float)(amax / I16_X_MAX);
        row_step[r] = step;
        for (int64_t kk = 0; kk < k; ++kk) {
            double q = sane ? rint((double)x[r * lda + kk] / (double)step) : 0.0;
            q = q > I16_X_MAX ? I16_X_MAX : (q < -I16_X_MAX ? -I16_X_MAX : q);
            xq[((kk / CODES4_GROUP) * m + r) * CODES4_GROUP + kk % CODES4_GROUP] = (int16_t)q;
        }
    }
    int overflow = !sane;
    if (sane) {
#pragma omp parallel num_threads(num_threads) reduction(| : overflow)
        {
            ScreenState state = screen_state(&buf, col_abs_sum, omp_get_thread_num(), m);
            /* the rows' float32 sums (m x 24), then the group's int16 pairs (48 ymm) */
            float *sums = thread_scratch(&codes8_screen_scratch, (m * BLOCK_N + I16_GROUP_VECS * 8) * 4);
            if (sums == NULL) abort(); /* at most 26 KB per thread */
            __m256i *group_pairs = (__m256i *)(sums + m * BLOCK_N);
            GEMM_ITEMS
            for (int64_t b = 0; b < nblocks; ++b)
                screen_block_i16(xq, m, k, packed + b * block_bytes, row_step, sums, group_pairs, &state, b * BLOCK_N,
                                 n);
            overflow |= state.overflow;
        }
    }
    if (overflow) {
        status = folio_gemm_argmax_codes8(x, lda, packed, m, n, k, 1, out_ids, num_threads) == 0 ? 1 : -1;
        goto done;
    }
    screen_rescore(x, lda, NULL, packed, &buf, screen_pairs(&buf, threads, m, nblocks, BLOCK_N), m, n, k, num_threads,
                   out_ids);
    status = 0;
done:
    free(xq);
    screen_buffers_free(&buf);
    return status;
#else
    (void)x, (void)lda, (void)packed, (void)col_abs_sum, (void)w_abs_max, (void)m, (void)n, (void)k, (void)out_ids;
    (void)num_threads;
    return -2;
#endif
}
