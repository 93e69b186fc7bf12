"""The Triton paged-attention kernel behind TritonPagedBackend (folio/attention/backends/triton_paged.py).

Imported only where triton is installed. Layouts: query/out [T, H, D] (rows may be strided, as views of the
fused q|k|v output), key/value caches [num_blocks, block_size, KV, D] through their strides (either cache
layout), block_table [R, max_blocks] int32, query_start_loc [R + 1] and seq_lens [R] int32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The last request i with query_start_loc[i] // BLOCK_Q + i <= q_block (its first q-block's number).

    query_start_loc [0, 3, 4], BLOCK_Q 2 -> first q-blocks [0, 2, 4]: q-blocks 0, 1 are request 0's, 2, 3
    request 1's (3 is past its single token and exits).
    """
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,  # positions per KV block
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # tile rows: BLOCK_Q * GROUP, padded to a power of two
    TILE_N: tl.constexpr,  # context positions per K/V tile
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,  # upcast dot operands (Triton's CPU interpreter gets bfloat16 dots wrong)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_in_req = q_block - (q_start // BLOCK_Q + req)
    if q_block_in_req * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # positions cached before this step's queries

    # Row m of the tile is query token m // GROUP of this q-block, head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    token = q_block_in_req * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < q_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_offsets = (q_start + token)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_IN_FLOAT32:
        q = q.to(tl.float32)
    q_pos = context_len + token  # [BLOCK_M]: the last position each row sees

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # The tile's last query sees up to this position (exclusive); no row needs the tiles after it.
    kv_end = tl.minimum(seq_len, context_len + (q_block_in_req + 1) * BLOCK_Q)
    for tile_start in range(0, kv_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        pos_valid = pos < kv_end
        # position -> (block id from the table, offset in the block); block_size 4, pos 9 -> table[2], offset 1
        block_ids = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=pos_valid, other=0)
        offsets = pos % BLOCK_SIZE
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k_offsets = (
            block_ids[:, None].to(tl.int64) * stride_kb + offsets[:, None] * stride_ko + kv_head * stride_kh + dims
        )
        k = tl.load(k_cache_ptr + k_offsets, mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_PAD]
        scores = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N]
        visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet (padding rows)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offsets = (
            block_ids[:, None].to(tl.int64) * stride_vb + offsets[:, None] * stride_vo + kv_head * stride_vh + dims
        )
        v = tl.load(v_cache_ptr + v_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offsets = (q_start + token)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
