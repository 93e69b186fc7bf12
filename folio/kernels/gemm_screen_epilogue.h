/* The screening epilogue of the float32 LM head's bfloat16 screen (gemm_argmax_screen.h says why and how): where
 * a bfloat16 tile's sums go instead of memory. Included by cpu_gemm.c before its tiles' store16. */
#if GEMM_VEC_BITS == 512 && defined(__AVX512BF16__)
#define SCREEN_CAP 2048 /* candidate slots per row per thread before the exact path takes over */

/* What the screening epilogue (screen_store16) reads and writes: one per thread. */
typedef struct ScreenState {
    const float *w_norm;    /* [n] an upper bound of ||w_v||_2 */
    const float *row_scale; /* [m] c ||x_r||: b_v = row_scale[r] w_norm[v] + row_slack[r] */
    const float *row_slack; /* [m] */
    float *threshold;       /* [m] this thread's running max over its columns of S - b */
    int32_t *cand_col;      /* [m][SCREEN_CAP] columns with S + b >= the threshold when seen */
    float *cand_hi;         /* [m][SCREEN_CAP] their S + b */
    int32_t *cand_count;    /* [m] */
    int overflow;           /* a row ran out of slots even after dropping what the threshold excludes */
} ScreenState;

/* Keeps row's candidates whose S + b still reaches the threshold; returns how many are left. */
static int32_t screen_compact(ScreenState *s, int64_t row) {
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

static void screen_store16(ScreenState *s, int64_t row, int64_t col, __m512 acc, __mmask16 mask) {
    const __m512 b = _mm512_fmadd_ps(_mm512_set1_ps(s->row_scale[row]), _mm512_maskz_loadu_ps(mask, s->w_norm + col),
                                     _mm512_set1_ps(s->row_slack[row]));
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

/* Whether a float is finite and below 2^100 in magnitude, by its bits: -ffast-math lets the compiler assume
 * isfinite() is always true. */
static inline int screen_sane(double v) {
    float f = (float)v;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return ((bits >> 23) & 0xffu) < 127u + 100u;
}
#endif

