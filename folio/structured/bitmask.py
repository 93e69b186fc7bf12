"""The sampler's first stage: apply a grammar's token bitmask to logits, in plain torch (no torch.compile, whose
first call costs tens of seconds on the CPU).

Bit j of int32 word w set = token 32 w + j allowed. ``torch.masked_fill`` with a bool mask runs a branchy scalar
loop on the CPU (11 ms for 64 x 49152 random bits here); instead each byte of the mask picks a row of 8 limits
(+inf allowed, -inf banned) from a [256, 8] table and ``torch.minimum`` applies them: min(x, +inf) = x and
min(x, -inf) = -inf exactly, vectorized (3 ms on one thread for the same batch).
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

assert sys.byteorder == "little", "the bitmask's bytes are read as little-endian int32 words"


@functools.cache
def _byte_limits(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: row b, column j is +inf if bit j of byte b is set, else -inf."""
    bits = (np.arange(256, dtype=np.int64)[:, None] >> np.arange(8)) & 1
    return torch.from_numpy(np.where(bits == 1, np.inf, -np.inf).astype(np.float32)).to(device)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [R, V] float32 get -inf wherever bitmask [R, ceil(V / 32)] int32 (same device) has a 0 bit.

    Example: V = 3, bitmask [[0b101]] -> logits [[a, b, c]] become [[a, -inf, c]].
    """
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    byte_values = bitmask.contiguous().view(torch.uint8).to(torch.int64)  # [R, 4 W], byte k of word w first
    limits = _byte_limits(logits.device)[byte_values].view(num_rows, -1)[:, :vocab_size]  # [R, V]
    torch.minimum(logits, limits, out=logits)


def apply_token_bitmask_rows(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Returns a float32 copy of ``logits`` [S, V] with bitmask [C, W] applied to rows ``rows`` [C] (int64) only;
    the other rows are unchanged. The input is never modified."""
    out = logits.to(torch.float32, copy=True)
    if rows.numel() == out.shape[0]:  # every row constrained, in order (the caller guarantees the order)
        apply_token_bitmask(out, bitmask)
        return out
    picked = out.index_select(0, rows)
    apply_token_bitmask(picked, bitmask)
    out.index_copy_(0, rows, picked)
    return out


def bitmask_for_rows(
    sample_req_ids: list[str], bitmask_req_ids: list[str], bitmask: np.ndarray | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Select the rows of this step's grammar bitmask (row i belongs to ``bitmask_req_ids[i]``) that the sampler
    needs: (rows [C] int64 into the sampling rows, bitmask [C, W] int32), in sampling-row order; None if none.

    Example: sample_req_ids [a, b, c], bitmask_req_ids [c, a] -> rows [0, 2], bitmask rows [1, 0].
    """
    if bitmask is None or not bitmask_req_ids:
        return None
    row_of = {req_id: row for row, req_id in enumerate(bitmask_req_ids)}
    pairs = [(i, row_of[r]) for i, r in enumerate(sample_req_ids) if r in row_of]
    if not pairs:
        return None
    rows = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    selected = torch.from_numpy(np.ascontiguousarray(bitmask[[p[1] for p in pairs]]))
    return rows.to(device), selected.to(device)
