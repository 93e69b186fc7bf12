/* Whole KV blocks from one set of layer caches into another: the host tier's stores and loads, copy-on-write.
 *
 * In every layer cache ([2, blocks, ...] in storage order) a block's K is one contiguous run of block_bytes and its
 * V another, so each is one memcpy (libc's, which picks its own vector width on every tier): one read and one write
 * of each byte, where ATen's gather-then-scatter reads and writes every byte twice. The runs are split over the
 * threads. Strides and sizes are in bytes; the ids are checked by the caller (folio/kernels/kv_block_copy.py), as
 * are the destinations (each once, none also a source: the runs may land in any order). */
void folio_copy_kv_blocks(const int64_t *src_layers, const int64_t *dst_layers, int64_t num_layers,
                          int64_t src_kv_stride, int64_t dst_kv_stride, int64_t src_block_stride,
                          int64_t dst_block_stride, int64_t block_bytes, const int64_t *src_ids,
                          const int64_t *dst_ids, int64_t num_blocks, int threads) {
    const int64_t runs = num_layers * 2 * num_blocks;
#pragma omp parallel for num_threads(threads) schedule(static) if (runs > 1)
    for (int64_t run = 0; run < runs; run++) {
        const int64_t layer = run / (2 * num_blocks), kv = run / num_blocks % 2, i = run % num_blocks;
        const char *src = (const char *)(intptr_t)src_layers[layer] + kv * src_kv_stride + src_ids[i] * src_block_stride;
        char *dst = (char *)(intptr_t)dst_layers[layer] + kv * dst_kv_stride + dst_ids[i] * dst_block_stride;
        memcpy(dst, src, (size_t)block_bytes);
    }
}
