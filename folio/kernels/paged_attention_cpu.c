/* Paged attention on the CPU, float32, reading K/V blocks in place (no gather, no padding).
 *
 * One work item = one query row x one KV head: the G = num_heads / num_kv_heads query heads that share the KV
 * head walk the row's blocks twice (scores, then the weighted sum of V), so each K/V row is read once per item
 * straight out of the cache. Items are spread over the OpenMP threads of torch's own runtime (the library is
 * loaded after torch, so "libgomp.so.1" resolves to the copy torch already loaded).
 *
 * The cache holds float32 or bfloat16 (folio_paged_attention_f32 / _bf16); scores and sums are float32.
 *
 * Layouts:
 *   q, out       [T, H, D]          rows[i] selects the query row of item row i; q's rows may be strided, and q
 *                                   and out may each be float32 or bfloat16 (converted once per item)
 *   k/v_cache    [NB, BS, KV, D]    position p of a request lives at block_table[req][p / BS], offset p % BS
 *   block_table  [R, bt_stride] int32
 *   row_req [N] int32 request of each row; row_ctx [N] int32 positions 0..row_ctx-1 are visible to the row.
 * Example: a decode at context 9 has row_ctx 9; the 3 rows of a chunk at positions 6, 7, 8 have 7, 8, 9.
 *
 * With AVX-512 and head_dim a multiple of 16 (64 and 128 in practice), the per-position work is unrolled for the
 * group size at compile time so the G x head_dim/16 accumulators stay in registers. An AVX2 build (x86-64-v3)
 * has its own bodies for head_dim 64 and 128 and groups 1-8 (decode_attention_avx2.h, prefill_attention_avx2.h:
 * 8-float vectors, work cut to fit 16 registers). Other shapes, and the generic build, take the plain C loops,
 * which the compiler vectorizes over head_dim.
 */
#include "cpu_common.h"

/* The AVX2 + FMA bodies (x86-64-v3 builds: 8-float vectors, 16 registers): decode_attention_avx2.h and
 * prefill_attention_avx2.h. An AVX-512 build never compiles them (its own bodies are tuned for 16 lanes). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGED_ATTN_AVX2 1
#else
#define PAGED_ATTN_AVX2 0
#endif

/* query rows per prefill work item (see folio_prefill_attention_*) */
#define PREFILL_TILE 16
/* query heads one decode call handles at once (the AVX-512 path keeps a max and a sum per head on the stack) */
#define DECODE_MAX_HEADS 64

/* What both attention entry points read: q [T, H, D] (rows q_row_stride apart, heads packed; bf16 if q_bf16),
 * out [T, H, D] contiguous (bf16 if out_bf16), the caches of the K/V element type the body is built for, their
 * strides in elements, and the block table [R, bt_stride]. */
typedef struct {
    const void *q;
    int64_t q_row_stride;
    int q_bf16;
    void *out;
    int out_bf16;
    const void *k_cache, *v_cache;
    int64_t block_stride, head_stride, pos_stride, block_size;
    const int32_t *block_table;
    int64_t bt_stride;
    int64_t num_heads, num_kv_heads, head_dim;
    float scale;
} PagedArgs;

/* single-token queries: query row rows[i] of request row_req[i] sees positions 0 .. row_ctx[i] - 1 */
typedef struct {
    const int64_t *rows;
    const int32_t *row_req, *row_ctx;
    int64_t num_rows;
} DecodeRows;

/* multi-token queries: segments of consecutive rows (see folio_prefill_attention_*), cut into tiles of up to
 * PREFILL_TILE rows by prefill_plan_tiles */
typedef struct {
    const int32_t *seg_req;
    const int64_t *seg_row;
    const int32_t *seg_ctx, *seg_len;
    int64_t num_segs;
    int64_t *tile_seg, *tile_first; /* tile t: rows tile_first[t] .. of segment tile_seg[t] */
    int64_t num_tiles;
} PrefillSegs;

/* Fills p's tile list, longest contexts first (the last tiles of long segments cost most; dynamic scheduling then
 * balances). Returns 0, or -1 if it could not allocate. */
static int prefill_plan_tiles(PrefillSegs *p) {
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < p->num_segs; ++s) num_tiles += (p->seg_len[s] + PREFILL_TILE - 1) / PREFILL_TILE;
    p->tile_seg = malloc(sizeof(int64_t) * (num_tiles > 0 ? num_tiles : 1));
    p->tile_first = malloc(sizeof(int64_t) * (num_tiles > 0 ? num_tiles : 1));
    if (p->tile_seg == NULL || p->tile_first == NULL) return -1;
    int64_t t = 0;
    for (int64_t s = 0; s < p->num_segs; ++s)
        for (int64_t first = ((p->seg_len[s] - 1) / PREFILL_TILE) * PREFILL_TILE; first >= 0; first -= PREFILL_TILE) {
            p->tile_seg[t] = s;
            p->tile_first[t++] = first;
        }
    p->num_tiles = num_tiles;
    return 0;
}

static void prefill_free_tiles(PrefillSegs *p) {
    free(p->tile_seg);
    free(p->tile_first);
    p->tile_seg = p->tile_first = NULL;
}

/* context positions per block of the AVX-512 prefill tile (prefill_attention_blocks.h) */
#define DP_BLOCK 128

/* One thread's scratch for both bodies, carved out of one arena (so a whole step allocates once). */
typedef struct {
    float *scores;            /* decode: [H, max_ctx rounded up to 16] */
    float *acc;               /* decode, plain-C path: [G, D] */
    float *q_row, *out_row;   /* decode: [H, D] */
    float *q_tile, *out_tile; /* prefill: [PREFILL_TILE, G, D] */
    float *kt, *vc;           /* prefill, plain-C tile: [16, D] each */
    float *state;             /* prefill: [PREFILL_TILE, G, 2] */
    /* prefill, AVX-512 block tile: a context block's K and V rearranged (up to [DP_BLOCK, D] 32-bit words
     * each), its scores [PREFILL_TILE G, DP_BLOCK], probabilities (up to [PREFILL_TILE G, DP_BLOCK] words) and
     * each pair's rescale factor [PREFILL_TILE G] */
    float *kp, *vp, *probs; /* 32-bit words of either kind, read and written through vector intrinsics */
    float *block_scores, *rescale;
} AttnScratch;

/* Points s's regions into base (each on a cache line: the AVX-512 loads of kp / vp are whole lines), or with
 * base NULL only measures them. Returns the floats one thread's scratch takes. */
static int64_t attn_scratch_carve(AttnScratch *s, float *base, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t max_ctx) {
    const int64_t group = num_heads / num_kv_heads, ctx16 = (max_ctx + 15) / 16 * 16;
    const int64_t tile_pairs = PREFILL_TILE * group;
    float **regions[] = {&s->scores, &s->acc, &s->q_row, &s->out_row, &s->q_tile, &s->out_tile, &s->kt, &s->vc,
                         &s->state, &s->kp, &s->vp, &s->probs, &s->block_scores, &s->rescale};
    const int64_t sizes[] = {num_heads * ctx16, group * head_dim, num_heads * head_dim, num_heads * head_dim,
                             tile_pairs * head_dim, tile_pairs * head_dim, 16 * head_dim, 16 * head_dim,
                             2 * tile_pairs, DP_BLOCK * head_dim, DP_BLOCK * head_dim, tile_pairs * DP_BLOCK,
                             tile_pairs * DP_BLOCK, tile_pairs};
    int64_t offset = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) {
        if (base != NULL) *regions[i] = base + offset;
        offset += (sizes[i] + 15) / 16 * 16;
    }
    return offset;
}

static int64_t attn_scratch_floats(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t max_ctx) {
    AttnScratch unused;
    return attn_scratch_carve(&unused, NULL, num_heads, num_kv_heads, head_dim, max_ctx);
}

/* The arena of a call's threads: per_thread floats each, on a cache line */
static float *attn_arena(int64_t per_thread, int num_threads) {
    return aligned_alloc(64, sizeof(float) * (size_t)(per_thread * num_threads));
}

#if PAGED_ATTN_AVX2
#include "attention_avx2_helpers.h"
#endif


/* dst[0..n) = src[offset..offset+n) as float32, src float32 or (is_bf16) bfloat16 */
static void load_as_f32(const void *src, int is_bf16, int64_t offset, int64_t n, float *dst) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        int64_t j = 0;
#ifdef __AVX512F__
        for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, load16_bf16(s + j));
#elif PAGED_ATTN_AVX2
        for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, load8_bf16(s + j));
#endif
        for (; j < n; ++j) dst[j] = bf16_to_f32(s[j]);
    } else {
        memcpy(dst, (const float *)src + offset, sizeof(float) * n);
    }
}

static void store_from_f32(void *dst, int is_bf16, int64_t offset, int64_t n, const float *src) {
    if (is_bf16) {
        uint16_t *d = (uint16_t *)dst + offset;
        int64_t j = 0;
#ifdef __AVX512F__
        for (; j + 16 <= n; j += 16) store16_bf16(d + j, _mm512_loadu_ps(src + j)); /* finite values */
#elif PAGED_ATTN_AVX2
        for (; j + 8 <= n; j += 8) _mm_storeu_si128((__m128i *)(d + j), f32x8_to_bf16(_mm256_loadu_ps(src + j)));
#endif
        for (; j < n; ++j) d[j] = f32_to_bf16(src[j]);
    } else {
        memcpy((float *)dst + offset, src, sizeof(float) * n);
    }
}

#ifdef __AVX512F__
/* r[i] <- column i of the 16 x 16 block whose rows are r[0..15] (unpack, shuffle within and across lanes) */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);     /* a0 b0 a1 b1 | a4 b4 a5 b5 | ... */
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]); /* a2 b2 a3 b3 | ... */
    }
    for (int i = 0; i < 4; ++i) { /* r[4i + k], lane L: rows 4i..4i+3 of column k + 4L */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) { /* column k + 4L = lane L of r[k], r[4 + k], r[8 + k], r[12 + k] */
        const __m512 u0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), u1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
        t[k] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        t[k + 4] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
        t[k + 8] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        t[k + 12] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

#ifdef __AVX512BF16__
/* 32 bf16 from memory as a dot-product operand (a cast of _mm512_loadu_si512's result made gcc 12 bounce every
 * load through the stack) */
static inline __m512bh load32_bh(const void *p) {
    __m512bh v;
    memcpy(&v, p, sizeof v);
    return v;
}
#endif

/* a 32-bit word from memory broadcast to every lane (memcpy: the buffers hold floats or bf16 pairs, and a plain
 * int32_t read of them would break C's aliasing rules; it compiles to one vpbroadcastd) */
static inline __m512i broadcast_word(const void *p) {
    int32_t w;
    memcpy(&w, p, sizeof w);
    return _mm512_set1_epi32(w);
}

/* lane j of the result = the sum of the 16 lanes of s[j]: a reduction tree (45 shuffles and adds for 16 sums,
 * where 16 separate horizontal sums take about 130) */
static inline __m512 reduce16(const __m512 s[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i) /* lane-local pair sums of s[2i], s[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
    for (int i = 0; i < 4; ++i) /* 128-bit lane L of b[i]: the lane-L sums of s[4i .. 4i+3] */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}
#endif

/* The start of a prefill tile (every kind): returns the longest context among its rows, resets each (row, head)
 * pair's running max and sum (state[2i], state[2i + 1]) and zeroes its output. */
static int64_t prefill_tile_begin(const int32_t *ctx_of_row, int64_t rows, int64_t pairs, int64_t head_dim,
                                  float *out_tile, float *state) {
    int64_t max_ctx = 0;
    for (int64_t r = 0; r < rows; ++r) max_ctx = ctx_of_row[r] > max_ctx ? ctx_of_row[r] : max_ctx;
    for (int64_t i = 0; i < pairs; ++i) {
        state[2 * i] = -FLT_MAX;
        state[2 * i + 1] = 0.0f;
    }
    memset(out_tile, 0, sizeof(float) * pairs * head_dim);
    return max_ctx;
}

/* probs[g][p] = softmax_p(scores[g][p]) in place, for each of the group's query heads */
static void softmax_rows(float *scores, int64_t group, int64_t ctx) {
    for (int64_t g = 0; g < group; ++g) {
        float *sg = scores + g * ctx;
        float m = -FLT_MAX;
        for (int64_t p = 0; p < ctx; ++p) m = sg[p] > m ? sg[p] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < ctx; ++p) {
            sg[p] = expf(sg[p] - m);
            sum += sg[p];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t p = 0; p < ctx; ++p) sg[p] *= inv;
    }
}

#define KV_T float
#define KV_SUFFIX f32
#define KV_SCALAR(x) (x)
#define KV_LOAD16 load16_f32
#define KV_IS_BF16 0
#include "paged_attention_cpu_impl.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_SCALAR
#undef KV_LOAD16
#undef KV_IS_BF16

#define KV_T uint16_t
#define KV_SUFFIX bf16
#define KV_SCALAR(x) bf16_to_f32(x)
#define KV_LOAD16 load16_bf16
#define KV_IS_BF16 1
#include "paged_attention_cpu_impl.h"
#undef KV_T
#undef KV_SUFFIX
#undef KV_SCALAR
#undef KV_LOAD16
#undef KV_IS_BF16
