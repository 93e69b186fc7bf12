"""Applying one step's sampled tokens to one request: stops, prefix-cache hashes, logprob rows, the output.

Kept apart from the scheduler so that `update_from_output` reads as the loop over requests it is; this is the
per-request rule (the same for every request, whatever the step held).
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.core.block_hash import update_request_block_hashes
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.prompt_logprobs import undelivered_prompt_logprobs
from folio.core.sched_output import EngineCoreOutput, LogprobsLists
from folio.core.stop import check_stop
from folio.request import Request


@dataclass
class RequestUpdate:
    """What one step did to one request: the output to send (None: nothing new) and whether it stopped."""

    output: EngineCoreOutput | None
    stopped: bool


def apply_sampled_tokens(
    request: Request,
    sampled_token_ids: list[int],
    logprobs: LogprobsLists | None,
    prompt_logprobs: LogprobsLists | None,
    kv_cache_manager: KVCacheManager,
    max_model_len: int,
    step_end: int,
) -> RequestUpdate:
    """Append tokens up to the first stop, cache the blocks they completed, trim logprob rows past a stop.

    A stopped request still needs its blocks released by the caller (the scheduler owns the queues). ``step_end``:
    the request's num_computed_tokens after the step these tokens come from.
    """
    new_token_ids: list[int] = []
    stopped = False
    for token_id in sampled_token_ids:
        request.output_token_ids.append(token_id)
        new_token_ids.append(token_id)
        if check_stop(request, max_model_len):
            stopped = True
            break
    if kv_cache_manager.enable_prefix_caching:
        update_request_block_hashes(request, kv_cache_manager.block_size)
        kv_cache_manager.cache_computed_blocks(request)
    if prompt_logprobs is not None:
        prompt_logprobs = undelivered_prompt_logprobs(request, prompt_logprobs, step_end)
    if logprobs is not None and len(new_token_ids) < len(logprobs.ranks):
        logprobs = logprobs.rows(0, len(new_token_ids))  # tokens after a stop are dropped
    if not stopped and not new_token_ids and prompt_logprobs is None:
        return RequestUpdate(output=None, stopped=False)
    output = EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=request.get_finish_reason(),
        stop_reason=request.stop_reason,
        num_cached_tokens=max(0, request.num_cached_tokens),
        new_logprobs=logprobs,
        new_prompt_logprobs=prompt_logprobs,
        queue_time=queue_time(request),
    )
    return RequestUpdate(output=output, stopped=stopped)


def queue_time(request: Request) -> float | None:
    """Seconds from arrival to first scheduling (both monotonic clocks: valid across the engine's processes)."""
    if request.first_scheduled_time is None:
        return None
    return max(0.0, request.first_scheduled_time - request.arrival_time)
