"""How a preempted request gives its KV blocks back: swap them to the host tier, or drop them and recompute.

``preemption_mode`` (vLLM's earlier name): "swap" | "recompute" | None (swap when a host tier exists). Swap keeps
num_computed_tokens: the request resumes as NewRequestData from where it stopped, its blocks loaded back. It falls
back to recompute when the host tier cannot take every block, and always for requests that want prompt logprobs
(every prompt position must be computed once in order, as with prefix caching) and for forked n > 1 siblings (their
shared prompt blocks would be stored once per sibling; recompute re-shares them through the prefix cache).
"""

from __future__ import annotations

from folio.core.kv_cache_manager import KVCacheManager
from folio.request import Request


class PreemptionStrategy:
    """Frees a victim's device blocks by swap or recompute and counts the swaps."""

    def __init__(self, preemption_mode: str | None, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        has_host_tier = kv_cache_manager.host_tier is not None
        mode = preemption_mode if preemption_mode is not None else ("swap" if has_host_tier else "recompute")
        self.use_swap = mode == "swap" and has_host_tier
        self.num_swapped_preemptions_total = 0
        self.num_swaps_with_a_pending_token = 0  # of those, swaps of a request whose next token was in flight

    def can_swap(self, request: Request) -> bool:
        return self.use_swap and request.sampling_params.prompt_logprobs is None and request.fork_of is None

    def release_blocks(self, request: Request) -> bool:
        """Free the request's device blocks. Swapped: True, num_computed_tokens kept, its K/V stored in the host
        tier. Otherwise False, num_computed_tokens reset to 0 (recompute).

        Pipeline parallelism keeps steps in flight: a request may be preempted while the step that computes its
        last token's position (and samples its next token) has not answered yet. Then num_computed_tokens already
        counts that position (schedule() advances it) but the token will be dropped as stale (batch_queue.py), so
        a swapped request gives that position back: it is computed again, and the token sampled again, on resume
        (the K/V written there meanwhile is simply overwritten). Without steps in flight a running request always
        has its last token still to compute, and this never applies."""
        token_pending = request.num_computed_tokens >= request.num_tokens
        if self.can_swap(request):
            if token_pending:
                request.num_computed_tokens = request.num_tokens - 1
            if self.kv_cache_manager.swap_out(request):
                self.num_swapped_preemptions_total += 1
                self.num_swaps_with_a_pending_token += token_pending
                return True
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        return False
