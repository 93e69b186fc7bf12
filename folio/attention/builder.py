"""Builds AttnMetadata (and the matching positions) from per-request Python lists.

For tests, profiling runs and any caller that has a batch as lists rather than the worker's persistent
buffers. Worked example, a 3-token prefill from scratch and a decode at context 9, block_size 4:

    query_lens [3, 1], seq_lens [3, 9], block_tables [[0], [1, 2, 3]]
    -> query_start_loc [0, 3, 4]
       positions       [0, 1, 2, 8]          (request i's queries are its last query_lens[i] positions)
       slot_mapping    [0, 1, 2, 12]         (position 8 -> block index 8 // 4 = 2 -> block 3 -> 3 * 4 + 0)
       block_table     [[0, 0, 0], [1, 2, 3]]  (rows padded with 0 to the longest table)
"""

from __future__ import annotations

import torch

from folio.attention.metadata import AttnMetadata


def compute_positions(query_lens: list[int], seq_lens: list[int]) -> list[int]:
    """Position of every query token: request i contributes seq_lens[i] - query_lens[i] .. seq_lens[i] - 1."""
    positions: list[int] = []
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        positions.extend(range(seq_len - query_len, seq_len))
    return positions


def assign_contiguous_blocks(seq_lens: list[int], block_size: int, first_block_id: int = 0) -> list[list[int]]:
    """Block tables giving each request fresh consecutive blocks: seq_lens [3, 9], block_size 4 -> [[0], [1, 2, 3]]."""
    tables = []
    next_block_id = first_block_id
    for seq_len in seq_lens:
        num_blocks = -(-seq_len // block_size)
        tables.append(list(range(next_block_id, next_block_id + num_blocks)))
        next_block_id += num_blocks
    return tables


def build_attn_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttnMetadata:
    """AttnMetadata for requests whose query tokens are flattened in request order (see the module example).

    Raises ValueError if a request's queries exceed its context or its block table is too short for seq_len.
    """
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"got {len(query_lens)} query_lens, {len(seq_lens)} seq_lens, {len(block_tables)} block tables"
        )
    slot_mapping: list[int] = []
    for i, (query_len, seq_len, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 0 <= query_len <= seq_len:
            raise ValueError(f"request {i}: query_len {query_len} must be in [0, seq_len {seq_len}]")
        if len(table) * block_size < seq_len:
            raise ValueError(f"request {i}: {len(table)} blocks of {block_size} cannot hold seq_len {seq_len}")
        for pos in range(seq_len - query_len, seq_len):
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
    cu_query_lens = [0]
    for query_len in query_lens:
        cu_query_lens.append(cu_query_lens[-1] + query_len)
    max_blocks = max((len(table) for table in block_tables), default=0)
    padded_tables = [table + [0] * (max_blocks - len(table)) for table in block_tables]
    return AttnMetadata(
        query_start_loc=torch.tensor(cu_query_lens, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(padded_tables, dtype=torch.int32, device=device).reshape(
            len(block_tables), max_blocks
        ),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=cu_query_lens,
        seq_lens_cpu=list(seq_lens),
    )
