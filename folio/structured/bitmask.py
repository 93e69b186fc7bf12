"""The sampler's first stage: apply a grammar's token bitmask to logits, with plain torch ops (no torch.compile,
whose first call costs tens of seconds on the CPU).

Bit j of int32 word w set = token 32 w + j allowed. The words become one bool per token (numpy's unpackbits on the
CPU, shifts on other devices), then ``torch.where(allowed, logits, -inf)`` writes the masked logits in one
vectorized pass. (``masked_fill`` with a bool mask runs a branchy loop on the CPU: 3.4 ms for 64 x 49152 vs
1.7 ms on one thread here; a [256, 8] table of +-inf limits gathered per byte costs 3.4 ms.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch

assert sys.byteorder == "little", "the bitmask's bytes are read as little-endian int32 words"


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, ceil(V / 32)] int32 -> [R, V] bool, True = allowed. Example: [[0b101]], V = 3 -> [[T, F, T]]."""
    if bitmask.device.type == "cpu":
        as_bytes = np.ascontiguousarray(bitmask.numpy()).view(np.uint8)  # [R, 4 W]: byte k of word w first
        bits = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits).view(torch.bool)
    return allowed_tokens_by_shifts(bitmask, vocab_size)


def allowed_tokens_by_shifts(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """allowed_tokens in torch ops alone, on the bitmask's device (CUDA; tested on the CPU against unpackbits)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A new float32 tensor: logits [R, V] with -inf wherever bitmask [R, ceil(V / 32)] has a 0 bit."""
    allowed = allowed_tokens(bitmask, logits.shape[1])
    return torch.where(allowed, logits.to(torch.float32), float("-inf"))


def apply_token_bitmask_rows(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Returns a float32 copy of ``logits`` [S, V] with bitmask [C, W] applied to rows ``rows`` [C] (int64) only;
    the other rows are unchanged. The input is never modified."""
    if rows.numel() == logits.shape[0]:  # every row constrained, in order (bitmask_for_rows keeps row order)
        return masked_logits(logits, bitmask)
    out = logits.to(torch.float32, copy=True)
    out.index_copy_(0, rows, masked_logits(out.index_select(0, rows), bitmask))
    return out


def constrained_greedy(
    greedy_ids: torch.Tensor, grammar_bitmask: tuple[torch.Tensor, torch.Tensor], logits_of: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """Greedy tokens under the grammar, from the unconstrained arg-max ``greedy_ids`` [S] (the model's fused LM-head
    arg-max, no logits). Where a row's arg-max is allowed it is also the arg-max over the allowed tokens, ties
    included (the first index holding the maximum of the row is the first allowed one holding it); only the rows
    whose arg-max is banned get logits (``logits_of(rows)`` -> [B, V]), masked, and their arg-max. Exact."""
    rows, bitmask = grammar_bitmask
    tokens = greedy_ids.index_select(0, rows)  # [C]
    words = bitmask.gather(1, (tokens // 32).unsqueeze(1)).squeeze(1)  # [C] int32: the word holding each token
    allowed = ((words >> (tokens % 32).to(torch.int32)) & 1).bool()
    if bool(allowed.all()):
        return greedy_ids
    banned = (~allowed).nonzero().flatten()
    banned_rows = rows.index_select(0, banned)
    fixed = masked_logits(logits_of(banned_rows), bitmask.index_select(0, banned)).argmax(dim=-1)
    return greedy_ids.index_copy(0, banned_rows, fixed.to(greedy_ids.dtype))


def bitmask_for_rows(
    sample_req_ids: list[str],
    bitmask_req_ids: list[str],
    bitmask: np.ndarray | None,
    device: torch.device,
    rows_per_request: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Select the rows of this step's grammar bitmask (row i belongs to ``bitmask_req_ids[i]``) that the sampler
    needs: (rows [C] int64 into the sampling rows, bitmask [C, W] int32), in sampling-row order; None if none.
    ``rows_per_request``: request m has that many consecutive sampling rows (speculative decoding: its drafts + 1),
    matched to as many consecutive bitmask rows from the first of its id (default: one row each).

    Example: sample_req_ids [a, b, c], bitmask_req_ids [c, a] -> rows [0, 2], bitmask rows [1, 0].
    With rows_per_request [2, 1, 1] and bitmask_req_ids [c, a, a] -> rows [0, 1, 3], bitmask rows [1, 2, 0].
    """
    if bitmask is None or not bitmask_req_ids:
        return None
    first_row: dict[str, int] = {}
    for row, req_id in enumerate(bitmask_req_ids):
        first_row.setdefault(req_id, row)
    counts = rows_per_request if rows_per_request is not None else [1] * len(sample_req_ids)
    rows: list[int] = []
    bitmask_rows: list[int] = []
    start = 0
    for req_id, count in zip(sample_req_ids, counts, strict=True):
        if req_id in first_row:
            rows.extend(range(start, start + count))
            bitmask_rows.extend(range(first_row[req_id], first_row[req_id] + count))
        start += count
    if not rows:
        return None
    selected = torch.from_numpy(np.ascontiguousarray(bitmask[bitmask_rows]))
    return torch.tensor(rows, dtype=torch.int64).to(device), selected.to(device)
