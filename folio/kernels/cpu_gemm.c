/* Linear layers on the CPU: y = x @ W^T (+ bias) with W packed once at load time, for bfloat16 and float32.
 *
 * Why our own GEMM: at a decode step's shapes (M = 1..64 rows, K = 576..1536) oneDNN's packed linear reached
 * 320-390 GFLOP/s in bfloat16 at M = 64 and 80-110 at M = 4; this kernel, written for exactly those shapes,
 * reaches 400-420 and 110-180 on the same machine, and 450 (the vdpbf16ps peak of 2 cores) at M = 2048
 * (docs/performance.md, benchmarks/cpu_gemm.py).
 *
 * Packed layout: W [N, K] is cut into column blocks of BLOCK_N output columns (3 vectors: 48 with AVX-512, 24 with
 * AVX2); block b is stored contiguously, k-major, so the kernel streams it front to back:
 *   float32   packed[b][k][c]          = W[b * BLOCK_N + c][k]             (BLOCK_N floats per k)
 *   bfloat16  packed[b][k / 2][c][k % 2] = W[b * BLOCK_N + c][k]           (pairs of k side by side: the operand
 *             layout of vdpbf16ps, which multiplies bf16 pairs and adds both products into a float32 lane)
 * Columns past N and the odd k of an odd K are zero.
 *
 * Micro-kernel: a tile of up to TILE_M rows x BLOCK_N columns keeps 3 TILE_M float32 accumulator vectors in
 * registers; for each k (or k pair) it loads the block's 3 weight vectors once and multiplies them with each row's
 * broadcast x value (TILE_M x 3 FMAs per 3 loads). The weights of a block are read from memory once per 256 rows
 * and reused from L1/L2 for every row tile; x rows come from L1.
 * bfloat16 without AVX512-BF16 widens in registers: a 32-bit lane of the pair layout holds the even k in its low
 * half and the odd k in its high half, so (bits << 16) is the even k's float32 and (bits & 0xffff0000) the odd
 * k's; the same for a broadcast pair of x. Two float32 FMAs then do what one vdpbf16ps does: exact products,
 * float32 sums (in another order). The weights stay bfloat16 in memory, half the bytes of float32.
 *
 * Work split: items (chunk of up to 256 rows, block), chunk-major, handed out in guided chunks (GEMM_ITEMS): each
 * thread first takes a long run of consecutive items, as a static split would, and the rest go to whichever thread
 * is free, so a core slowed by its neighbours (a VM's shared L3 and clock) no longer holds the other at the barrier.
 * At a decode step's M (one chunk) each thread streams its own run of the weights; in a prefill each thread keeps
 * its chunks of x in L2 while the layer's weights stream past. Threads are OpenMP's, in torch's runtime.
 */
#include "cpu_common.h"

/* The layout and tile follow the vector width the library is built for (a packed weight is only ever read by the
 * library that packed it, folio/kernels/cpu_gemm.py). Every tile keeps 3 vectors of columns per row:
 *   AVX-512   48 columns (3 zmm) x  8 rows: 24 accumulators + 3 weights + 1 broadcast of 32 registers
 *   AVX2+FMA  24 columns (3 ymm) x  4 rows: 12 accumulators + 3 weights + 1 broadcast of 16 registers
 *   generic   48 columns, 8 rows of plain C (the layout is then only a loop order). */
#if defined(__AVX512F__)
#define GEMM_VEC_BITS 512
#define BLOCK_N 48
#define TILE_M 8
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMM_VEC_BITS 256
#define BLOCK_N 24
#define TILE_M 4
#else
#define GEMM_VEC_BITS 0
#define BLOCK_N 48
#define TILE_M 8
#endif
/* AMX (tile registers, tdpbf16ps) for bfloat16 where the library is built for it (the amx tier): a tile of up to 16
 * rows x the block's 48 columns, read straight from the packed layout (its k pairs side by side are AMX's B
 * operand layout); float32 keeps the AVX-512 tiles. */
#if GEMM_VEC_BITS == 512 && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GEMM_AMX 1
#define AMX_TILE_M 16
#else
#define GEMM_AMX 0
#endif
#define CHUNK_M 256 /* rows per work item: a block's weights are re-read once per chunk */
/* The GEMM item loops' schedule. Guided rather than static: on a 2-core Zen 3 VM (avx2) whose cores' speed swung
 * 15-20% from minute to minute, W1 float32 ran 2-6% faster (farm-bench, 9 pairs) and the GEMM alone 7-8%
 * (M = 64 and 512; docs/performance.md, session 41); the outputs are the same bits (an item's tile does not depend on
 * which thread runs it); the 8-bit codes' arg-max over widened blocks (every vector tier) too. The AVX-512-only loops
 * (bfloat16 screen, the 8-bit codes' one-tile arg-max, AMX) stay static until measured. */
#define GEMM_ITEMS _Pragma("omp for schedule(guided)")
#define STEP_BYTES (BLOCK_N * 4) /* packed bytes per k (float32) or k pair (bfloat16) */
#define PREFETCH_BYTES (16 * STEP_BYTES)

static inline int64_t num_blocks(int64_t n) { return (n + BLOCK_N - 1) / BLOCK_N; }

/* Number of elements of the packed form of an [n, k] weight. */
int64_t folio_gemm_packed_numel_f32(int64_t n, int64_t k) { return num_blocks(n) * BLOCK_N * k; }
int64_t folio_gemm_packed_numel_bf16(int64_t n, int64_t k) { return num_blocks(n) * BLOCK_N * (k + (k & 1)); }

void folio_gemm_pack_f32(const float *w, int64_t ldw, int64_t n, int64_t k, float *packed) {
#pragma omp parallel for
    for (int64_t b = 0; b < num_blocks(n); ++b) {
        float *dst = packed + b * k * BLOCK_N;
        for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t c = 0; c < BLOCK_N; ++c) {
                const int64_t row = b * BLOCK_N + c;
                dst[kk * BLOCK_N + c] = row < n ? w[row * ldw + kk] : 0.0f;
            }
    }
}

void folio_gemm_pack_bf16(const uint16_t *w, int64_t ldw, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t num_pairs = (k + 1) / 2;
#pragma omp parallel for
    for (int64_t b = 0; b < num_blocks(n); ++b) {
        uint16_t *dst = packed + b * num_pairs * 2 * BLOCK_N;
        for (int64_t p = 0; p < num_pairs; ++p)
            for (int64_t c = 0; c < BLOCK_N; ++c)
                for (int64_t h = 0; h < 2; ++h) {
                    const int64_t row = b * BLOCK_N + c, col = 2 * p + h;
                    dst[(p * BLOCK_N + c) * 2 + h] = row < n && col < k ? w[row * ldw + col] : 0;
                }
    }
}

/* Where a tile's accumulators go: out[row][col] (+ bias[col]) for the valid columns of the block, stored as
 * float32 or rounded to bfloat16; or, when best_val is set, into a running arg-max per row instead of memory
 * (folio_gemm_argmax_*): lane l of best_val[row * 16 + l] / best_col[...] is the largest value seen in the columns
 * = l (mod 16) and the first column holding it. */
typedef struct {
    void *out;
    int out_is_bf16;
    int64_t ldc;
    const float *bias; /* [N] or NULL */
    int64_t n;
    float *best_val;   /* [M, 16] or NULL */
    int32_t *best_col; /* [M, 16] */
    struct ScreenState *screen; /* or, when set: the bfloat16 screen of a float32 LM head (gemm_screen_epilogue.h) */
} Epilogue;

#include "gemm_screen_epilogue.h"

/* Every lane of an arg-max's per-thread bests (count entries) empty: -FLT_MAX, no column. */
static void argmax_reset(float *best_val, int32_t *best_col, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
        best_val[i] = -FLT_MAX;
        best_col[i] = INT32_MAX;
    }
}

/* The per-thread bests of an arg-max over m rows ([threads][m][16] each), allocated and reset: 0, or -1 (nothing
 * allocated) where memory ran out. argmax_finish merges them into out_ids and frees them. */
static int argmax_start(int64_t threads, int64_t m, float **best_val, int32_t **best_col) {
    *best_val = malloc(sizeof(float) * threads * m * 16);
    *best_col = malloc(sizeof(int32_t) * threads * m * 16);
    if (*best_val == NULL || *best_col == NULL) {
        free(*best_val);
        free(*best_col);
        return -1;
    }
    argmax_reset(*best_val, *best_col, threads * m * 16);
    return 0;
}

static void argmax_merge(const float *best_val, const int32_t *best_col, int64_t threads, int64_t m,
                         int64_t *out_ids);

static void argmax_finish(float *best_val, int32_t *best_col, int64_t threads, int64_t m, int64_t *out_ids) {
    argmax_merge(best_val, best_col, threads, m, out_ids);
    free(best_val);
    free(best_col);
}

/* out_ids[r]: over every thread's 16 lanes of row r (best_val / best_col [threads][m][16], as the arg-max
 * epilogue leaves them), the largest value and the first column among equals; 0 where nothing beat -FLT_MAX. */
static void argmax_merge(const float *best_val, const int32_t *best_col, int64_t threads, int64_t m,
                         int64_t *out_ids) {
    for (int64_t r = 0; r < m; ++r) {
        float value = -FLT_MAX;
        int32_t col = INT32_MAX;
        for (int64_t t = 0; t < threads; ++t)
            for (int64_t l = 0; l < 16; ++l) {
                const float v = best_val[(t * m + r) * 16 + l];
                const int32_t c = best_col[(t * m + r) * 16 + l];
                if (v > value || (v == value && c < col)) {
                    value = v;
                    col = c;
                }
            }
        out_ids[r] = col == INT32_MAX ? 0 : col;
    }
}

/* The weights a tile pulls toward L2 while it computes: one 64-byte line of the thread's next block every
 * (every_mask + 1) k steps, from next up to end. A block's row tiles split its successor between them, so the
 * next block arrives while this one is computed from L2 (docs/performance.md). */
typedef struct {
    const char *next, *end;
    int64_t every_mask;
} NextBlock;

/* Row tile `tile` of `ntiles`'s share of the next block (`block_bytes` long at `next`, NULL for none). With fewer
 * than 4 tiles a share is long, so a line goes every step; else every other step leaves the loads room. A lone
 * tile (M <= 8) asks for nothing: its stream-ahead prefetch already runs into the next block, and more cost
 * 1-10% there. */
static inline NextBlock next_block_share(const void *next, int64_t block_bytes, int64_t tile, int64_t ntiles) {
    if (next == NULL || ntiles < 2) return (NextBlock){NULL, NULL, 0};
    const int64_t share = ((block_bytes + ntiles - 1) / ntiles + 63) & ~(int64_t)63;
    const char *start = (const char *)next + share * tile, *block_end = (const char *)next + block_bytes;
    return (NextBlock){start, start + share < block_end ? start + share : block_end, ntiles < 4 ? 0 : 1};
}

/* Cache lines a GEMM's tiles pull toward L2 on the side, one every (every_mask + 1) k steps, for whoever reads them
 * next: the fused decoder hands its GEMMs the K/V blocks of the next layer's decode attention. The GEMMs are
 * compute-bound with the memory bus mostly idle, the decode attention memory-bound with the FMA units idle; so
 * the blocks stream from DRAM under the GEMMs and the attention finds them in L2 / L3 (docs/performance.md).
 * The lines: for each block offset (bytes), block_lines lines of the K cache, then as many of the V cache. */
typedef struct {
    const char *k_base, *v_base;
    const int64_t *offsets;
    int64_t count, index, line, block_lines, every_mask;
} SidePrefetch;

static inline void side_prefetch_step(SidePrefetch *sp) {
    const int64_t in_v = sp->line >= sp->block_lines;
    const char *base = in_v ? sp->v_base : sp->k_base;
    __builtin_prefetch(base + sp->offsets[sp->index] + (sp->line - in_v * sp->block_lines) * 64, 0, 2); /* T1 */
    if (++sp->line == 2 * sp->block_lines) {
        sp->line = 0;
        ++sp->index;
    }
}

static inline void store_scalar(const Epilogue *e, int64_t row, int64_t col, float v) {
    if (e->bias != NULL) v += e->bias[col];
    if (e->best_val != NULL) {
        float *best = e->best_val + row * 16 + col % 16;
        if (v > *best) {
            *best = v;
            e->best_col[row * 16 + col % 16] = (int32_t)col;
        }
    } else if (e->out_is_bf16) {
        ((uint16_t *)e->out)[row * e->ldc + col] = f32_to_bf16(v);
    } else {
        ((float *)e->out)[row * e->ldc + col] = v;
    }
}

#include "gemm_vector_ops.h"

#if GEMM_VEC_BITS > 0
/* Row counts a tile is compiled for (a compile-time MR keeps the accumulators in registers). */
#if TILE_M == 8
#define FOR_EACH_TILE_ROWS(F) F(8) F(7) F(6) F(5) F(4) F(3) F(2) F(1)
#else
#define FOR_EACH_TILE_ROWS(F) F(4) F(3) F(2) F(1)
#endif

/* A tile's prefetches at step s beside its own block's: the next block's share, the side lines. */
#define TILE_OTHER_PREFETCH(s)                                                                                    \
    if ((s & nb.every_mask) == 0 && nb.next < nb.end) {                                                          \
        _mm_prefetch(nb.next, _MM_HINT_T1);                                                                       \
        nb.next += 64;                                                                                            \
    }                                                                                                             \
    if ((s & sp.every_mask) == 0 && sp.index < sp.count) side_prefetch_step(&sp);

/* A tile's prefetch of its own block ahead of step s's weights at w. */
#define TILE_OWN_PREFETCH(w)                                                                                      \
    _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);                                                  \
    _mm_prefetch((const char *)w + PREFETCH_BYTES + 64, _MM_HINT_T0);                                             \
    if (STEP_BYTES > 128) _mm_prefetch((const char *)w + PREFETCH_BYTES + 128, _MM_HINT_T0);

/* A tile's prefetches at step s (weights at w): its own block ahead, then the others. */
#define TILE_PREFETCH(w, s)                                                                                       \
    TILE_OWN_PREFETCH(w)                                                                                          \
    TILE_OTHER_PREFETCH(s)

/* A tile's MR x 3 accumulators set to zero, and its copy of the side prefetch's position (TILE_FINISH). */
#define TILE_START(MR)                                                                                            \
    gv_f32 acc[MR][3];                                                                                           \
    SidePrefetch sp = side != NULL ? *side : (SidePrefetch){0};                                                   \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                                       \
        acc[i][0] = acc[i][1] = acc[i][2] = gv_zero();                                                           \
    }

/* The side prefetch's position handed back, and the accumulators through the epilogue. */
#define TILE_FINISH(MR)                                                                                           \
    if (side != NULL) *side = sp;                                                                                 \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                                       \
        for (int j = 0; j < 3; ++j) gv_store(e, row0 + i, col0 + GV_LANES * j, acc[i][j]);                      \
    }

/* One tile of MR rows x BLOCK_N columns over the whole K. The element type's step (one k for float32, a k pair for
 * bfloat16) is STEP_FMA; MR is a compile-time constant so the accumulators stay in registers.
 * The steps run in two loops: while lines of the next block or side lines are left to prefetch, then without
 * their tests. A tile among 64 of a block has its share of the next block asked for in its first 28 steps of 576,
 * and the tests cost the loop more than their prefetches: on Zen 3 (AVX2, 2 cores of an AMD EPYC) the 2-thread
 * float32 GEMM at M = 512, gate|up ran at 89-96 GFLOP/s with them in every step and 115-124 without (the same
 * prefetches issued or not: the tests, not the lines). */
#define DEFINE_TILE(SUFFIX, T, MR, K_STEPS, STEP_FMA)                                                             \
    static void tile_##SUFFIX##_##MR(const T *x, int64_t lda, const T *wb, int64_t k, const Epilogue *e,          \
                                     int64_t row0, int64_t col0, NextBlock nb, SidePrefetch *side) {             \
        TILE_START(MR)                                                                                            \
        const int64_t steps = K_STEPS;                                                                            \
        int64_t s = 0;                                                                                            \
        for (; s < steps && (nb.next < nb.end || sp.index < sp.count); ++s) {                                     \
            const T *w = (const T *)((const char *)wb + s * STEP_BYTES);                                          \
            TILE_PREFETCH(w, s)                                                                                   \
            STEP_FMA(MR)                                                                                          \
        }                                                                                                         \
        for (; s < steps; ++s) {                                                                                  \
            const T *w = (const T *)((const char *)wb + s * STEP_BYTES);                                          \
            TILE_OWN_PREFETCH(w)                                                                                  \
            STEP_FMA(MR)                                                                                          \
        }                                                                                                         \
        TILE_FINISH(MR)                                                                                           \
    }

/* float32: acc[i][j] += x[i][s] * W[block col GV_LANES j + lane][s] */
#define STEP_F32(MR)                                                                                              \
    gv_f32 w0 = gv_load(w), w1 = gv_load(w + GV_LANES), w2 = gv_load(w + 2 * GV_LANES);                    \
    gv_keep_in_register(w0);                                                                                      \
    gv_keep_in_register(w1);                                                                                      \
    gv_keep_in_register(w2);                                                                                      \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                                       \
        const gv_f32 a = gv_set1(x[i * lda + s]);                                                               \
        acc[i][0] = gv_fma(a, w0, acc[i][0]);                                                                    \
        acc[i][1] = gv_fma(a, w1, acc[i][1]);                                                                    \
        acc[i][2] = gv_fma(a, w2, acc[i][2]);                                                                    \
    }

#define DEFINE_TILE_F32(MR) DEFINE_TILE(f32, float, MR, k, STEP_F32)
FOR_EACH_TILE_ROWS(DEFINE_TILE_F32)

#ifdef __AVX512BF16__
/* bfloat16: acc[i][j] += x[i][2s] * W[..][2s] + x[i][2s+1] * W[..][2s+1] (vdpbf16ps: exact products, float32
 * sums). A K of odd length reads x[i][K] as the pair's second half, multiplied by the packed zero. */
#define STEP_BF16(MR)                                                                                             \
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32),              \
                   w2 = (__m512bh)_mm512_loadu_si512(w + 64);                                                    \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                                       \
        int32_t pair;                                                                                             \
        memcpy(&pair, x + i * lda + 2 * s, sizeof pair);                                                          \
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                                                    \
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);                                                           \
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);                                                           \
        acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, w2);                                                           \
    }
#else
/* bfloat16 widened to float32 in registers (no vdpbf16ps): the even k of each pair (low halves, << 16), then the
 * odd k (high halves, masked), of the weights and of the row's broadcast x pair. With 16 ymm registers this
 * spills a few accumulators; the variants that did not (x widened to float32 on the stack per tile, the even and
 * odd k apart) were no faster (86-90 against 90-94 GFLOP/s per core, Zen 5, avx2 build): the widening's shifts
 * share the FMA pipes. */
#define STEP_BF16(MR)                                                                                             \
    const gv_i32 p0 = gv_load_i32(w), p1 = gv_load_i32(w + 2 * GV_LANES), p2 = gv_load_i32(w + 4 * GV_LANES);  \
    const gv_f32 e0 = gv_shl16(p0), e1 = gv_shl16(p1), e2 = gv_shl16(p2);                                     \
    const gv_f32 o0 = gv_high16(p0), o1 = gv_high16(p1), o2 = gv_high16(p2);                                  \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                                       \
        int32_t pair;                                                                                             \
        memcpy(&pair, x + i * lda + 2 * s, sizeof pair);                                                          \
        const gv_i32 a = gv_set1_i32(pair);                                                                     \
        const gv_f32 a_even = gv_shl16(a), a_odd = gv_high16(a);                                               \
        acc[i][0] = gv_fma(a_odd, o0, gv_fma(a_even, e0, acc[i][0]));                                           \
        acc[i][1] = gv_fma(a_odd, o1, gv_fma(a_even, e1, acc[i][1]));                                           \
        acc[i][2] = gv_fma(a_odd, o2, gv_fma(a_even, e2, acc[i][2]));                                           \
    }
#endif

#define DEFINE_TILE_BF16(MR) DEFINE_TILE(bf16, uint16_t, MR, (k + 1) / 2, STEP_BF16)
FOR_EACH_TILE_ROWS(DEFINE_TILE_BF16)

#include "gemm_amx_tile.h"
#endif /* GEMM_VEC_BITS > 0 */
#ifndef BF16_TILE_M /* no AMX: bfloat16 runs the vector (or plain C) tiles, and there is no tile state to forget */
#define AMX_FORGET() ((void)0)
#define BF16_TILE_M TILE_M
#endif

#define ELEM_T float
#define SUFFIX f32
#define LOAD(v) (v)
#define PACKED_K(k) (k)
#define PACKED_AT(k, c) ((k) * BLOCK_N + (c))
#define HAS_TILES (GEMM_VEC_BITS > 0)
#define TILE_ROWS TILE_M
#define USE_AMX 0
#include "cpu_gemm_impl.h"
#undef ELEM_T
#undef SUFFIX
#undef LOAD
#undef PACKED_K
#undef PACKED_AT
#undef HAS_TILES
#undef TILE_ROWS
#undef USE_AMX

#define ELEM_T uint16_t
#define SUFFIX bf16
#define LOAD(v) bf16_to_f32(v)
#define PACKED_K(k) ((k) + ((k) & 1))
#define PACKED_AT(k, c) ((((k) / 2) * BLOCK_N + (c)) * 2 + ((k) & 1))
#define HAS_TILES (GEMM_VEC_BITS > 0)
#define TILE_ROWS BF16_TILE_M
#define USE_AMX GEMM_AMX
#include "cpu_gemm_impl.h"
#undef ELEM_T
#undef SUFFIX
#undef LOAD
#undef PACKED_K
#undef PACKED_AT
#undef HAS_TILES
#undef TILE_ROWS
#undef USE_AMX

#include "gemm_codes4.h"
#include "gemm_codes8_argmax.h"
#include "gemm_argmax_screen.h"
#include "gemm_codes8_screen.h"
#include "gemm_codes8_screen_vnni.h"

/* Output columns per packed block: the int8 screen's per-group norms are laid out in whole blocks. */
int folio_gemm_block_n(void) { return BLOCK_N; }
