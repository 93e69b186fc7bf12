"""Prompt logprobs delivered once per position, across preemptions: the request keeps what it already sent."""

from __future__ import annotations

from folio.core.sched_output import LogprobsLists
from folio.request import Request


def undelivered_prompt_logprobs(
    request: Request, prompt_logprobs: LogprobsLists, step_end: int
) -> LogprobsLists | None:
    """This step's prompt-logprob rows minus those at positions already delivered; records the new ones.

    The worker scores every prompt position it computes (a pure function of its input, no history), so a request
    preempted during its chunked prefill, whose recompute starts again at position 0, gets the rows of the
    positions it delivered before the preemption a second time: they are dropped here, where the request's
    history lives. Position p scores prompt token p + 1, so the rows end at min(step_end, num_prompt_tokens - 1),
    ``step_end`` being where the step that produced them ended (not the request's num_computed_tokens: with
    pipeline parallelism the next step is already scheduled when this one's output comes). Example: a 30-token
    prompt delivered
    positions 0..15, then was preempted; its recompute's first chunk [0, 20) brings 20 rows for positions 0..19:
    the first 16 are dropped, 16..19 are delivered, and None is returned where nothing is left.
    """
    end = min(step_end, request.num_prompt_tokens - 1)
    num_rows = len(prompt_logprobs.ranks)
    num_delivered_here = max(0, request.num_prompt_logprobs_delivered - (end - num_rows))
    request.num_prompt_logprobs_delivered = max(request.num_prompt_logprobs_delivered, end)
    if num_delivered_here == 0:
        return prompt_logprobs
    if num_delivered_here >= num_rows:
        return None
    return prompt_logprobs.rows(num_delivered_here)
