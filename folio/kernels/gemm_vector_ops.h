/* The GEMM tiles' vector operations for one width (gv_*) and their epilogue store (store16 / gemm_store8):
 * AVX-512 (16 lanes) or AVX2 + FMA (8 lanes). Included by cpu_gemm.c after its Epilogue and store_scalar. */
#if GEMM_VEC_BITS == 512
/* Stores 16 accumulated columns [col, col + 16) of one row, masked to the columns < n. */
static inline void store16(const Epilogue *e, int64_t row, int64_t col, __m512 acc) {
    if (col >= e->n) return;
    const __mmask16 mask = e->n - col >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (e->n - col)) - 1);
#ifdef __AVX512BF16__
    if (e->screen != NULL) {
        screen_store16(e->screen, row, col, acc, mask);
        return;
    }
#endif
    if (e->bias != NULL) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, e->bias + col));
    if (e->best_val != NULL) { /* columns ascend per lane, so a strict > keeps the first of equal values */
        float *best = e->best_val + row * 16;
        int32_t *best_col = e->best_col + row * 16;
        const __mmask16 better = _mm512_mask_cmp_ps_mask(mask, acc, _mm512_loadu_ps(best), _CMP_GT_OQ);
        _mm512_mask_storeu_ps(best, better, acc);
        const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32((int32_t)col),
                                              _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        _mm512_mask_storeu_epi32(best_col, better, cols);
    } else if (e->out_is_bf16) {
        _mm256_mask_storeu_epi16((uint16_t *)e->out + row * e->ldc + col, mask, f32x16_to_bf16(acc));
    } else {
        _mm512_mask_storeu_ps((float *)e->out + row * e->ldc + col, mask, acc);
    }
}

/* The vector operations the tiles use (gv_: GEMM vector), for one width (the AVX-512 tiles expand to the intrinsics they always had). */
typedef __m512 gv_f32;
typedef __m512i gv_i32;
#define GV_LANES 16
#define gv_zero() _mm512_setzero_ps()
#define gv_load(p) _mm512_loadu_ps(p)
#define gv_load_i32(p) _mm512_loadu_si512(p)
#define gv_set1(v) _mm512_set1_ps(v)
#define gv_set1_i32(v) _mm512_set1_epi32(v)
#define gv_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define gv_shl16(v) _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
#define gv_high16(v) _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int32_t)0xffff0000u)))
#define gv_store store16
#define gv_keep_in_register(v) (void)(v)
/* Element-wise, for the packers' exactness checks and the GGUF dequantizer (not the tiles). */
#define gv_storeu(p, v) _mm512_storeu_ps(p, v)
#define gv_add(a, b) _mm512_add_ps(a, b)
#define gv_sub(a, b) _mm512_sub_ps(a, b)
#define gv_mul(a, b) _mm512_mul_ps(a, b)
#define gv_div(a, b) _mm512_div_ps(a, b)
#define gv_max(a, b) _mm512_max_ps(a, b) /* b where a is NaN */
#define gv_min(a, b) _mm512_min_ps(a, b)
#define gv_round(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define gv_bits_differ(a, b) (_mm512_cmpneq_epi32_mask(_mm512_castps_si512(a), _mm512_castps_si512(b)) != 0)
#define gv_no_fma(v) __asm__("" : "+v"(v)) /* a product rounded on its own: never fused into the next add */
/* Integer values in -128..127 of v (4-bit codes, int8), stored as GV_LANES bytes, as both widths store them. */
static inline void gv_store_bytes(void *p, __m512 v) {
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
}
#elif GEMM_VEC_BITS == 256
/* 8 float32 rounded to bfloat16 (nearest even, as f32_to_bf16 and torch; NaN stays NaN) */
static inline __m128i gemm_f32x8_to_bf16(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i half = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    half = _mm256_blendv_epi8(half, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* every lane is below 2^16, so the unsigned saturation of packus keeps it */
    return _mm_packus_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

/* Stores 8 accumulated columns [col, col + 8) of one row, masked to the columns < n (AVX2 has masked 32-bit
 * loads and stores only: a bfloat16 tail goes through a small buffer). The arg-max keeps 16 lanes per row as
 * the AVX-512 epilogue does; col is a multiple of 8, so these columns are lanes col % 16 .. col % 16 + 7. */
static inline void gemm_store8(const Epilogue *e, int64_t row, int64_t col, __m256 acc) {
    if (col >= e->n) return;
    const int64_t valid = e->n - col < 8 ? e->n - col : 8;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)valid), lanes);
    if (e->bias != NULL) acc = _mm256_add_ps(acc, _mm256_maskload_ps(e->bias + col, mask));
    if (e->best_val != NULL) { /* columns ascend per lane, so a strict > keeps the first of equal values */
        float *best = e->best_val + row * 16 + col % 16;
        int32_t *best_col = e->best_col + row * 16 + col % 16;
        const __m256 greater = _mm256_cmp_ps(acc, _mm256_loadu_ps(best), _CMP_GT_OQ); /* false for NaN */
        const __m256i better = _mm256_and_si256(_mm256_castps_si256(greater), mask);
        /* blended and stored whole (the 8 lanes lie inside the row's 16) instead of two masked stores: the arg-max
         * ran 1-7% faster so on Zen 3 (docs/performance.md, session 42) */
        const __m256i cols = _mm256_add_epi32(_mm256_set1_epi32((int32_t)col), lanes);
        _mm256_storeu_ps(best, _mm256_blendv_ps(_mm256_loadu_ps(best), acc, _mm256_castsi256_ps(better)));
        _mm256_storeu_si256((__m256i *)best_col,
                            _mm256_blendv_epi8(_mm256_loadu_si256((const __m256i *)best_col), cols, better));
    } else if (e->out_is_bf16) {
        uint16_t *dst = (uint16_t *)e->out + row * e->ldc + col;
        const __m128i half = gemm_f32x8_to_bf16(acc);
        if (valid == 8) {
            _mm_storeu_si128((__m128i *)dst, half);
        } else {
            uint16_t tail[8];
            _mm_storeu_si128((__m128i *)tail, half);
            memcpy(dst, tail, sizeof(uint16_t) * valid);
        }
    } else if (valid == 8) {
        _mm256_storeu_ps((float *)e->out + row * e->ldc + col, acc);
    } else {
        _mm256_maskstore_ps((float *)e->out + row * e->ldc + col, mask, acc);
    }
}

typedef __m256 gv_f32;
typedef __m256i gv_i32;
#define GV_LANES 8
#define gv_zero() _mm256_setzero_ps()
#define gv_load(p) _mm256_loadu_ps(p)
#define gv_load_i32(p) _mm256_loadu_si256((const __m256i *)(p))
#define gv_set1(v) _mm256_set1_ps(v)
#define gv_set1_i32(v) _mm256_set1_epi32(v)
#define gv_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define gv_shl16(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define gv_high16(v) _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int32_t)0xffff0000u)))
#define gv_store gemm_store8
/* Holds a weight vector in a register: else gcc folds its load into each row's FMA (4 loads of it per k instead of
 * one), and the tile ran at 87 GFLOP/s per core against 113-125 for oneDNN's AVX2 kernel (Zen 5, avx2 build). */
#define gv_keep_in_register(v) __asm__("" : "+x"(v))
#define gv_storeu(p, v) _mm256_storeu_ps(p, v)
#define gv_add(a, b) _mm256_add_ps(a, b)
#define gv_sub(a, b) _mm256_sub_ps(a, b)
#define gv_mul(a, b) _mm256_mul_ps(a, b)
#define gv_div(a, b) _mm256_div_ps(a, b)
#define gv_max(a, b) _mm256_max_ps(a, b) /* b where a is NaN */
#define gv_min(a, b) _mm256_min_ps(a, b)
#define gv_round(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define gv_bits_differ(a, b) \
    (_mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b))) != -1)
#define gv_no_fma(v) __asm__("" : "+x"(v))
/* Integer values in -128..127 of v, stored as GV_LANES bytes (as the AVX-512 body; here by signed saturation). */
static inline void gv_store_bytes(void *p, __m256 v) {
    const __m256i q = _mm256_cvtps_epi32(v);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w16, w16));
}
#endif
