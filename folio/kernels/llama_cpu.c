/* The fused decoder of the Llama family on the CPU: every decoder layer of one step, and the final norm, in one
 * call and one OpenMP parallel region.
 *
 * Why: run layer by layer from Python, a decode step of SmolLM2 (30 layers) makes about 300 kernel calls, each
 * with its Python dispatch, ctypes argument conversion and OpenMP fork/join: about 1 s of a 14 s W1 run went
 * there (docs/performance.md). Here the team of threads is formed once per step and walks the layers; each phase
 * (norm, projection, rotary + cache write, attention, ...) is a work-shared loop whose implicit barrier orders it
 * after the previous one.
 *
 * The phases call the same bodies as the per-op kernels (cpu_ops_impl.h, cpu_gemm_impl.h,
 * paged_attention_cpu_impl.h) in the same order with the same roundings, so the fused decoder's output is
 * bit-identical to the layer-by-layer path (tests/model/test_cpu_fused.py checks it); that path stays the
 * reference and the CUDA path. Layer math, per layer l (h: the residual stream, kept in place in `hidden`):
 *   normed = rms_norm(l == 0 ? h : proj + h)  (h updated to proj + h)
 *   q|k|v  = normed @ Wqkv^T (+ bias);  rotary(q, k);  k, v -> cache;  attn = attention(q, cache)
 *   proj   = attn @ Wo^T;  normed = rms_norm(proj + h)  (h updated);  act = silu(gate) * up of normed @ Wgu^T
 *   proj   = act @ Wdown^T
 * and at the end: out = final_norm(proj + h). Under tensor parallelism each proj is this rank's partial sum, and
 * all_reduce_proj sums it over the ranks before it is used, as the row-parallel layers of the other path do.
 * Overlap: from a layer's o projection on, its GEMMs (compute-bound) also pull the next layer's decode K/V blocks
 * toward L2 / L3 (SidePrefetch in cpu_gemm.c), which the next layer's attention (memory-bound) would otherwise
 * stream from DRAM with the FMA units idle. */

/* One decoder layer's parameters: packed projections (cpu_gemm.c layout), norm weights, an optional q|k|v bias,
 * and the layer's K/V caches (head 0 of block 0; layout in LlamaModelParams). */
typedef struct {
    const void *input_norm, *post_norm; /* [H], the model's dtype */
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias; /* [(NH + 2 KV) D] float32, or NULL */
    void *k_cache, *v_cache;
    int codes4; /* the projections kept as 4-bit codes (gemm_codes4.h), float32 models only: CODES4_* bits */
} LlamaLayerParams;
/* CODES4_ON_AMX / CODES4_ON_VNNI (gemm_codes4.h: 16, 32): those GEMMs run on AMX (cpu_amx_float32) or through
 * vpdpbusd (cpu_vnni_float32) above one vector tile of rows */
enum { CODES4_QKV = 1, CODES4_O = 2, CODES4_GATE_UP = 4, CODES4_DOWN = 8 };

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const LlamaLayerParams *layers; /* [num_layers] */
    const void *final_norm;         /* [H] */
    int64_t block_size, block_stride, head_stride, pos_stride; /* every layer's cache has this layout */
    int64_t kv_prefetch_bytes; /* the next layer's decode K/V the GEMMs prefetch (SidePrefetch): < 0 half the L3 */
    /* Tensor parallelism (the o and down projections row-parallel): sums the step's `proj` buffer over the ranks
     * after each of them, called by thread 0 between barriers; returns 0, else the forward stops and returns -2
     * (a peer died: the caller raises its error). NULL at one rank. */
    int (*all_reduce_proj)(void);
} LlamaModelParams;

/* One step: the token rows, the attention plan (as CpuPagedBackend builds it) and scratch buffers. */
typedef struct {
    int64_t num_tokens;
    void *hidden;             /* [T, H]: the embeddings in; the final residual stream out */
    void *out;                /* [T, H]: the final norm's output */
    const void *cos, *sin;    /* [T, D] */
    const int64_t *slots;     /* [T] cache slot of each row */
    const int32_t *block_table;
    int64_t bt_stride;
    const int64_t *rows; /* decodes (single-token queries), see DecodeRows */
    const int32_t *row_req, *row_ctx;
    int64_t num_rows;
    const int32_t *seg_req; /* prefills (multi-token queries), see PrefillSegs */
    const int64_t *seg_row;
    const int32_t *seg_ctx, *seg_len;
    int64_t num_segs;
    /* scratch: [T, (NH + 2 KV) D], [T, NH D], [T, H]; gate_up and act [min(T, LLAMA_MLP_ROWS), 2 I] and [.., I] */
    void *qkv, *attn_out, *proj, *gate_up, *act;
    int num_threads;
    double *phase_seconds; /* [LLAMA_NUM_PHASES] wall seconds added per phase, or NULL (no timing) */
    /* The rows whose output the caller reads (ascending, distinct), or NULL for all: the last layer writes every
     * row's K/V and runs its attention, then keeps these rows only (moved to the front, in order) for the rest of
     * the layer and the final norm, so `out` holds num_out_rows rows. A prefill chunk needs the last layer's K/V
     * of every token but the rest of that layer for its last token at most: W1's prefill steps skip 1/30 of their
     * o, MLP and final norm. Rows are computed independently: the same bits in the rows kept. */
    const int64_t *out_rows;
    int64_t num_out_rows;
} LlamaStep;

/* The MLP (gate|up, SiLU-and-mul, down) runs over a step's rows this many at a time, so that the SiLU reads the
 * gate|up rows and the down projection the act rows while they are still in cache: 256 rows of gate|up (2 I floats
 * each) are 3 MiB at SmolLM2's I = 1536, where a 2048-row prefill step's 25 MB went out to DRAM and back. W1
 * float32 on Zen 3 (avx2), the steps with prefill chunks: gate|up + SiLU + down 7.43 -> 7.19 s and 7.39 -> 7.18 s in
 * two A/B runs (512 rows: 7.23; docs/performance.md, session 45). Decode steps (64 rows) are one piece either way.
 * The GEMMs' rows are independent: the same bits. */
#define LLAMA_MLP_ROWS 256

/* Row rows[i] of buffers a and b (row-major, rows of a_row_bytes and b_row_bytes) moved to row i, for each i in
 * order: rows ascending and distinct, so rows[i] >= i and no row is overwritten before it moves. */
static void keep_rows(const int64_t *rows, int64_t n, void *a, int64_t a_row_bytes, void *b, int64_t b_row_bytes) {
    for (int64_t i = 0; i < n; ++i)
        if (rows[i] != i) {
            memcpy((char *)a + i * a_row_bytes, (const char *)a + rows[i] * a_row_bytes, (size_t)a_row_bytes);
            memcpy((char *)b + i * b_row_bytes, (const char *)b + rows[i] * b_row_bytes, (size_t)b_row_bytes);
        }
}

/* LLAMA_MLP_ROWS, for the caller sizing the gate_up and act scratch */
int64_t folio_llama_mlp_rows(void) { return LLAMA_MLP_ROWS; }

/* Phases timed when LlamaStep.phase_seconds is set (their names: folio/model/cpu_fused.py PHASES). Each phase
 * ends at a barrier, so thread 0's clock between barriers is the phase's wall time. */
enum { PHASE_NORM, PHASE_QKV, PHASE_ROPE_CACHE, PHASE_DECODE_ATTN, PHASE_PREFILL_ATTN, PHASE_O, PHASE_GATE_UP,
       PHASE_SILU, PHASE_DOWN, PHASE_ALL_REDUCE, LLAMA_NUM_PHASES };

/* A GEMM k step asks for a line of the next layer's K/V every KV_PREFETCH_EVERY_MASK + 1 steps (SidePrefetch), in
 * steps of at least KV_PREFETCH_MIN_TOKENS rows: below that the GEMMs themselves wait on the weights' stream from
 * DRAM, and the extra traffic slowed them more than it saved (bf16, greedy decode of the first W1 prompts, best of
 * 6 alternating runs without / with: 4 rows 809 / 875 ms, 16 rows 1675 / 1770, 32 rows 3085 / 2982, 48 rows
 * 4335 / 4337; W1's 64: 1480 / 1521 tok/s). */
#define KV_PREFETCH_EVERY_MASK 1
#define KV_PREFETCH_MIN_TOKENS 32

/* The byte offsets of the K/V blocks the step's decode rows read, row by row, for the GEMMs to prefetch a layer
 * ahead (SidePrefetch): as many as fit in `budget` bytes of K and V (< 0: half the L3 cache; more would push the
 * first blocks out before the attention reaches them); none in a step of fewer than KV_PREFETCH_MIN_TOKENS. Returns NULL with *count 0 for none, NULL with
 * *count > 0 if it could not allocate. */
static int64_t *next_layer_kv_offsets(const DecodeRows *d, const int32_t *block_table, int64_t bt_stride,
                                      const KVLayout *kv, int64_t elem_size, int64_t budget, int64_t num_tokens,
                                      int64_t *count) {
    if (num_tokens < KV_PREFETCH_MIN_TOKENS) budget = 0;
    if (budget < 0) {
        const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
        budget = (l3 > 0 ? l3 : 8L << 20) / 2;
    }
    const int64_t max_blocks = budget / (2 * kv->block_stride * elem_size);
    int64_t n = 0;
    for (int64_t i = 0; i < d->num_rows; ++i) n += (d->row_ctx[i] + kv->block_size - 1) / kv->block_size;
    *count = n < max_blocks ? n : max_blocks;
    if (*count <= 0) {
        *count = 0;
        return NULL;
    }
    int64_t *offsets = malloc(sizeof(int64_t) * *count);
    if (offsets == NULL) return NULL;
    int64_t c = 0;
    for (int64_t i = 0; i < d->num_rows && c < *count; ++i) {
        const int32_t *row_blocks = block_table + (int64_t)d->row_req[i] * bt_stride;
        for (int64_t b = 0; b * kv->block_size < d->row_ctx[i] && c < *count; ++b)
            offsets[c++] = (int64_t)row_blocks[b] * kv->block_stride * elem_size;
    }
    return offsets;
}

#define ELEM_T float
#define SUFFIX f32
#define IS_BF16 0
#define CACHE_T float
#define CACHE_SUFFIX f32
#define FORWARD_SUFFIX f32
#include "llama_cpu_impl.h"
#undef CACHE_T
#undef CACHE_SUFFIX
#undef FORWARD_SUFFIX

/* Float32 activations and weights over a bfloat16 K/V cache (kv_cache_dtype="bfloat16"): half the bytes a decode
 * step's attention reads, and twice the tokens in a KV budget. Each row's k and v are rounded to bfloat16 (nearest
 * even, as torch's .to(torch.bfloat16), so the unfused path's cache holds the same values) as they are written; the
 * attention bodies read a float32 query against the bfloat16 cache. */
static void rope_and_cache_body_f32_kvbf16(float *qkv, int64_t qkv_stride, const float *cos, const float *sin,
                                           void *key_cache, void *value_cache, const int64_t *slots,
                                           const KVLayout *kv, int64_t num_rows, int64_t num_heads,
                                           int64_t num_kv_heads, int64_t head_dim) {
#pragma omp for
    for (int64_t t = 0; t < num_rows; ++t) {
        float *q = qkv + t * qkv_stride, *k = q + num_heads * head_dim, *v = k + num_kv_heads * head_dim;
        rotary_row_f32(q, cos + t * head_dim, sin + t * head_dim, num_heads + num_kv_heads, head_dim);
        if (slots[t] < 0) continue; /* padding */
        const int64_t base = (slots[t] / kv->block_size) * kv->block_stride + (slots[t] % kv->block_size) * kv->pos_stride;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            store_from_f32(key_cache, 1, base + h * kv->head_stride, head_dim, k + h * head_dim);
            store_from_f32(value_cache, 1, base + h * kv->head_stride, head_dim, v + h * head_dim);
        }
    }
}

#define CACHE_T uint16_t
#define CACHE_SUFFIX bf16
#define FORWARD_SUFFIX f32_kvbf16
#include "llama_cpu_impl.h"
#undef ELEM_T
#undef SUFFIX
#undef IS_BF16
#undef CACHE_T
#undef CACHE_SUFFIX
#undef FORWARD_SUFFIX

#define ELEM_T uint16_t
#define SUFFIX bf16
#define IS_BF16 1
#define CACHE_T uint16_t
#define CACHE_SUFFIX bf16
#define FORWARD_SUFFIX bf16
#include "llama_cpu_impl.h"
#undef ELEM_T
#undef SUFFIX
#undef IS_BF16
#undef CACHE_T
#undef CACHE_SUFFIX
#undef FORWARD_SUFFIX
