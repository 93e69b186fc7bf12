"""The correctness rule: greedy tokens identical, or at the first divergence each side's token is within the
other's top-5 logprobs at that step (after it the two sequences continue from different text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class GreedyRun:
    token_ids: list[int]
    top5: list[set[int]]  # per step: the 5 most likely token ids


def from_folio_output(output: object) -> GreedyRun:
    completion = output.outputs[0]  # type: ignore[attr-defined]
    assert completion.logprobs is not None, "ask for logprobs=5 to compare"
    top5 = [set(sorted(step, key=lambda t: -step[t].logprob)[:5]) for step in completion.logprobs]
    return GreedyRun(list(completion.token_ids), top5)


def compare_greedy(reference: GreedyRun, candidate: GreedyRun, label: str = "") -> str:
    """Returns 'identical' or 'diverged@k'; raises AssertionError when the top-5 rule fails."""
    n = min(len(reference.token_ids), len(candidate.token_ids))
    for step in range(n):
        a, b = reference.token_ids[step], candidate.token_ids[step]
        if a != b:
            assert a in candidate.top5[step] and b in reference.top5[step], (
                f"{label}: step {step}: reference token {a} vs candidate {b} not in each other's top-5 "
                f"({sorted(reference.top5[step])} / {sorted(candidate.top5[step])})"
            )
            return f"diverged@{step}"
    assert len(reference.token_ids) == len(candidate.token_ids), f"{label}: lengths differ"
    return "identical"


@torch.inference_mode()
def hf_greedy(model: Any, prompt_ids: list[int], num_new: int) -> GreedyRun:
    """Greedy decoding with a transformers model and its own KV cache; EOS does not stop it."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    top5: list[set[int]] = []
    for _ in range(num_new):
        logits = out.logits[0, -1].float()
        token = int(torch.argmax(logits))
        tokens.append(token)
        top5.append(set(torch.topk(logits, 5).indices.tolist()))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return GreedyRun(tokens, top5)
