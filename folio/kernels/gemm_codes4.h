/* Float32 weights kept as 4-bit codes: the float32 GEMM over a sixth of the bytes, with the identical result.
 *
 * Why: a decode step of a few rows streams every projection weight from memory once, and in float32 that stream is
 * the step (SmolLM2-135M: 424 MB a step). Weights dequantized from a GGUF's Q4_1 tensors are, in every group of 32
 * consecutive k of one output column, a value m plus a multiple d * q of a step d, q in 0..15, each rounded to
 * float32 (fl(fl(d * q) + m), as gguf_dequant.py and ggml compute it). Such a weight is kept as its codes and the
 * two float32 numbers per group (6 bits a weight) and widened back to the same float32 values as the GEMM reads it:
 * in registers inside the tile where a chunk of rows is one tile (a decode step of a few requests), else once per
 * block into a float32 block in L2 that the float32 tiles then read. Either way the same products and sums in the
 * same order as the float32 layout, so the same bits out, from 80 MB a step instead of 424.
 * Packing checks every weight element: a weight with any group that does not reproduce bit for bit (another
 * quantization, a fine-tuned float32 weight) is refused, and the caller packs it as float32.
 *
 * Layout (after the float32 layout of cpu_gemm.c, for the same BLOCK_N): block b of BLOCK_N output columns, then
 * group g of 32 k, is CODES4_GROUP_BYTES bytes:
 *   float32 d[BLOCK_N], float32 m[BLOCK_N], then 16 k pairs p of BLOCK_N bytes: byte c of pair p holds the code of
 *   k = 32 g + 2 p in its low nibble and of k = 32 g + 2 p + 1 in its high nibble, for column b * BLOCK_N + c.
 * K must be a multiple of 32; columns past N are zero (d = m = 0). */
#define CODES4_GROUP 32
/* gemm_body_codes4's `dot`: where more rows than one vector tile may run (llama_cpu.c's layer bits use the same) */
#define CODES4_ON_AMX 16
#define CODES4_ON_VNNI 32
#define CODES4_GROUP_BYTES (BLOCK_N * (2 * (int64_t)sizeof(float) + CODES4_GROUP / 2))

static inline int64_t codes4_block_bytes(int64_t k) { return k / CODES4_GROUP * CODES4_GROUP_BYTES; }

int64_t folio_gemm_packed_bytes_codes4(int64_t n, int64_t k) {
    return k % CODES4_GROUP ? -1 : num_blocks(n) * codes4_block_bytes(k);
}

/* fl(fl(d * q) + m) with two roundings, never one fused multiply-add (-ffast-math would otherwise contract it). */
static inline float codes4_value(float d, int32_t q, float m) {
    float p = d * (float)q;
    __asm__("" : "+g"(p));
    return p + m;
}

static inline uint32_t codes4_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

/* d rounded to the nearest float16 (ties to even), as a float32: the step a GGUF file stores. */
static inline float codes4_round_f16(float d) {
    if (!(d > 0.0f) || d >= 65520.0f) return d; /* from 65520 on, float16 overflows: no such step */
    if (d < 6.103515625e-05f) return rintf(d * 16777216.0f) / 16777216.0f; /* subnormal float16: multiples of 2^-24 */
    uint32_t u = codes4_bits(d);
    u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

/* The codes of one group (32 values of one column) for step d and offset m, or 0 if any value is not exactly
 * fl(fl(d * q) + m) for its nearest code q in 0..15. */
static int codes4_try_scalar(const float *v, float d, float m, uint8_t *q) {
    for (int i = 0; i < CODES4_GROUP; ++i) {
        float f = d > 0.0f ? rintf((v[i] - m) / d) : 0.0f;
        if (!(f >= 0.0f)) f = 0.0f; /* NaN too: then the check below fails */
        if (f > 15.0f) f = 15.0f;
        q[i] = (uint8_t)f;
        if (codes4_bits(codes4_value(d, q[i], m)) != codes4_bits(v[i])) return 0;
    }
    return 1;
}

/* The same, a vector at a time (a model's load checks every weight: the scalar loop was 6.8 ns a weight here, most of
 * a start's packing). gv_max takes 0 for a NaN quotient, as the scalar clamp does. */
#if GEMM_VEC_BITS > 0
static int codes4_try(const float *v, float d, float m, uint8_t *q) {
    if (!(d > 0.0f)) return codes4_try_scalar(v, d, m, q);
    const gv_f32 dv = gv_set1(d), mv = gv_set1(m), top = gv_set1(15.0f);
    int bad = 0;
    for (int i = 0; i < CODES4_GROUP; i += GV_LANES) {
        const gv_f32 x = gv_load(v + i);
        const gv_f32 f = gv_min(gv_max(gv_round(gv_div(gv_sub(x, mv), dv)), gv_zero()), top);
        gv_f32 p = gv_mul(dv, f);
        gv_no_fma(p); /* two roundings, as codes4_value */
        bad |= gv_bits_differ(gv_add(p, mv), x);
        gv_store_bytes(q + i, f);
    }
    return !bad;
}
#else
#define codes4_try codes4_try_scalar
#endif

/* Packs W [n, k] (rows ldw apart) group by group: store_column(v, group, c) writes column c of a group of 32 k from
 * its 32 values v (NULL past N: zeros) into the group's bytes, or returns 0 where they are not exactly codes.
 * Returns 0, or -1 (packed left undefined) if k is not whole groups or some column refused. */
static int codes_pack(const float *w, int64_t ldw, int64_t n, int64_t k, uint8_t *packed, int64_t group_bytes,
                      int (*store_column)(const float *v, uint8_t *group, int64_t c)) {
    if (k % CODES4_GROUP) return -1;
    const int64_t groups = k / CODES4_GROUP;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int64_t b = 0; b < num_blocks(n); ++b)
        for (int64_t c = 0; c < BLOCK_N && !failed; ++c) /* a row at a time: its groups are read in order */
            for (int64_t g = 0; g < groups && !failed; ++g) {
                const int64_t row = b * BLOCK_N + c;
                const float *v = row < n ? w + row * ldw + g * CODES4_GROUP : NULL;
                failed = !store_column(v, packed + (b * groups + g) * group_bytes, c);
            }
    return failed ? -1 : 0;
}

/* A column of a 4-bit group: d, m and the nibbles (see the layout above). */
static int codes4_store_column(const float *v, uint8_t *group, int64_t c) {
    float *d_out = (float *)group, *m_out = d_out + BLOCK_N;
    uint8_t *codes = (uint8_t *)(m_out + BLOCK_N);
    uint8_t q[CODES4_GROUP] = {0};
    float d = 0.0f, m = 0.0f;
    if (v != NULL) {
        float lo = v[0], hi = v[0];
        for (int i = 1; i < CODES4_GROUP; ++i) {
            lo = v[i] < lo ? v[i] : lo;
            hi = v[i] > hi ? v[i] : hi;
        }
        m = lo;
        const float step = (hi - lo) / 15.0f;
        d = codes4_round_f16(step);
        if (!codes4_try(v, d, m, q)) {
            d = step;
            if (!codes4_try(v, d, m, q)) return 0;
        }
    }
    d_out[c] = d;
    m_out[c] = m;
    for (int p = 0; p < CODES4_GROUP / 2; ++p) codes[p * BLOCK_N + c] = (uint8_t)(q[2 * p] | (q[2 * p + 1] << 4));
    return 1;
}

int folio_gemm_pack_codes4(const float *w, int64_t ldw, int64_t n, int64_t k, uint8_t *packed) {
    return codes_pack(w, ldw, n, k, packed, CODES4_GROUP_BYTES, codes4_store_column);
}

/* Block `src` (codes) -> its float32 layout in `dst` ([k][BLOCK_N], as folio_gemm_pack_f32 lays it out). */
static void codes4_widen_block(const uint8_t *src, int64_t k, float *dst) {
    for (int64_t g = 0; g < k / CODES4_GROUP; ++g, src += CODES4_GROUP_BYTES, dst += CODES4_GROUP * BLOCK_N) {
        const float *d = (const float *)src, *m = d + BLOCK_N;
        const uint8_t *codes = (const uint8_t *)(m + BLOCK_N);
#if GEMM_VEC_BITS == 512
        for (int j = 0; j < 3; ++j) {
            const __m512 dv = _mm512_loadu_ps(d + 16 * j), mv = _mm512_loadu_ps(m + 16 * j);
            for (int p = 0; p < CODES4_GROUP / 2; ++p) {
                const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + p * BLOCK_N + 16 * j)));
                __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), dv);
                __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), dv);
                __asm__("" : "+v"(lo), "+v"(hi)); /* two roundings: no fused multiply-add */
                _mm512_storeu_ps(dst + (2 * p) * BLOCK_N + 16 * j, _mm512_add_ps(lo, mv));
                _mm512_storeu_ps(dst + (2 * p + 1) * BLOCK_N + 16 * j, _mm512_add_ps(hi, mv));
            }
        }
#elif GEMM_VEC_BITS == 256
        for (int j = 0; j < 3; ++j) {
            const __m256 dv = _mm256_loadu_ps(d + 8 * j), mv = _mm256_loadu_ps(m + 8 * j);
            for (int p = 0; p < CODES4_GROUP / 2; ++p) {
                const __m256i bytes =
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + p * BLOCK_N + 8 * j)));
                __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))), dv);
                __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), dv);
                __asm__("" : "+x"(lo), "+x"(hi)); /* two roundings: no fused multiply-add */
                _mm256_storeu_ps(dst + (2 * p) * BLOCK_N + 8 * j, _mm256_add_ps(lo, mv));
                _mm256_storeu_ps(dst + (2 * p + 1) * BLOCK_N + 8 * j, _mm256_add_ps(hi, mv));
            }
        }
#else
        for (int p = 0; p < CODES4_GROUP / 2; ++p)
            for (int64_t c = 0; c < BLOCK_N; ++c) {
                const uint8_t byte = codes[p * BLOCK_N + c];
                dst[(2 * p) * BLOCK_N + c] = codes4_value(d[c], byte & 15, m[c]);
                dst[(2 * p + 1) * BLOCK_N + c] = codes4_value(d[c], byte >> 4, m[c]);
            }
#endif
    }
}

#if GEMM_VEC_BITS > 0
/* The 3 x 2 weight vectors of one k pair of a group (k even: lo, k odd: hi), widened in registers. */
#if GEMM_VEC_BITS == 512
#define CODES4_BYTES(p, j) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((p) + 16 * (j))))
#define CODES4_LOW(v) _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)))
#define CODES4_HIGH(v) _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))
#else
#define CODES4_BYTES(p, j) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((p) + 8 * (j))))
#define CODES4_LOW(v) _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)))
#define CODES4_HIGH(v) _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))
#endif

/* A tile of MR rows straight from the codes, the weights widened in registers (for a chunk of one tile, where a
 * widened block would be used once): per k the same FMAs in the same order as tile_f32_MR, so the same sums. */
#define DEFINE_TILE_CODES4(MR)                                                                                    \
    static void tile_codes4_##MR(const float *x, int64_t lda, const uint8_t *wb, int64_t k, const Epilogue *e,   \
                                 int64_t row0, int64_t col0, NextBlock nb, SidePrefetch *side) {                 \
        TILE_START(MR)                                                                                            \
        int64_t s = 0;                                                                                            \
        for (int64_t g = 0; g < k / CODES4_GROUP; ++g) {                                                          \
            const uint8_t *group = wb + g * CODES4_GROUP_BYTES;                                                   \
            const float *d = (const float *)group, *m = d + BLOCK_N;                                              \
            const uint8_t *codes = (const uint8_t *)(m + BLOCK_N);                                                \
            for (int p = 0; p < CODES4_GROUP / 2; ++p, ++s) {                                                     \
                const uint8_t *pair = codes + p * BLOCK_N;                                                        \
                _mm_prefetch((const char *)group + CODES4_GROUP_BYTES + 64 * p, _MM_HINT_T0);                     \
                TILE_OTHER_PREFETCH(s)                                                                            \
                gv_f32 lo[3], hi[3];                                                                              \
                _Pragma("GCC unroll 3") for (int j = 0; j < 3; ++j) {                                             \
                    const gv_i32 bytes = CODES4_BYTES(pair, j);                                                  \
                    const gv_f32 dv = gv_load(d + GV_LANES * j);                                                 \
                    lo[j] = gv_mul(CODES4_LOW(bytes), dv);                                                        \
                    hi[j] = gv_mul(CODES4_HIGH(bytes), dv);                                                       \
                    gv_no_fma(lo[j]);                                                                             \
                    gv_no_fma(hi[j]);                                                                             \
                    const gv_f32 mv = gv_load(m + GV_LANES * j);                                                 \
                    lo[j] = gv_add(lo[j], mv);                                                                    \
                    hi[j] = gv_add(hi[j], mv);                                                                    \
                }                                                                                                 \
                const int64_t kk = g * CODES4_GROUP + 2 * p;                                                      \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                           \
                    const gv_f32 a = gv_set1(x[i * lda + kk]);                                                  \
                    acc[i][0] = gv_fma(a, lo[0], acc[i][0]);                                                     \
                    acc[i][1] = gv_fma(a, lo[1], acc[i][1]);                                                     \
                    acc[i][2] = gv_fma(a, lo[2], acc[i][2]);                                                     \
                }                                                                                                 \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                           \
                    const gv_f32 a = gv_set1(x[i * lda + kk + 1]);                                              \
                    acc[i][0] = gv_fma(a, hi[0], acc[i][0]);                                                     \
                    acc[i][1] = gv_fma(a, hi[1], acc[i][1]);                                                     \
                    acc[i][2] = gv_fma(a, hi[2], acc[i][2]);                                                     \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        TILE_FINISH(MR)                                                                                           \
    }
FOR_EACH_TILE_ROWS(DEFINE_TILE_CODES4)

static void tile_codes4(const float *x, int64_t lda, const uint8_t *wb, int64_t k, int64_t rows, const Epilogue *e,
                        int64_t row0, int64_t col0, NextBlock nb, SidePrefetch *side) {
#define TILE_CASE(MR)                                                                                             \
    case MR: tile_codes4_##MR(x, lda, wb, k, e, row0, col0, nb, side); return;
    switch (rows) {
        FOR_EACH_TILE_ROWS(TILE_CASE)
    default: return;
    }
#undef TILE_CASE
}
#endif

/* A thread's buffer, reused from call to call and grown to the largest size asked: a fresh allocation of a few
 * hundred KB per call would be mapped and faulted in again every time. NULL where memory ran out. */
typedef struct {
    uint8_t *data;
    int64_t bytes;
} ThreadScratch;

static void *thread_scratch(ThreadScratch *s, int64_t bytes) {
    if (s->bytes < bytes) {
        free(s->data);
        s->data = aligned_alloc(64, (size_t)((bytes + 63) & ~(int64_t)63));
        s->bytes = s->data != NULL ? bytes : 0;
    }
    return s->data;
}

static _Thread_local ThreadScratch codes4_scratch; /* each thread's widened float32 block (and the 8-bit arg-max's) */

#include "gemm_codes4_amx.h"
#include "gemm_codes4_vnni.h"

/* gemm_body_f32 over codes: each work item widens its block once into the thread's float32 block (L2), then runs
 * the float32 tiles of its chunk's rows over it. The next block's codes are pulled toward L2 meanwhile. With `dot`
 * (CODES4_ON_AMX on the amx tier, CODES4_ON_VNNI where built with VNNI and BF16 and no AMX), more rows than one
 * vector tile run on that unit instead (gemm_codes4_amx.h, gemm_codes4_vnni.h): float32 accuracy, not the float32
 * layout's bits. */
static void gemm_body_codes4(const float *x, int64_t lda, const uint8_t *packed, const float *bias, void *out,
                             int out_is_bf16, int64_t ldc, int64_t m, int64_t n, int64_t k, SidePrefetch *side,
                             int dot) {
#if GEMM_AMX
    if ((dot & CODES4_ON_AMX) && m > TILE_M) {
        gemm_body_codes4_amx(x, lda, packed, bias, out, out_is_bf16, ldc, m, n, k, side);
        return;
    }
#endif
#if GEMM_VNNI
    if ((dot & CODES4_ON_VNNI) && m > TILE_M) {
        gemm_body_codes4_vnni(x, lda, packed, bias, out, out_is_bf16, ldc, m, n, k, side);
        return;
    }
#endif
    (void)dot;
    const Epilogue e = {out, out_is_bf16, ldc, bias, n, NULL, NULL, NULL};
    const int64_t blocks = num_blocks(n), chunks = (m + CHUNK_M - 1) / CHUNK_M;
    const int64_t chunk_rows = ((m + chunks - 1) / chunks + TILE_M - 1) / TILE_M * TILE_M;
    const int64_t block_bytes = codes4_block_bytes(k);
    float *wide = thread_scratch(&codes4_scratch, k * BLOCK_N * (int64_t)sizeof(float));
    if (wide == NULL) abort(); /* a few hundred KB per thread, once */
    GEMM_ITEMS
    for (int64_t item = 0; item < blocks * chunks; ++item) {
        const int64_t b = item % blocks, chunk = item / blocks;
        const uint8_t *next = item + 1 < blocks * chunks ? packed + ((item + 1) % blocks) * block_bytes : NULL;
        const int64_t row_start = chunk * chunk_rows;
        const int64_t row_end = row_start + chunk_rows < m ? row_start + chunk_rows : m;
        const int64_t ntiles = row_end > row_start ? (row_end - row_start + TILE_M - 1) / TILE_M : 0;
        if (ntiles == 0) continue;
#if GEMM_VEC_BITS > 0
        if (ntiles == 1) { /* one tile: widened in registers, no block to keep */
            const NextBlock nb = {(const char *)next, next != NULL ? (const char *)next + block_bytes : NULL, 0};
            tile_codes4(x + row_start * lda, lda, packed + b * block_bytes, k, row_end - row_start, &e, row_start,
                        b * BLOCK_N, nb, side);
            continue;
        }
#endif
        codes4_widen_block(packed + b * block_bytes, k, wide);
        for (int64_t t = 0; t < ntiles; ++t) {
            const int64_t row = row_start + t * TILE_M;
            const int64_t rows = row_end - row < TILE_M ? row_end - row : TILE_M;
            /* (a lone tile reaches here only on the generic tier, whose plain C tile prefetches nothing) */
            const NextBlock nb = next_block_share(next, block_bytes, t, ntiles);
            tile_f32(x + row * lda, lda, wide, k, rows, &e, row, b * BLOCK_N, nb, side);
        }
    }
}

void folio_gemm_codes4(const float *x, int64_t lda, const uint8_t *packed, const float *bias, void *out,
                       int out_is_bf16, int64_t ldc, int64_t m, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_blocks(n) * ((m + CHUNK_M - 1) / CHUNK_M) > 1)
    gemm_body_codes4(x, lda, packed, bias, out, out_is_bf16, ldc, m, n, k, NULL, 0);
}

/* folio_gemm_codes4 with more rows than one vector tile on AMX where this library has it (cpu_amx_float32) */
void folio_gemm_codes4_amx(const float *x, int64_t lda, const uint8_t *packed, const float *bias, void *out,
                           int out_is_bf16, int64_t ldc, int64_t m, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_blocks(n) * ((m + CHUNK_M - 1) / CHUNK_M) > 1)
    gemm_body_codes4(x, lda, packed, bias, out, out_is_bf16, ldc, m, n, k, NULL, CODES4_ON_AMX);
}

int folio_gemm_codes4_has_amx(void) { return GEMM_AMX; }

/* folio_gemm_codes4 with more rows than one vector tile through vpdpbusd where this library has it
 * (cpu_vnni_float32) */
void folio_gemm_codes4_vnni(const float *x, int64_t lda, const uint8_t *packed, const float *bias, void *out,
                            int out_is_bf16, int64_t ldc, int64_t m, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_blocks(n) * ((m + CHUNK_M - 1) / CHUNK_M) > 1)
    gemm_body_codes4(x, lda, packed, bias, out, out_is_bf16, ldc, m, n, k, NULL, CODES4_ON_VNNI);
}

int folio_gemm_codes4_has_vnni(void) { return GEMM_VNNI; }
