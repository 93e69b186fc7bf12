/* The float32 GEMM over 4-bit codes through vpdpbusd: AVX512-VNNI (512-bit builds with it and without AMX: the
 * native avx512_bf16 tier of Zen 4 / 5, the native avx512 tier of Cascade Lake and Ice Lake Xeons) or AVX-VNNI
 * (256-bit builds with it: the native avx2 tier of Intel's client cores since Alder Lake and of its E-core Xeons;
 * cpu_vnni_float32): float32 accuracy from the integer dot-product unit. Included by gemm_codes4.h, whose layout and
 * scratch it reads. Measured on Zen 5 only (the Intel bodies through test builds with -mavx512vnni / -mavxvnni at
 * the avx512 / avx2 tier, --cpu-isa avx512+avx512_vnni / avx2+avx_vnni): a session on an Intel part should check
 * its vpdpbusd against its FMA (benchmarks/dot_instruction_rates.py; Intel's port tables put both at two a cycle on
 * parts with two FMA units) and the GEMMs (benchmarks/cpu_gemm.py); --no-cpu-vnni-float32 is the way back.
 *
 * Why: on Zen 5 vpdpbusd runs at the float32 FMA's instruction rate with four times its multiply-adds, at either
 * width, and the integer ops and conversions around it issue on other pipes (benchmarks/dot_instruction_rates.py,
 * docs/performance.md, sessions 49 and 52). x, per row and group of 32 k, is a fixed point of 22 bits under a
 * power-of-two step s (|x / s| < 2^22, rounded to nearest) split into three balanced int8 limbs
 * X = 65536 hi + 256 mid + lo (hi in -64..64, mid and lo in -128..127); the codes q (0..15) are the unsigned operand.
 * So
 *   y[r][c] = sum over groups g of d[g][c] s[r][g] Q[r][g][c] + m[g][c] X[r][g],
 *   Q = (hi . q << 16) + (mid . q << 8) + lo . q   (three exact int32 sums of 32 products; |Q| < 2^31)
 *   X = the group's float32 sum of x.
 * Per vector of columns and 32 k of a row: 24 vpdpbusd and 3 FMA-pipe ops (the float32 path: 32 FMAs). The error is
 * x's rounding to 22 bits below its group's largest power of two plus float32 sums: float32 accuracy, not the float32
 * layout's bits (an engine argument, default on). A NaN or inf in x makes its row NaN or inf (through X). Groups
 * whose largest |x| is below 2^-100 are rounded on the 2^-100 group's step, so the smallest inputs lose their
 * digits to an absolute error under 2^-122 a weight unit.
 *
 * Per block: each group's codes are widened once into [k / 4][BLOCK_N][4] bytes (four consecutive k of one column
 * in one dword: vpdpbusd's layout) in the thread's scratch; a tile is VNNI_TILE_M rows x the block's 3 vectors of
 * columns, its 9 VNNI_TILE_M int32 sums and 3 VNNI_TILE_M float32 accumulators in registers (2 rows in 32 zmm, 1
 * row in 16 ymm). The block's row tiles pull the next block's codes toward L2 between them, as the FMA tiles do
 * (W1's decode GEMMs 6-9% faster: docs/performance.md, session 49). */
#if GEMM_VEC_BITS == 512 && defined(__AVX512VNNI__) && !GEMM_AMX
#define VNNI_TILE_M 2
typedef __m512i vn_i32;
#define vn_zero() _mm512_setzero_si512()
#define vn_load(p) _mm512_load_si512(p)
#define vn_store(p, v) _mm512_store_si512(p, v)
#define vn_set1(v) _mm512_set1_epi32(v)
#define vn_dpbusd(acc, u8, s8) _mm512_dpbusd_epi32(acc, u8, s8)
#define vn_add(a, b) _mm512_add_epi32(a, b)
#define vn_and(a, b) _mm512_and_si512(a, b)
#define vn_or(a, b) _mm512_or_si512(a, b)
#define vn_shl(v, n) _mm512_slli_epi32(v, n)
#define vn_shr(v, n) _mm512_srli_epi32(v, n)
#define vn_to_ps(v) _mm512_cvtepi32_ps(v)
#define vn_bytes_to_dwords(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))) /* GV_LANES bytes */
#define vn_sub(a, b) _mm512_sub_epi32(a, b)
#define vn_sra(v, n) _mm512_srai_epi32(v, n)
#define vn_round(v) _mm512_cvtps_epi32(v) /* to nearest, ties to even */
#define vn_abs(v) _mm512_abs_ps(v)
#define vn_reduce_max(v) _mm512_reduce_max_ps(v)
#define vn_reduce_add(v) _mm512_reduce_add_ps(v)
#define vn_store_limbs(p, v) _mm_storeu_si128((__m128i *)(p), _mm512_cvtepi32_epi8(v)) /* lanes in -128..127 */
#elif GEMM_VEC_BITS == 256 && defined(__AVXVNNI__)
#define VNNI_TILE_M 1
typedef __m256i vn_i32;
#define vn_zero() _mm256_setzero_si256()
#define vn_load(p) _mm256_load_si256((const __m256i *)(p))
#define vn_store(p, v) _mm256_store_si256((__m256i *)(p), v)
#define vn_set1(v) _mm256_set1_epi32(v)
#define vn_dpbusd(acc, u8, s8) _mm256_dpbusd_avx_epi32(acc, u8, s8)
#define vn_add(a, b) _mm256_add_epi32(a, b)
#define vn_and(a, b) _mm256_and_si256(a, b)
#define vn_or(a, b) _mm256_or_si256(a, b)
#define vn_shl(v, n) _mm256_slli_epi32(v, n)
#define vn_shr(v, n) _mm256_srli_epi32(v, n)
#define vn_to_ps(v) _mm256_cvtepi32_ps(v)
#define vn_bytes_to_dwords(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))) /* GV_LANES bytes */
#define vn_sub(a, b) _mm256_sub_epi32(a, b)
#define vn_sra(v, n) _mm256_srai_epi32(v, n)
#define vn_round(v) _mm256_cvtps_epi32(v) /* to nearest, ties to even */
#define vn_abs(v) _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)))
static inline float vn_reduce_max(__m256 v) {
    const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}
static inline float vn_reduce_add(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
static inline void vn_store_limbs(int8_t *p, __m256i v) { /* lanes in -128..127: 8 bytes */
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w16, w16));
}
#endif

#ifdef VNNI_TILE_M
#define GEMM_VNNI 1
#define VNNI_PARTS (CODES4_GROUP / GV_LANES) /* vectors of x per group */
#define VNNI_WIDE_GROUP (CODES4_GROUP / 4 * BLOCK_N * 4) /* bytes of one group widened */
/* side lines (the fused decoder's next K/V) per group and row tile: one let the attention find a fifth more of its
 * K/V in DRAM (W1: 1.49 -> 1.84 s); four kept it as with the float32 tiles (docs/performance.md, session 49) */
#define VNNI_SIDE_LINES 4

/* Each thread's split of its chunk's rows (limbs [row][group][3][32] int8, then the step and the sum of x per row
 * and group) and its block of codes widened. */
static _Thread_local ThreadScratch codes4_vnni_scratch;

/* Rows [0, rows) of x (lda apart) -> limbs, steps and sums; rows up to `padded` get zeros (a tile's missing row).
 * Each thread splits the rows of each chunk it works on: at W1's decode batch this is some percent of a call, so
 * it runs at the library's width (256-bit vectors in the 512-bit build cost the down projection 8% at M = 64). */
static void codes4_vnni_split(const float *x, int64_t lda, int64_t rows, int64_t padded, int64_t k, int8_t *limbs,
                              float *step, float *sums) {
    const int64_t groups = k / CODES4_GROUP;
    const vn_i32 c128 = vn_set1(128), c255 = vn_set1(255);
    for (int64_t r = 0; r < padded; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            int8_t *out = limbs + (r * groups + g) * 3 * CODES4_GROUP;
            if (r >= rows) {
                memset(out, 0, 3 * CODES4_GROUP);
                step[r * groups + g] = sums[r * groups + g] = 0.0f;
                continue;
            }
            const float *xg = x + r * lda + g * CODES4_GROUP;
            gv_f32 v[VNNI_PARTS], most = gv_zero(), total = gv_zero();
            for (int i = 0; i < VNNI_PARTS; ++i) {
                v[i] = gv_load(xg + GV_LANES * i);
                most = gv_max(vn_abs(v[i]), most); /* max's second operand where the first is NaN: see below */
                total = gv_add(total, v[i]);
            }
            const float amax = vn_reduce_max(most);
            int e = 128; /* inf, NaN (no comparison holds) and |x| >= 2^127: not finite or huge through the sum */
            if (amax < 0x1p-100f)
                e = -100;
            else if (amax < 0x1p127f)
                frexpf(amax, &e); /* 2^(e - 1) <= amax < 2^e, so |x / step| <= 2^22 after rounding */
            step[r * groups + g] = ldexpf(1.0f, e - 22);
            sums[r * groups + g] = vn_reduce_add(total);
            const gv_f32 inv = gv_set1(ldexpf(1.0f, 22 - e));
            for (int i = 0; i < VNNI_PARTS; ++i) {
                const vn_i32 q = vn_round(gv_mul(v[i], inv));
                const vn_i32 lo = vn_sub(vn_and(vn_add(q, c128), c255), c128);
                const vn_i32 q1 = vn_sra(vn_sub(q, lo), 8);
                const vn_i32 mid = vn_sub(vn_and(vn_add(q1, c128), c255), c128);
                const vn_i32 hi = vn_sra(vn_sub(q1, mid), 8);
                vn_store_limbs(out + GV_LANES * i, hi);
                vn_store_limbs(out + CODES4_GROUP + GV_LANES * i, mid);
                vn_store_limbs(out + 2 * CODES4_GROUP + GV_LANES * i, lo);
            }
        }
}

/* A block's code nibbles (pair p's byte: k = 2p low, 2p + 1 high) -> per group [k / 4][BLOCK_N][4] bytes. */
static void codes4_vnni_widen_block(const uint8_t *src, int64_t k, uint8_t *dst) {
    const vn_i32 low = vn_set1(15);
    for (int64_t g = 0; g < k / CODES4_GROUP; ++g, src += CODES4_GROUP_BYTES) {
        const uint8_t *codes = src + 2 * BLOCK_N * sizeof(float);
        for (int kq = 0; kq < CODES4_GROUP / 4; ++kq)
            for (int j = 0; j < BLOCK_N / GV_LANES; ++j) {
                const vn_i32 even = vn_bytes_to_dwords(codes + 2 * kq * BLOCK_N + GV_LANES * j);
                const vn_i32 odd = vn_bytes_to_dwords(codes + (2 * kq + 1) * BLOCK_N + GV_LANES * j);
                const vn_i32 first = vn_or(vn_and(even, low), vn_shl(vn_shr(even, 4), 8));
                const vn_i32 second = vn_or(vn_shl(vn_and(odd, low), 16), vn_shl(vn_shr(odd, 4), 24));
                vn_store(dst + g * VNNI_WIDE_GROUP + (kq * BLOCK_N + GV_LANES * j) * 4, vn_or(first, second));
            }
    }
}

#if VNNI_TILE_M == 1
/* One row's 9 sums over a group (8 steps of 4 k) with AVX-VNNI, in assembly: in C, gcc held a zero and the float
 * accumulators in 4 of the 16 ymm registers and loaded each code vector once per limb (9 loads a step instead of 3,
 * plus 6 register moves), and the tile ran at 0.85x the FMA tiles (Zen 5, docs/performance.md, session 52). Here
 * 9 sums, 3 code vectors and the broadcast limb take 13 registers. Code vector j of step kq lies at
 * wg + 96 kq + 32 j (BLOCK_N = 24), limb l's four bytes of step kq at limb + 32 l + 4 kq. */
#define VNNI_LIMB(kq, off, a, b, c)                                                                        \
    "vpbroadcastd " #off "+4*" #kq "(%[x]), %[t]\n\t"                                                     \
    "%{vex%} vpdpbusd %[t], %[c0], %[" #a "]\n\t"                                                       \
    "%{vex%} vpdpbusd %[t], %[c1], %[" #b "]\n\t"                                                       \
    "%{vex%} vpdpbusd %[t], %[c2], %[" #c "]\n\t"
#define VNNI_STEP(kq)                                                                                         \
    "vmovdqa 96*" #kq "(%[w]), %[c0]\n\t"                                                                   \
    "vmovdqa 96*" #kq "+32(%[w]), %[c1]\n\t"                                                                \
    "vmovdqa 96*" #kq "+64(%[w]), %[c2]\n\t" VNNI_LIMB(kq, 0, s00, s10, s20)                            \
        VNNI_LIMB(kq, 32, s01, s11, s21) VNNI_LIMB(kq, 64, s02, s12, s22)
static inline void vnni_group_sums(const uint8_t *wg, const int8_t *limb, vn_i32 s[3][3]) {
    vn_i32 c0, c1, c2, t;
    for (int j = 0; j < 3; ++j)
        for (int l = 0; l < 3; ++l) s[j][l] = vn_zero();
    __asm__(VNNI_STEP(0) VNNI_STEP(1) VNNI_STEP(2) VNNI_STEP(3) VNNI_STEP(4) VNNI_STEP(5) VNNI_STEP(6) VNNI_STEP(7)
            : [s00] "+x"(s[0][0]), [s01] "+x"(s[0][1]), [s02] "+x"(s[0][2]), [s10] "+x"(s[1][0]),
              [s11] "+x"(s[1][1]), [s12] "+x"(s[1][2]), [s20] "+x"(s[2][0]), [s21] "+x"(s[2][1]),
              [s22] "+x"(s[2][2]), [c0] "=&x"(c0), [c1] "=&x"(c1), [c2] "=&x"(c2), [t] "=&x"(t)
            : [w] "r"(wg), [x] "r"(limb)
            : "memory");
}
#endif

/* rows (<= VNNI_TILE_M) x the block's 3 vectors of columns over K: per group, 8 steps of 4 k (3 code vectors,
 * rows x 3 limbs x 3 vectors of vpdpbusd), then each Q converted, times d, added on x's step, and m times the
 * group's sum of x; and the tile's share of the next block's lines (nb), spread over the groups.
 * noipa: one copy for every caller. gcc cloned it per call site, and in the clone for folio_gemm_codes4_vnni (no
 * side prefetch: sp NULL) it kept the 18 sums on the stack (146 stack operands against 33), which halved that entry
 * point's speed (SmolLM2's gate|up at M = 64: 548 -> 273-300 GFLOP/s on Zen 5; docs/performance.md, session 50). */
__attribute__((noipa)) static void tile_codes4_vnni(const int8_t *limbs, const float *step, const float *sums,
                                                    int64_t groups, const uint8_t *block, const uint8_t *wide,
                                                    int64_t rows, const Epilogue *e, int64_t row0, int64_t col0,
                                                    SidePrefetch *sp, NextBlock nb) {
    const int64_t per_group = nb.next != NULL ? ((nb.end - nb.next) / 64 + groups - 1) / groups : 0;
    gv_f32 acc[VNNI_TILE_M][3];
    for (int r = 0; r < VNNI_TILE_M; ++r)
        for (int j = 0; j < 3; ++j) acc[r][j] = gv_zero();
    for (int64_t g = 0; g < groups; ++g) {
        vn_i32 s[VNNI_TILE_M][3][3];
        const uint8_t *wg = wide + g * VNNI_WIDE_GROUP;
#if VNNI_TILE_M == 1
        vnni_group_sums(wg, limbs + g * 3 * CODES4_GROUP, s[0]);
#else
        for (int r = 0; r < VNNI_TILE_M; ++r)
            for (int j = 0; j < 3; ++j)
                for (int l = 0; l < 3; ++l) s[r][j][l] = vn_zero();
        _Pragma("GCC unroll 8") for (int kq = 0; kq < CODES4_GROUP / 4; ++kq) {
            vn_i32 c[3];
            for (int j = 0; j < 3; ++j) c[j] = vn_load(wg + (kq * BLOCK_N + GV_LANES * j) * 4);
            _Pragma("GCC unroll 2") for (int r = 0; r < VNNI_TILE_M; ++r) {
                _Pragma("GCC unroll 3") for (int l = 0; l < 3; ++l) {
                    int32_t four;
                    memcpy(&four, limbs + ((r * groups + g) * 3 + l) * CODES4_GROUP + 4 * kq, sizeof four);
                    const vn_i32 xb = vn_set1(four);
                    for (int j = 0; j < 3; ++j) s[r][j][l] = vn_dpbusd(s[r][j][l], c[j], xb);
                }
            }
        }
#endif
        const float *d = (const float *)(block + g * CODES4_GROUP_BYTES);
        for (int j = 0; j < 3; ++j) {
            const gv_f32 dv = gv_load(d + GV_LANES * j), mv = gv_load(d + BLOCK_N + GV_LANES * j);
            for (int r = 0; r < VNNI_TILE_M; ++r) {
                const vn_i32 q = vn_add(vn_shl(s[r][j][0], 16), vn_add(vn_shl(s[r][j][1], 8), s[r][j][2]));
                const gv_f32 dq = gv_mul(vn_to_ps(q), dv);
                acc[r][j] = gv_fma(dq, gv_set1(step[r * groups + g]), acc[r][j]);
                acc[r][j] = gv_fma(mv, gv_set1(sums[r * groups + g]), acc[r][j]);
            }
        }
        for (int line = 0; line < VNNI_SIDE_LINES && sp != NULL && sp->index < sp->count; ++line)
            side_prefetch_step(sp);
        for (int64_t line = 0; line < per_group && nb.next < nb.end; ++line, nb.next += 64)
            __builtin_prefetch(nb.next, 0, 2);
    }
    for (int r = 0; r < VNNI_TILE_M; ++r)
        if (r < rows)
            for (int j = 0; j < 3; ++j) gv_store(e, row0 + r, col0 + GV_LANES * j, acc[r][j]);
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
