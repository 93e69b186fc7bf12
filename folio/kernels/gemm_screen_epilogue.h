/* What the LM head's screens share (gemm_argmax_screen.h: bfloat16 on avx512_bf16; gemm_codes8_screen.h: int16 on
 * AVX2; gemm_codes8_screen_vnni.h: int8 with AVX512-VNNI): the per-thread state a screening tile's sums go into
 * instead of memory, and the candidates it leaves.
 * Included by cpu_gemm.c before its tiles' store16. */
#if GEMM_VEC_BITS > 0
#define SCREEN_CAP 2048 /* candidate slots per row per thread before the exact path takes over */

/* What the screening epilogue (screen_store16) reads and writes: one per thread. */
typedef struct ScreenState {
    const float *w_norm;    /* [n] an upper bound of a norm of w_v: ||w_v||_2 (bfloat16), ||w_v||_1 (int16) */
    const float *row_scale; /* [m] c ||x_r||: b_v = row_scale[r] w_norm[v] + row_slack[r] */
    const float *row_slack; /* [m] */
    float *threshold;       /* [m] this thread's running max over its columns of S - b */
    int32_t *cand_col;      /* [m][SCREEN_CAP] columns with S + b >= the threshold when seen */
    float *cand_hi;         /* [m][SCREEN_CAP] their S + b */
    int32_t *cand_count;    /* [m] */
    int overflow;           /* a row ran out of slots even after dropping what the threshold excludes */
} ScreenState;

/* Keeps row's candidates whose S + b still reaches the threshold; returns how many are left. */
static inline int32_t screen_compact(ScreenState *s, int64_t row) {
    int32_t *cols = s->cand_col + row * SCREEN_CAP;
    float *his = s->cand_hi + row * SCREEN_CAP;
    const float t = s->threshold[row];
    int32_t kept = 0;
    for (int32_t i = 0; i < s->cand_count[row]; ++i)
        if (his[i] >= t) {
            cols[kept] = cols[i];
            his[kept++] = his[i];
        }
    return s->cand_count[row] = kept;
}

/* What a screen allocates per call besides its rounded x: per row its bound's factors, per thread and row the
 * candidates (ScreenState), and the rescore's (block, row) pairs and arg-max lanes. */
typedef struct {
    float *row_scale, *row_slack, *row_step; /* [m] each (row_step: the int16 screen's step of x) */
    float *threshold;                        /* [threads][m], all -FLT_MAX to start */
    int32_t *cand_col;                       /* [threads][m][SCREEN_CAP] */
    float *cand_hi;                          /* [threads][m][SCREEN_CAP] */
    int32_t *cand_count;                     /* [threads][m], zeroed */
    uint8_t *wanted;                         /* [m][nblocks], zeroed: rescore this block for this row */
    int64_t *pairs;                          /* [m nblocks] */
    float *best_val;                         /* [threads][m][16] */
    int32_t *best_col;                       /* [threads][m][16] */
} ScreenBuffers;

static inline void screen_buffers_free(ScreenBuffers *b) {
    free(b->row_scale);
    free(b->threshold);
    free(b->cand_col);
    free(b->cand_hi);
    free(b->cand_count);
    free(b->wanted);
    free(b->pairs);
    free(b->best_val);
    free(b->best_col);
}

/* 0, or -1 with nothing left allocated where memory ran out. */
static inline int screen_buffers_alloc(ScreenBuffers *b, int64_t threads, int64_t m, int64_t nblocks) {
    const size_t mm = (size_t)m, tt = (size_t)threads;
    b->row_scale = malloc(sizeof(float) * mm * 3);
    b->row_slack = b->row_scale + m;
    b->row_step = b->row_scale + 2 * m;
    b->threshold = malloc(sizeof(float) * tt * mm);
    b->cand_col = malloc(sizeof(int32_t) * tt * mm * SCREEN_CAP);
    b->cand_hi = malloc(sizeof(float) * tt * mm * SCREEN_CAP);
    b->cand_count = calloc(tt * mm, sizeof(int32_t));
    b->wanted = calloc(mm * (size_t)nblocks, 1);
    b->pairs = malloc(sizeof(int64_t) * mm * (size_t)nblocks);
    b->best_val = malloc(sizeof(float) * tt * mm * 16);
    b->best_col = malloc(sizeof(int32_t) * tt * mm * 16);
    if (!b->row_scale || !b->threshold || !b->cand_col || !b->cand_hi || !b->cand_count || !b->wanted || !b->pairs ||
        !b->best_val || !b->best_col) {
        screen_buffers_free(b);
        return -1;
    }
    for (size_t i = 0; i < tt * mm; ++i) b->threshold[i] = -FLT_MAX;
    return 0;
}

/* Whether a float is finite and below 2^100 in magnitude, by its bits: -ffast-math lets the compiler assume
 * isfinite() is always true. */
static inline int screen_sane(double v) {
    float f = (float)v;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return ((bits >> 23) & 0xffu) < 127u + 100u;
}

/* Row r of x (k values): its largest |x| into *amax and its bound's factors into buf (row_scale = c max |x|, enlarged
 * for its float32 rounding; row_slack for flushed subnormals, < 2^-126 (1 + max |w| + max |x|) a term); returns
 * whether an integer screen may take the row: finite, below 2^100, and a max of at least 2^-60 (below, a zero row
 * among them, a step would be subnormal: the exact path takes it). */
static inline int screen_row(const float *x, int64_t k, double c, float w_abs_max, const ScreenBuffers *buf,
                             int64_t r, double *amax_out) {
    double amax = 0.0, total = 0.0; /* the total carries a NaN, which the max would skip */
    for (int64_t kk = 0; kk < k; ++kk) {
        const double v = fabs((double)x[kk]);
        amax = v > amax ? v : amax;
        total += v;
    }
    buf->row_scale[r] = (float)(c * amax * (1.0 + 1e-6));
    buf->row_slack[r] = (float)((double)k * 0x1p-124 * (1.0 + (double)w_abs_max + amax));
    *amax_out = amax;
    return screen_sane(amax) & screen_sane(total) & (amax >= 0x1p-60);
}

/* Thread tid's screening state over the buffers, with the columns' norms w_norm. */
static inline ScreenState screen_state(const ScreenBuffers *b, const float *w_norm, int64_t tid, int64_t m) {
    return (ScreenState){w_norm,
                         b->row_scale,
                         b->row_slack,
                         b->threshold + tid * m,
                         b->cand_col + tid * m * SCREEN_CAP,
                         b->cand_hi + tid * m * SCREEN_CAP,
                         b->cand_count + tid * m,
                         0};
}

#if GEMM_VEC_BITS == 512
/* One row's sums S of 16 columns from col (the lanes of mask) into its threshold and candidates, with the bound
 * b = row_scale w_norm + row_slack + extra (extra: a screen's per-column term, gemm_codes8_screen_vnni.h). */
static void screen_store16_plus(ScreenState *s, int64_t row, int64_t col, __m512 acc, __m512 extra, __mmask16 mask) {
    const __m512 b = _mm512_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(s->row_scale[row]),
                                                   _mm512_maskz_loadu_ps(mask, s->w_norm + col),
                                                   _mm512_set1_ps(s->row_slack[row])),
                                   extra);
    const __m512 lo = _mm512_sub_ps(acc, b), hi = _mm512_add_ps(acc, b);
    const float lo_max = _mm512_mask_reduce_max_ps(mask, lo);
    if (lo_max > s->threshold[row]) s->threshold[row] = lo_max;
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(mask, hi, _mm512_set1_ps(s->threshold[row]), _CMP_GE_OQ);
    if (keep == 0) return;
    if (s->cand_count[row] + 16 > SCREEN_CAP && screen_compact(s, row) + 16 > SCREEN_CAP) {
        s->overflow = 1;
        return;
    }
    const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32((int32_t)col),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const int64_t at = row * SCREEN_CAP + s->cand_count[row];
    _mm512_mask_compressstoreu_epi32(s->cand_col + at, keep, cols);
    _mm512_mask_compressstoreu_ps(s->cand_hi + at, keep, hi);
    s->cand_count[row] += __builtin_popcount((unsigned)keep);
}

static inline void screen_store16(ScreenState *s, int64_t row, int64_t col, __m512 acc, __mmask16 mask) {
    screen_store16_plus(s, row, col, acc, _mm512_setzero_ps(), mask);
}
#endif

#if GEMM_VEC_BITS == 256
/* screen_store16 for a block's 24 columns [col, col + 24) of one row, acc[j] holding columns col + 8j .. + 7
 * (AVX2: no compress store; a kept column is rare). */
static void screen_store24(ScreenState *s, int64_t row, int64_t col, const __m256 acc[3], int64_t n) {
    if (col >= n) return;
    const __m256 scale = _mm256_set1_ps(s->row_scale[row]), slack = _mm256_set1_ps(s->row_slack[row]);
    const __m256 lowest = _mm256_set1_ps(-FLT_MAX);
    const int64_t valid = n - col < 24 ? n - col : 24;
    const uint32_t valid_bits = (uint32_t)((1ull << valid) - 1u);
    __m256 hi[3], lo_max = lowest;
    for (int j = 0; j < 3; ++j) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(valid - 8 * j)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 b = _mm256_fmadd_ps(scale, _mm256_maskload_ps(s->w_norm + col + 8 * j, mask), slack);
        lo_max = _mm256_max_ps(lo_max, _mm256_blendv_ps(lowest, _mm256_sub_ps(acc[j], b), _mm256_castsi256_ps(mask)));
        hi[j] = _mm256_add_ps(acc[j], b);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(lo_max), _mm256_extractf128_ps(lo_max, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float row_max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    if (row_max > s->threshold[row]) s->threshold[row] = row_max;
    const __m256 t = _mm256_set1_ps(s->threshold[row]);
    uint32_t keep = 0;
    for (int j = 0; j < 3; ++j)
        keep |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(hi[j], t, _CMP_GE_OQ)) << (8 * j);
    keep &= valid_bits;
    if (keep == 0) return;
    if (s->cand_count[row] + 24 > SCREEN_CAP && screen_compact(s, row) + 24 > SCREEN_CAP) {
        s->overflow = 1;
        return;
    }
    float his[24];
    for (int j = 0; j < 3; ++j) _mm256_storeu_ps(his + 8 * j, hi[j]);
    const int64_t at = row * SCREEN_CAP + s->cand_count[row];
    int32_t kept = 0;
    for (; keep != 0; keep &= keep - 1) {
        const int lane = __builtin_ctz(keep);
        s->cand_col[at + kept] = (int32_t)col + lane;
        s->cand_hi[at + kept++] = his[lane];
    }
    s->cand_count[row] += kept;
}
#endif

/* After a screen: the (block, row) pairs to rescore, block-major (block * m + row), into buf->pairs; returns their
 * count. A row's candidates are those whose S + b reaches the row's threshold over all threads (as the screening
 * tiles left them). */
static inline int64_t screen_pairs(const ScreenBuffers *buf, int64_t threads, int64_t m, int64_t nblocks,
                                   int64_t block_n) {
    const float *threshold = buf->threshold, *cand_hi = buf->cand_hi;
    const int32_t *cand_col = buf->cand_col, *cand_count = buf->cand_count;
    uint8_t *wanted = buf->wanted;
    int64_t *pairs = buf->pairs;
    for (int64_t r = 0; r < m; ++r) {
        float t = -FLT_MAX;
        for (int64_t p = 0; p < threads; ++p) t = threshold[p * m + r] > t ? threshold[p * m + r] : t;
        for (int64_t p = 0; p < threads; ++p) {
            const int64_t list = (p * m + r) * SCREEN_CAP;
            for (int32_t i = 0; i < cand_count[p * m + r]; ++i)
                if (cand_hi[list + i] >= t) wanted[r * nblocks + cand_col[list + i] / block_n] = 1;
        }
    }
    int64_t npairs = 0;
    for (int64_t b = 0; b < nblocks; ++b)
        for (int64_t r = 0; r < m; ++r)
            if (wanted[r * nblocks + b]) pairs[npairs++] = b * m + r;
    return npairs;
}
#endif
