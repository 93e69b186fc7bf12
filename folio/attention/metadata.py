"""AttnMetadata: the flattened batch layout that the worker builds and every attention backend reads.

R = requests in the step, T = tokens in the step. Request i owns query rows
query_start_loc[i] : query_start_loc[i+1]; those are its last (query_len) positions out of seq_lens[i].
Example: two requests, one a 3-token prefill chunk from scratch and one decode at context 9:
    query_start_loc [0, 3, 4], seq_lens [3, 9] -> positions [0, 1, 2, 8].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttnMetadata:
    query_start_loc: torch.Tensor  # [R + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [R] int32, context length after this step (computed + scheduled)
    block_table: torch.Tensor  # [R, max_blocks] int32, KV block ids per request (unused tail: 0)
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset where each token's K/V is written
    max_query_len: int
    max_seq_len: int
    # Host copies of the small index arrays, so backends that loop per request do not sync the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]
