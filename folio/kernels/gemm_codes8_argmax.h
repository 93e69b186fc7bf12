/* Included by cpu_gemm.c after gemm_codes4.h, whose group size, packing driver, float16 rounding
 * and per-thread widened block (codes4_scratch) it uses. */

/* The greedy LM head over 8-bit codes: a GGUF's Q8_0 weight (fl(d q), q an int8, d a float16 step per 32 k)
 * dequantizes to float32 values that are exact products, kept here as the codes and a float32 step per group (9
 * bits a weight instead of the bfloat16 screen's 16 and float32's 32). The tile widens them in registers and runs
 * the float32 tile's FMAs in the same k order: the same logits, so the same arg-max as folio_gemm_argmax_f32. A
 * chunk of one row tile (a decode step of a few requests) widens in registers; more rows, up to CHUNK_M, widen each
 * block once into the thread's float32 block in L2 for all their row tiles, as gemm_body_codes4 does: a quarter of
 * float32's bytes from memory, and the same float32 tiles (M = 64 rows of SmolLM2's head: 10% faster than the
 * float32 layout on an AVX2-only Zen 3, docs/performance.md, session 42).
 * Layout: block b of BLOCK_N columns, group g of 32 k: float32 d[BLOCK_N], then 32 rows (k) of BLOCK_N int8 codes. */
#define CODES8_GROUP_BYTES (BLOCK_N * ((int64_t)sizeof(float) + CODES4_GROUP))

int64_t folio_gemm_packed_bytes_codes8(int64_t n, int64_t k) {
    return k % CODES4_GROUP ? -1 : num_blocks(n) * (k / CODES4_GROUP) * CODES8_GROUP_BYTES;
}

/* The codes of one group for step d, or 0 if some value is not exactly fl(d q) for its nearest q in -128..127. */
static int codes8_try_scalar(const float *v, float d, int8_t *q) {
    for (int i = 0; i < CODES4_GROUP; ++i) {
        float f = d > 0.0f ? rintf(v[i] / d) : 0.0f;
        if (!(f >= -128.0f)) f = -128.0f;
        if (f > 127.0f) f = 127.0f;
        q[i] = (int8_t)f;
        if (codes4_bits(d * (float)q[i]) != codes4_bits(v[i])) return 0;
    }
    return 1;
}

/* The same, a vector at a time (as codes4_try). gv_max takes -128 for a NaN quotient, as the scalar clamp does. */
#if GEMM_VEC_BITS > 0
static int codes8_try(const float *v, float d, int8_t *q) {
    if (!(d > 0.0f)) return codes8_try_scalar(v, d, q);
    const gv_f32 dv = gv_set1(d), lo = gv_set1(-128.0f), hi = gv_set1(127.0f);
    int bad = 0;
    for (int i = 0; i < CODES4_GROUP; i += GV_LANES) {
        const gv_f32 x = gv_load(v + i);
        const gv_f32 f = gv_min(gv_max(gv_round(gv_div(x, dv)), lo), hi);
        bad |= gv_bits_differ(gv_mul(dv, f), x);
        gv_store_bytes(q + i, f);
    }
    return !bad;
}
#else
#define codes8_try codes8_try_scalar
#endif

/* A column of an 8-bit group: d and the int8 codes (see the layout above). */
static int codes8_store_column(const float *v, uint8_t *group, int64_t c) {
    float *d_out = (float *)group;
    int8_t *codes = (int8_t *)(d_out + BLOCK_N);
    int8_t q[CODES4_GROUP] = {0};
    float d = 0.0f;
    if (v != NULL) {
        float amax = 0.0f;
        for (int i = 0; i < CODES4_GROUP; ++i) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        d = codes4_round_f16(amax / 127.0f);
        if (!codes8_try(v, d, q)) {
            d = amax / 127.0f;
            if (!codes8_try(v, d, q)) return 0;
        }
    }
    d_out[c] = d;
    for (int kk = 0; kk < CODES4_GROUP; ++kk) codes[kk * BLOCK_N + c] = q[kk];
    return 1;
}

/* Packs W [n, k] as 8-bit codes; 0, or -1 if k is not whole groups or some group is not exactly codes. */
int folio_gemm_pack_codes8(const float *w, int64_t ldw, int64_t n, int64_t k, uint8_t *packed) {
    return codes_pack(w, ldw, n, k, packed, CODES8_GROUP_BYTES, codes8_store_column);
}

#if GEMM_VEC_BITS > 0
#if GEMM_VEC_BITS == 512
#define CODES8_WIDEN(p, j) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((p) + 16 * (j)))))
#else
#define CODES8_WIDEN(p, j) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((p) + 8 * (j)))))
#endif

#define DEFINE_TILE_CODES8(MR)                                                                                    \
    static void tile_codes8_##MR(const float *x, int64_t lda, const uint8_t *wb, int64_t k, const Epilogue *e,   \
                                 int64_t row0, int64_t col0, NextBlock nb, SidePrefetch *side) {                 \
        TILE_START(MR)                                                                                            \
        for (int64_t g = 0; g < k / CODES4_GROUP; ++g) {                                                          \
            const uint8_t *group = wb + g * CODES8_GROUP_BYTES;                                                   \
            const float *d = (const float *)group;                                                                \
            const uint8_t *codes = (const uint8_t *)(d + BLOCK_N);                                                \
            const gv_f32 d0 = gv_load(d), d1 = gv_load(d + GV_LANES), d2 = gv_load(d + 2 * GV_LANES);            \
            for (int64_t kk = 0; kk < CODES4_GROUP; ++kk) {                                                       \
                const int64_t s = g * CODES4_GROUP + kk;                                                          \
                const uint8_t *row_codes = codes + kk * BLOCK_N;                                                  \
                _mm_prefetch((const char *)row_codes + 8 * 64, _MM_HINT_T0);                                      \
                TILE_OTHER_PREFETCH(s)                                                                            \
                const gv_f32 w0 = gv_mul(CODES8_WIDEN(row_codes, 0), d0);                                         \
                const gv_f32 w1 = gv_mul(CODES8_WIDEN(row_codes, 1), d1);                                         \
                const gv_f32 w2 = gv_mul(CODES8_WIDEN(row_codes, 2), d2);                                         \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                           \
                    const gv_f32 a = gv_set1(x[i * lda + s]);                                                   \
                    acc[i][0] = gv_fma(a, w0, acc[i][0]);                                                        \
                    acc[i][1] = gv_fma(a, w1, acc[i][1]);                                                        \
                    acc[i][2] = gv_fma(a, w2, acc[i][2]);                                                        \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        TILE_FINISH(MR)                                                                                           \
    }
FOR_EACH_TILE_ROWS(DEFINE_TILE_CODES8)

/* Block `src` (8-bit codes) -> its float32 layout in `dst` ([k][BLOCK_N], as folio_gemm_pack_f32 lays it out): each
 * value fl(d q), one exact product. */
static void codes8_widen_block(const uint8_t *src, int64_t k, float *dst) {
    for (int64_t g = 0; g < k / CODES4_GROUP; ++g, src += CODES8_GROUP_BYTES, dst += CODES4_GROUP * BLOCK_N) {
        const float *d = (const float *)src;
        const uint8_t *codes = (const uint8_t *)(d + BLOCK_N);
        const gv_f32 d0 = gv_load(d), d1 = gv_load(d + GV_LANES), d2 = gv_load(d + 2 * GV_LANES);
        for (int64_t kk = 0; kk < CODES4_GROUP; ++kk) {
            const uint8_t *row_codes = codes + kk * BLOCK_N;
            gv_storeu(dst + kk * BLOCK_N, gv_mul(CODES8_WIDEN(row_codes, 0), d0));
            gv_storeu(dst + kk * BLOCK_N + GV_LANES, gv_mul(CODES8_WIDEN(row_codes, 1), d1));
            gv_storeu(dst + kk * BLOCK_N + 2 * GV_LANES, gv_mul(CODES8_WIDEN(row_codes, 2), d2));
        }
    }
}

/* The arg-max of m rows (TILE_M < m <= CHUNK_M) over widened blocks: folio_gemm_argmax_f32's loop, each block
 * widened once per thread first (into the codes4 bodies' per-thread block). best_val / best_col as argmax_start. */
static void codes8_argmax_widened(const float *x, int64_t lda, const uint8_t *packed, int64_t m, int64_t n, int64_t k,
                                  float *best_val, int32_t *best_col, int num_threads) {
    const int64_t block_bytes = (k / CODES4_GROUP) * CODES8_GROUP_BYTES, ntiles = (m + TILE_M - 1) / TILE_M;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t tid = omp_get_thread_num();
        const Epilogue e = {NULL, 0, 0, NULL, n, best_val + tid * m * 16, best_col + tid * m * 16, NULL};
        float *wide = thread_scratch(&codes4_scratch, k * BLOCK_N * (int64_t)sizeof(float));
        if (wide == NULL) abort(); /* a few hundred KB per thread, once */
        GEMM_ITEMS
        for (int64_t b = 0; b < num_blocks(n); ++b) {
            const uint8_t *next = b + 1 < num_blocks(n) ? packed + (b + 1) * block_bytes : NULL;
            codes8_widen_block(packed + b * block_bytes, k, wide);
            for (int64_t t = 0; t < ntiles; ++t) {
                const int64_t row = t * TILE_M, rows = m - row < TILE_M ? m - row : TILE_M;
                const NextBlock nb = next_block_share(next, block_bytes, t, ntiles);
                tile_f32(x + row * lda, lda, wide, k, rows, &e, row, b * BLOCK_N, nb, NULL);
            }
        }
    }
}
#endif

/* out_ids as folio_gemm_argmax_f32 over the same weight packed as 8-bit codes, for m <= TILE_M rows, or with
 * `widened` for m <= CHUNK_M (the caller passes 0 where a faster path takes more rows: the bfloat16 screen);
 * returns 0, or -1 where it does not run (more rows, the generic tier, no memory): the caller takes the float32
 * paths. */
int folio_gemm_argmax_codes8(const float *x, int64_t lda, const uint8_t *packed, int64_t m, int64_t n, int64_t k,
                             int widened, int64_t *out_ids, int num_threads) {
#if GEMM_VEC_BITS > 0
    float *best_val;
    int32_t *best_col;
    const int64_t max_rows = widened ? CHUNK_M : TILE_M;
    if (m < 1 || m > max_rows || k % CODES4_GROUP || argmax_start(num_threads, m, &best_val, &best_col) != 0)
        return -1;
    if (m > TILE_M) {
        codes8_argmax_widened(x, lda, packed, m, n, k, best_val, best_col, num_threads);
        argmax_finish(best_val, best_col, num_threads, m, out_ids);
        return 0;
    }
    const int64_t block_bytes = (k / CODES4_GROUP) * CODES8_GROUP_BYTES;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t tid = omp_get_thread_num();
        const Epilogue e = {NULL, 0, 0, NULL, n, best_val + tid * m * 16, best_col + tid * m * 16, NULL};
#define TILE_CASE(MR)                                                                                             \
    case MR: tile_codes8_##MR(x, lda, packed + b * block_bytes, k, &e, 0, b * BLOCK_N, nb, NULL); break;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks(n); ++b) {
            const uint8_t *next = b + 1 < num_blocks(n) ? packed + (b + 1) * block_bytes : NULL;
            const NextBlock nb = {(const char *)next, next != NULL ? (const char *)next + block_bytes : NULL, 0};
            switch (m) {
                FOR_EACH_TILE_ROWS(TILE_CASE)
            default: break;
            }
        }
#undef TILE_CASE
    }
    argmax_finish(best_val, best_col, num_threads, m, out_ids);
    return 0;
#else
    (void)x, (void)lda, (void)packed, (void)m, (void)n, (void)k, (void)widened, (void)out_ids, (void)num_threads;
    return -1;
#endif
}
