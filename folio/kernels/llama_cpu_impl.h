/* The fused decoder for one element type of activations and weights (ELEM_T, SUFFIX: f32, bf16; IS_BF16) and one
 * of the K/V cache (CACHE_T, CACHE_SUFFIX: the same, or bf16 under float32 activations), included once per pair by
 * llama_cpu.c, which names the entry point folio_llama_forward_<FORWARD_SUFFIX> and the rotary + cache write
 * rope_and_cache_body_<FORWARD_SUFFIX>. Returns 0, -1 if a buffer could not be allocated, -2 if the
 * tensor-parallel all-reduce failed (the layers after it not run). */
int CAT(folio_llama_forward_, FORWARD_SUFFIX)(const LlamaModelParams *m, const LlamaStep *s) {
    const int64_t T_all = s->num_tokens, H = m->hidden, D = m->head_dim, inter = m->intermediate;
    const int64_t q_size = m->num_heads * D, qkv_size = q_size + 2 * m->num_kv_heads * D;
    ELEM_T *hidden = s->hidden, *out = s->out, *qkv = s->qkv, *attn_out = s->attn_out, *proj = s->proj;
    ELEM_T *gate_up = s->gate_up, *act = s->act;
    const KVLayout kv = {m->block_size, m->block_stride, m->head_stride, m->pos_stride};
    const DecodeRows decode = {s->rows, s->row_req, s->row_ctx, s->num_rows};
    PrefillSegs prefill = {s->seg_req, s->seg_row, s->seg_ctx, s->seg_len, s->num_segs, NULL, NULL, 0};
    int64_t max_ctx = 1;
    for (int64_t i = 0; i < s->num_rows; ++i) max_ctx = s->row_ctx[i] > max_ctx ? s->row_ctx[i] : max_ctx;
    const int64_t per_thread = attn_scratch_floats(m->num_heads, m->num_kv_heads, D, max_ctx);
    float *arena = attn_arena(per_thread, s->num_threads);
    int64_t num_offsets = 0;
    int64_t *kv_offsets = next_layer_kv_offsets(&decode, s->block_table, s->bt_stride, &kv, (int64_t)sizeof(CACHE_T),
                                                m->kv_prefetch_bytes, T_all, &num_offsets);
    if (arena == NULL || prefill_plan_tiles(&prefill) != 0 || (num_offsets > 0 && kv_offsets == NULL)) {
        free(arena);
        free(kv_offsets);
        prefill_free_tiles(&prefill);
        return -1;
    }
    int reduce_failed = 0; /* shared: set by thread 0, read by every thread after the barrier that follows */
#pragma omp parallel num_threads(s->num_threads)
    {
        AttnScratch scratch;
        attn_scratch_carve(&scratch, arena + per_thread * omp_get_thread_num(), m->num_heads, m->num_kv_heads, D,
                           max_ctx);
        const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
        /* this thread's share of the offsets ends at .count; idle (.index = .count) until a layer starts it */
        SidePrefetch side = {.offsets = kv_offsets, .count = num_offsets * (tid + 1) / nt,
                             .index = num_offsets * (tid + 1) / nt,
                             .block_lines = kv.block_stride * (int64_t)sizeof(CACHE_T) / 64,
                             .every_mask = KV_PREFETCH_EVERY_MASK};
        double *timing = tid == 0 ? s->phase_seconds : NULL;
        double last = timing != NULL ? omp_get_wtime() : 0.0;
#define PHASE_DONE(k)                                                                                            \
    if (timing != NULL) {                                                                                        \
        const double now = omp_get_wtime();                                                                      \
        timing[k] += now - last;                                                                                 \
        last = now;                                                                                              \
    }
/* tensor parallelism: proj (complete: its GEMM ended at a barrier) summed over the ranks by thread 0, the others
 * waiting at the barrier; on a failure every thread leaves the layer loop */
#define ALL_REDUCE_PROJ()                                                                                        \
    if (m->all_reduce_proj != NULL) {                                                                            \
        _Pragma("omp master") if (m->all_reduce_proj() != 0) reduce_failed = 1;                                  \
        _Pragma("omp barrier") PHASE_DONE(PHASE_ALL_REDUCE) if (reduce_failed) break;                            \
    }
/* a projection's GEMM: over its float32 layout, or over its 4-bit codes where the layer's codes4 bit says so */
#if IS_BF16
#define LAYER_GEMM(bit, x, lda, w, ...) CAT(gemm_body_, SUFFIX)(x, lda, w, __VA_ARGS__);
#else
#define LAYER_GEMM(bit, x, lda, w, ...)                                                                          \
    if (p->codes4 & (bit))                                                                                       \
        gemm_body_codes4(x, lda, (const uint8_t *)(w), __VA_ARGS__, p->codes4 & (CODES4_ON_AMX | CODES4_ON_VNNI)); \
    else                                                                                                         \
        gemm_body_f32(x, lda, w, __VA_ARGS__);
#endif
        int64_t T = T_all; /* the rows the phases run over: all of them until the last layer's attention */
        for (int64_t l = 0; l < m->num_layers; ++l) {
            const LlamaLayerParams *p = &m->layers[l];
            if (l == 0) /* the embeddings are the residual stream; the layer's input is their norm */
                CAT(rms_norm_body_, SUFFIX)(hidden, H, NULL, p->input_norm, out, NULL, T, H, m->eps);
            else
                CAT(rms_norm_body_, SUFFIX)(proj, H, hidden, p->input_norm, out, hidden, T, H, m->eps);
            PHASE_DONE(PHASE_NORM)
            LAYER_GEMM(CODES4_QKV, out, H, p->qkv, p->qkv_bias, qkv, IS_BF16, qkv_size, T, qkv_size, H, &side)
            PHASE_DONE(PHASE_QKV)
            CAT(rope_and_cache_body_, FORWARD_SUFFIX)(qkv, qkv_size, s->cos, s->sin, p->k_cache, p->v_cache, s->slots, &kv,
                                                      T, m->num_heads, m->num_kv_heads, D);
            PHASE_DONE(PHASE_ROPE_CACHE)
            const PagedArgs attn = {qkv, qkv_size, IS_BF16, attn_out, IS_BF16, p->k_cache, p->v_cache,
                                    m->block_stride, m->head_stride, m->pos_stride, m->block_size, s->block_table,
                                    s->bt_stride, m->num_heads, m->num_kv_heads, D, m->scale};
            if (decode.num_rows > 0) CAT(decode_body_, CACHE_SUFFIX)(&attn, &decode, &scratch);
            PHASE_DONE(PHASE_DECODE_ATTN)
            if (prefill.num_tiles > 0) CAT(prefill_body_, CACHE_SUFFIX)(&attn, &prefill, &scratch);
            PHASE_DONE(PHASE_PREFILL_ATTN)
            if (l + 1 == m->num_layers && s->out_rows != NULL && s->num_out_rows < T) {
                /* one thread, in order: row out_rows[i] >= i may be the source of a later row's move */
#pragma omp single
                keep_rows(s->out_rows, s->num_out_rows, attn_out, q_size * (int64_t)sizeof(ELEM_T), hidden,
                          H * (int64_t)sizeof(ELEM_T));
                T = s->num_out_rows;
            }
            /* from here on (this layer's o, gate|up, down and the next one's q|k|v) the GEMMs prefetch the next
             * layer's K/V blocks, this thread's share of them; nothing after the last layer */
            side.index = l + 1 < m->num_layers ? num_offsets * tid / nt : side.count;
            side.line = 0;
            if (l + 1 < m->num_layers) {
                side.k_base = (const char *)m->layers[l + 1].k_cache;
                side.v_base = (const char *)m->layers[l + 1].v_cache;
            }
            LAYER_GEMM(CODES4_O, attn_out, q_size, p->o, NULL, proj, IS_BF16, H, T, H, q_size, &side)
            PHASE_DONE(PHASE_O)
            ALL_REDUCE_PROJ()
            CAT(rms_norm_body_, SUFFIX)(proj, H, hidden, p->post_norm, out, hidden, T, H, m->eps);
            PHASE_DONE(PHASE_NORM)
            /* the MLP LLAMA_MLP_ROWS rows at a time: its gate|up and act scratch rows stay in cache between the
             * three phases, and hold only that many rows */
            for (int64_t r0 = 0; r0 < T; r0 += LLAMA_MLP_ROWS) {
                const int64_t rows = T - r0 < LLAMA_MLP_ROWS ? T - r0 : LLAMA_MLP_ROWS;
                LAYER_GEMM(CODES4_GATE_UP, out + r0 * H, H, p->gate_up, NULL, gate_up, IS_BF16, 2 * inter, rows,
                           2 * inter, H, &side)
                PHASE_DONE(PHASE_GATE_UP)
                CAT(silu_and_mul_body_, SUFFIX)(gate_up, 2 * inter, act, rows, inter);
                PHASE_DONE(PHASE_SILU)
                LAYER_GEMM(CODES4_DOWN, act, inter, p->down, NULL, proj + r0 * H, IS_BF16, H, rows, H, inter, &side)
                PHASE_DONE(PHASE_DOWN)
            }
            ALL_REDUCE_PROJ()
        }
        if (!reduce_failed) {
            CAT(rms_norm_body_, SUFFIX)(proj, H, hidden, m->final_norm, out, hidden, T, H, m->eps);
            PHASE_DONE(PHASE_NORM)
        }
#undef LAYER_GEMM
#undef ALL_REDUCE_PROJ
#undef PHASE_DONE
    }
    prefill_free_tiles(&prefill);
    free(kv_offsets);
    free(arena);
    return reduce_failed ? -2 : 0;
}
