/* A standalone prototype, not used by the engine: the float32 GEMM over 4-bit codes (Q4_1: w = d q + m in each
 * group of 32 k of a column, as folio/kernels/gemm_codes4.h keeps them) through AVX512-VNNI's vpdpbusd.
 *
 *     gcc -O3 -march=native -fopenmp benchmarks/prototypes/codes4_vnni_gemm.c -o /tmp/codes4_vnni -lm
 *     /tmp/codes4_vnni            # then, for the engine's own GEMM at the same shapes:
 *     .venv/bin/python benchmarks/cpu_gemm.py --dtypes codes4 --rows 64 --no-onednn --rounds 15 --median
 *
 * Why: on Zen 5 vpdpbusd runs at the float32 FMA's instruction rate with 4x its multiply-adds, and integer ops and
 * conversions issue beside it (benchmarks/dot_instruction_rates.py; docs/performance.md, session 49). With x as a
 * 22-bit fixed point per (row, group) split into three balanced int8 limbs (hi in -64..64, mid and lo in
 * -128..127), a group's sum over its 32 k of q x is three exact int32 sums, S = (hi << 16) + (mid << 8) + lo, which
 * cannot overflow (|S| <= 32 * 15 * (64 * 65536 + 128 * 257) < 2^31). Per 16 columns and 32 k of one row: 24
 * vpdpbusd and 3 FMA-pipe ops (the step times the row-group's scale, two FMAs for d S and m sum x) against the
 * float32 path's 32 FMAs: at most 1.19x. The result is not the float32 layout's bits: x is rounded to 22 bits
 * below its group's largest power of two; the largest error over the test shapes is printed beside the float32 FMA
 * chain's own, both against a double reference and relative to sum |w x|.
 *
 * Layout here (not the engine's): blocks of 32 columns; per group the codes as [k/4][2 vectors][16 columns][4 k]
 * bytes, then d and m. The engine would widen its own nibbles into this per block, as its AMX path does.
 * Tile: TR rows x TJ vectors of 16 columns (-DTR=, -DTJ=; 2 x 2 measured best), 3 x TR x TJ int32 sums in
 * registers. Prints GFLOP/s (best and median of 300 calls, 30 weight copies cycled) at M = 64 for SmolLM2-135M's
 * q|k|v, gate|up and down shapes. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define BN 32 /* columns per block: 2 vectors of 16 */
#ifndef TR
#define TR 2
#endif
#ifndef TJ
#define TJ 2
#endif
#define COPIES 30
#define CALLS 300

typedef struct {
    int64_t n, k, groups, nblocks;
    uint8_t *codes; /* [block][group][k / 4][2][16][4] */
    float *d, *m;   /* [block][group][32] */
} Packed;

static Packed pack(const uint8_t *q, const float *d, const float *m, int64_t k, int64_t n) {
    Packed p = {n, k, k / GROUP, n / BN, aligned_alloc(64, (size_t)(k * n)), NULL, NULL};
    p.d = aligned_alloc(64, sizeof(float) * (size_t)(p.groups * n));
    p.m = aligned_alloc(64, sizeof(float) * (size_t)(p.groups * n));
    for (int64_t b = 0; b < p.nblocks; ++b)
        for (int64_t g = 0; g < p.groups; ++g) {
            uint8_t *dst = p.codes + (b * p.groups + g) * (GROUP * BN);
            for (int kq = 0; kq < 8; ++kq)
                for (int c = 0; c < BN; ++c)
                    for (int t = 0; t < 4; ++t)
                        dst[(kq * BN + c) * 4 + t] = q[(g * GROUP + kq * 4 + t) * n + b * BN + c];
            for (int c = 0; c < BN; ++c) {
                p.d[(b * p.groups + g) * BN + c] = d[g * n + b * BN + c];
                p.m[(b * p.groups + g) * BN + c] = m[g * n + b * BN + c];
            }
        }
    return p;
}

/* Rows [r0, r1) of x [*, k] -> limbs [r][g][3][32] (hi, mid, lo), the row-group's step (a power of two) and sum. */
static void split(const float *x, int64_t r0, int64_t r1, int64_t k, int8_t *limbs, float *step, float *sums) {
    const int64_t groups = k / GROUP;
    const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = x + r * k + g * GROUP;
            const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            int e;
            frexpf(amax, &e); /* amax < 2^e, so |x / step| < 2^22 */
            step[r * groups + g] = amax > 0 ? ldexpf(1.0f, e - 22) : 1.0f;
            sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
            const __m512 inv = _mm512_set1_ps(amax > 0 ? ldexpf(1.0f, 22 - e) : 1.0f);
            int8_t *out = limbs + (r * groups + g) * 3 * GROUP;
            for (int h = 0; h < 2; ++h) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(h ? b : a, inv));
                const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128);
                const __m512i v1 = _mm512_srai_epi32(_mm512_sub_epi32(v, lo), 8);
                const __m512i mid = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v1, c128), c255), c128);
                const __m512i hi = _mm512_srai_epi32(_mm512_sub_epi32(v1, mid), 8);
                _mm_storeu_si128((__m128i *)(out + 16 * h), _mm512_cvtepi32_epi8(hi));
                _mm_storeu_si128((__m128i *)(out + GROUP + 16 * h), _mm512_cvtepi32_epi8(mid));
                _mm_storeu_si128((__m128i *)(out + 2 * GROUP + 16 * h), _mm512_cvtepi32_epi8(lo));
            }
        }
}

/* TR rows (fewer stored where rows < TR) x block b's 32 columns, TJ vectors at a time. */
static inline void tile(const int8_t *limbs, const float *step, const float *sums, const Packed *p, int64_t b,
                        float *y, int64_t ldy, int64_t rows) {
    const int64_t groups = p->groups;
    for (int j0 = 0; j0 < 2; j0 += TJ) {
        __m512 acc[TR][TJ];
        for (int r = 0; r < TR; ++r)
            for (int j = 0; j < TJ; ++j) acc[r][j] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t *cg = p->codes + (b * groups + g) * (GROUP * BN);
            __m512i s[TR][TJ][3];
            for (int r = 0; r < TR; ++r)
                for (int j = 0; j < TJ; ++j)
                    for (int l = 0; l < 3; ++l) s[r][j][l] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int kq = 0; kq < 8; ++kq) {
                __m512i c[TJ];
                for (int j = 0; j < TJ; ++j) c[j] = _mm512_load_si512(cg + kq * 128 + 64 * (j0 + j));
#pragma GCC unroll 4
                for (int r = 0; r < TR; ++r)
#pragma GCC unroll 3
                    for (int l = 0; l < 3; ++l) {
                        int32_t four;
                        memcpy(&four, limbs + (r * groups + g) * 3 * GROUP + l * GROUP + 4 * kq, sizeof four);
                        const __m512i xb = _mm512_set1_epi32(four);
                        for (int j = 0; j < TJ; ++j) s[r][j][l] = _mm512_dpbusd_epi32(s[r][j][l], c[j], xb);
                    }
            }
            for (int j = 0; j < TJ; ++j) {
                const __m512 d = _mm512_load_ps(p->d + (b * groups + g) * BN + 16 * (j0 + j));
                const __m512 m = _mm512_load_ps(p->m + (b * groups + g) * BN + 16 * (j0 + j));
                for (int r = 0; r < TR; ++r) {
                    const __m512i exact = _mm512_add_epi32(
                        _mm512_slli_epi32(s[r][j][0], 16),
                        _mm512_add_epi32(_mm512_slli_epi32(s[r][j][1], 8), s[r][j][2]));
                    const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(step[r * groups + g]));
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), ds, acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * groups + g]), acc[r][j]);
                }
            }
        }
        for (int r = 0; r < TR && r < rows; ++r)
            for (int j = 0; j < TJ; ++j) _mm512_storeu_ps(y + r * ldy + b * BN + 16 * (j0 + j), acc[r][j]);
    }
}

/* y [rows, n] = x [rows, k] w; limbs, step, sums: scratch for rows rounded up to TR. */
static void gemm(const float *x, int64_t rows, const Packed *p, float *y, int8_t *limbs, float *step, float *sums) {
#pragma omp parallel num_threads(2)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        split(x, rows * t / nt, rows * (t + 1) / nt, p->k, limbs, step, sums);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t b = 0; b < p->nblocks; ++b)
            for (int64_t r = 0; r < rows; r += TR)
                tile(limbs + r * p->groups * 3 * GROUP, step + r * p->groups, sums + r * p->groups, p, b, y + r * p->n,
                     p->n, rows - r);
    }
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void) {
    const int64_t rows = 64, shapes[3][2] = {{576, 960}, {576, 3072}, {1536, 576}}; /* k, n */
    const char *names[3] = {"q|k|v", "gate|up", "down"};
    printf("TR %d, TJ %d, %d threads, M = %ld; GFLOP/s best / median of %d calls over %d weight copies\n", TR, TJ, 2,
           (long)rows, CALLS, COPIES);
    for (int si = 0; si < 3; ++si) {
        const int64_t k = shapes[si][0], n = shapes[si][1], groups = k / GROUP;
        uint8_t *q = malloc((size_t)(k * n));
        float *d = malloc(sizeof(float) * (size_t)(groups * n)), *m = malloc(sizeof(float) * (size_t)(groups * n));
        float *x = malloc(sizeof(float) * (size_t)(rows * k)), *y = aligned_alloc(64, sizeof(float) * (size_t)(rows * n));
        srand(1);
        for (int64_t i = 0; i < k * n; ++i) q[i] = (uint8_t)(rand() & 15);
        for (int64_t i = 0; i < groups * n; ++i) {
            d[i] = (float)rand() / (float)RAND_MAX * 0.01f;
            m[i] = -(float)rand() / (float)RAND_MAX * 0.08f;
        }
        for (int64_t i = 0; i < rows * k; ++i) /* one element in 97 an outlier 25x the rest */
            x[i] = ((float)rand() / (float)RAND_MAX - 0.5f) * (i % 97 == 0 ? 50.0f : 2.0f);
        Packed packed[COPIES];
        for (int c = 0; c < COPIES; ++c) packed[c] = pack(q, d, m, k, n);
        const int64_t padded = (rows + TR - 1) / TR * TR;
        int8_t *limbs = aligned_alloc(64, (size_t)(padded * k * 3));
        float *step = calloc((size_t)(padded * groups), sizeof(float)), *sums = calloc((size_t)(padded * groups), sizeof(float));
        memset(limbs, 0, (size_t)(padded * k * 3));
        gemm(x, rows, &packed[0], y, limbs, step, sums);
        double err = 0, err_f32 = 0;
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < n; ++c) {
                double ref = 0, mag = 0;
                float chain = 0;
                for (int64_t kk = 0; kk < k; ++kk) {
                    const float w = d[(kk / GROUP) * n + c] * q[kk * n + c] + m[(kk / GROUP) * n + c];
                    ref += (double)w * x[r * k + kk];
                    mag += fabs((double)w * x[r * k + kk]);
                    chain = fmaf(w, x[r * k + kk], chain);
                }
                err = fmax(err, fabs(y[r * n + c] - ref) / mag);
                err_f32 = fmax(err_f32, fabs(chain - ref) / mag);
            }
        double times[CALLS];
        for (int i = 0; i < 30; ++i) gemm(x, rows, &packed[i % COPIES], y, limbs, step, sums); /* warm-up */
        for (int i = 0; i < CALLS; ++i) {
            const double t0 = omp_get_wtime();
            gemm(x, rows, &packed[i % COPIES], y, limbs, step, sums);
            times[i] = omp_get_wtime() - t0;
        }
        qsort(times, CALLS, sizeof times[0], by_value);
        const double flop = 2.0 * (double)(rows * k * n);
        printf("%-8s k %4ld n %4ld: %6.1f / %6.1f GFLOP/s; largest |error| / sum |w x|: %.2e (float32 FMA chain: "
               "%.2e)\n", names[si], (long)k, (long)n, flop / times[0] / 1e9, flop / times[CALLS / 2] / 1e9, err, err_f32);
    }
    return 0;
}
