"""Logprobs of chosen tokens plus the top-k alternatives, for sampled tokens and for prompt tokens.

Layout (shared with ``LogprobsLists``): row i holds the chosen token first, then the top-k by logprob, so
``token_ids`` is [N, 1 + k]. The chosen token may appear twice (once as chosen, once in the top-k), as in vLLM.
rank = 1 + the number of tokens with a strictly greater logprob (the most likely token has rank 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.core.sched_output import LogprobsLists


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [N, 1 + k] int64, chosen token first
    logprobs: torch.Tensor  # [N, 1 + k] float32
    ranks: torch.Tensor  # [N] int64, rank of the chosen token

    def tolists(self) -> LogprobsLists:
        """All N positions as plain Python (one device -> host copy per field)."""
        return LogprobsLists(
            token_ids=self.token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            ranks=self.ranks.tolist(),
        )

    def split_rows(self, num_logprobs: list[int | None]) -> list[LogprobsLists | None]:
        """One single-position LogprobsLists per row, cut to that row's own k (None where it asked for none).

        This is the shape of ``ModelRunnerOutput.logprobs``. Example: k = 3 for the batch, num_logprobs
        [None, 1, 3] -> [None, LogprobsLists(token_ids=[[chosen, top1]]), LogprobsLists([[chosen, t1, t2, t3]])].
        """
        lists = self.tolists()
        out: list[LogprobsLists | None] = []
        for i, k in enumerate(num_logprobs):
            if k is None:
                out.append(None)
                continue
            out.append(LogprobsLists([lists.token_ids[i][: 1 + k]], [lists.logprobs[i][: 1 + k]], [lists.ranks[i]]))
        return out


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """From full logprobs [N, V] and chosen ids [N]: chosen + top-``num_logprobs`` per row, and the chosen ranks."""
    token_ids = token_ids.to(torch.int64).unsqueeze(-1)  # [N, 1]
    chosen_logprobs = logprobs.gather(-1, token_ids)  # [N, 1]
    ranks = (logprobs > chosen_logprobs).sum(-1) + 1  # [N]
    if num_logprobs > 0:
        top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)  # [N, k]
        all_ids = torch.cat([token_ids, top_ids], dim=-1)
        all_logprobs = torch.cat([chosen_logprobs, top_logprobs], dim=-1)
    else:
        all_ids, all_logprobs = token_ids, chosen_logprobs
    return LogprobsTensors(all_ids, all_logprobs.to(torch.float32), ranks.to(torch.int64))


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Prompt logprobs: row i of ``logits`` [P, V] is the model's prediction after prompt position i, and
    ``target_token_ids`` [P] the prompt token that actually follows it (the caller shifts by one).

    Uses the raw model distribution (no temperature or penalties), as vLLM does for prompt logprobs.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return gather_logprobs(logprobs, target_token_ids, num_logprobs)
