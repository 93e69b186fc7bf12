"""Prompt logprobs and the shared gather: values, order and ranks against torch.log_softmax."""

from __future__ import annotations

import torch

from folio.sample import compute_prompt_logprobs, gather_logprobs


def test_prompt_logprobs_values_and_topk() -> None:
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([3, 1, 4, 1, 5, 9])
    out = compute_prompt_logprobs(logits, targets, num_logprobs=2)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.token_ids.shape == (6, 3) and out.token_ids.dtype == torch.int64
    assert out.token_ids[:, 0].tolist() == targets.tolist()
    assert torch.allclose(out.logprobs[:, 0], ref[torch.arange(6), targets])
    assert out.token_ids[:, 1:].tolist() == ref.topk(2).indices.tolist()
    expected_ranks = [1 + int((ref[i] > ref[i, t]).sum()) for i, t in enumerate(targets.tolist())]
    assert out.ranks.tolist() == expected_ranks
    lists = out.tolists()
    assert lists.token_ids[0][0] == 3 and len(lists.logprobs) == 6


def test_rank_counts_strictly_greater_only() -> None:
    logprobs = torch.log(torch.tensor([[0.25, 0.25, 0.4, 0.1]]))
    out = gather_logprobs(logprobs, torch.tensor([1]), num_logprobs=0)
    assert out.ranks.tolist() == [2]  # only 0.4 is strictly greater; the tie with token 0 does not count
    assert out.token_ids.tolist() == [[1]]
