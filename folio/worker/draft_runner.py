"""The draft-model method in the worker: a second model with its own KV cache under the target's block tables, run
after the target's step to propose k drafts per request (docs/speculative_decoding.md).

Per step, after the target sampled (and verified the previous drafts):
1. catch-up: one forward over every scheduled request's tokens that the draft has not computed yet (its chunk:
   the accepted drafts it did not feed itself and the new token; a prefill chunk as the target's) -> the arg-max
   at the last position of each request that proposes is d_0;
2. k - 1 single-token steps over the proposing requests: d_{j-1} at position N + j - 1 -> d_j (greedy arg-max).
The draft's K/V at positions N .. N + k - 2 need KV slots past the scheduled tokens: the scheduler allocates them
(``Lookahead`` in folio/core/spec_decode.py). Drafts are arg-max picks (q one-hot), so the verification of the
n-gram method applies unchanged: exact for greedy requests, the lossless rule for sampled ones.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable

import torch

from folio.attention.builder import build_attn_metadata, compute_positions
from folio.core.sched_output import SchedulerOutput
from folio.kernels.cpu_kernels import CpuKernels
from folio.kernels.kv_block_copy import BlockCopy
from folio.model.llama import LlamaForCausalLM
from folio.model.loader import ModelSpec, load_model, read_model_spec
from folio.spec_decode.draft_model import DraftProgress, check_draft_vocab, num_drafts_to_propose
from folio.worker.request_state import CachedRequestState, RequestStates

logger = logging.getLogger("folio")


def load_draft_model(
    path: str,
    target: LlamaForCausalLM,
    target_path: str,
    dtype: torch.dtype,
    device: torch.device,
    enforce_eager: bool,
    cpu_kernels: CpuKernels | None,
    cpu_kv_prefetch_bytes: int | None,
) -> tuple[LlamaForCausalLM, ModelSpec]:
    """The draft model at ``path`` (a GGUF file or a safetensors directory, as the target), in the target's dtype
    and device. The target's own file is not loaded twice: the draft then shares its weights (its KV cache is its
    own). Raises ValueError naming speculative_config.model for a path that cannot be read or another vocabulary."""
    try:
        spec = read_model_spec(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"speculative_config.model {path!r}: {error}") from error
    check_draft_vocab(path, spec.vocab_size, target.spec.vocab_size)
    if os.path.realpath(path) == os.path.realpath(target_path):
        logger.info("Draft model: the target's own weights (%s), with a KV cache of its own", path)
        return target, target.spec
    logger.info("Loading the draft model %s as %s on %s", path, dtype, device)
    return load_model(
        path,
        dtype,
        device,
        show_progress=False,
        enforce_eager=enforce_eager,
        cpu_kernels=cpu_kernels,
        cpu_kv_prefetch_bytes=cpu_kv_prefetch_bytes,
    )


class DraftModelRunner:
    """Proposes drafts with the draft model; keeps which positions of each request its KV cache holds."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        num_speculative_tokens: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches  # per layer, the target's block ids: [2, num_blocks, block_size, heads, dim]
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device
        self.progress: dict[str, DraftProgress] = {}

    def update_states(self, sched: SchedulerOutput) -> None:
        """Forget finished and preempted requests; a (re)started request's computed tokens come from the prefix
        cache, whose blocks the draft computed too (every position the target computes, the draft computes in the
        same step, for the same tokens)."""
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.progress.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.progress[new.req_id] = DraftProgress(new.num_computed_tokens)

    def copy_blocks(self, copies: list[tuple[int, int]], block_copy: BlockCopy) -> None:
        """The target's copy-on-write plans, applied to the draft's cache as well (by the target's ``block_copy``)."""
        block_copy(self.kv_caches, [c[0] for c in copies], self.kv_caches, [c[1] for c in copies])

    def propose(
        self,
        num_scheduled_tokens: dict[str, int],
        req_ids: Iterable[str],
        sampled_req_ids: Collection[str],
        requests: RequestStates,
    ) -> dict[str, list[int]]:
        """Catch the draft's cache up on the step's requests (``req_ids``) and propose for those that got tokens
        (``sampled_req_ids``) and may speculate (a constrained request's drafts are cut by its grammar in the engine
        core). Returns req_id -> drafts (at most k; none for the others)."""
        states: list[CachedRequestState] = []
        starts: list[int] = []
        ends: list[int] = []
        for req_id in req_ids:
            state = requests[req_id]
            progress = self.progress[req_id]
            # A request that got tokens holds N = num_tokens now; a prefill chunk ends where the target's chunk ends.
            end = (
                state.num_tokens
                if req_id in sampled_req_ids
                else state.num_computed_tokens + num_scheduled_tokens[req_id]
            )
            start = progress.num_computed_tokens
            progress.confirm(state.token_slice(start, min(end, start + len(progress.fed_token_ids))))
            start = progress.num_computed_tokens
            progress.num_computed_tokens = max(start, end)
            if start < end:
                states.append(state)
                starts.append(start)
                ends.append(end)
        if not states:
            return {}
        # Who proposes, and how many drafts each (cut by max_model_len and max_tokens as the scheduler would).
        counts = [
            0
            if state.req_id not in sampled_req_ids
            else num_drafts_to_propose(
                self.k,
                state.num_tokens,
                self.max_model_len,
                state.sampling_params.max_tokens,
                len(state.output_token_ids),
            )
            for state in states
        ]
        drafts = self._run(states, starts, ends, counts)
        result = {}
        for state, request_drafts in zip(states, drafts, strict=True):
            if request_drafts:
                self.progress[state.req_id].fed_token_ids = request_drafts[:-1]  # their K/V were written
                result[state.req_id] = request_drafts
        return result

    def _run(
        self, states: list[CachedRequestState], starts: list[int], ends: list[int], counts: list[int]
    ) -> list[list[int]]:
        """The catch-up forward, then k - 1 single-token steps; ``counts[i]`` drafts for states[i] (0: catch-up only).

        Example: a request with N = 12 tokens whose draft cache holds 10, k = 3: the catch-up computes positions
        10, 11 (tokens 10, 11 of the request) -> d_0 from position 11's row; then d_0 at position 12 -> d_1, d_1 at
        13 -> d_2. Its K/V are written up to position 13 = N + k - 2."""
        query_lens = [end - start for start, end in zip(starts, ends, strict=True)]
        input_ids = [
            token for state, s, e in zip(states, starts, ends, strict=True) for token in state.token_slice(s, e)
        ]
        last_rows = [sum(query_lens[: i + 1]) - 1 for i in range(len(states))]
        proposing = [i for i, count in enumerate(counts) if count > 0]
        rows = torch.tensor([last_rows[i] for i in proposing], dtype=torch.int64, device=self.device)
        hidden = self._forward(input_ids, query_lens, ends, [state.block_ids for state in states], rows)
        drafts: list[list[int]] = [[] for _ in states]
        if not proposing:
            return drafts
        for i, token in zip(proposing, self._argmax(hidden), strict=True):
            drafts[i].append(token)
        for j in range(1, max(counts)):  # d_{j-1} at position N + j - 1 predicts d_j
            active = [i for i in proposing if counts[i] > j]
            seq_lens = [ends[i] + j for i in active]
            hidden = self._forward(
                [drafts[i][-1] for i in active], [1] * len(active), seq_lens, [states[i].block_ids for i in active]
            )
            for i, token in zip(active, self._argmax(hidden), strict=True):
                drafts[i].append(token)
        return drafts

    def _forward(
        self,
        input_ids: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[sum(query_lens), hidden] (or the ``output_rows`` asked for: the model skips the others' last layer): the
        draft model over requests whose queries are their last query_lens positions of seq_lens; raises ValueError
        where a block table lacks the slots (no lookahead allocated)."""
        attn = build_attn_metadata(query_lens, seq_lens, block_tables, self.block_size, self.device)
        positions = torch.tensor(compute_positions(query_lens, seq_lens), dtype=torch.int64, device=self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        hidden: torch.Tensor = self.model(ids, positions, self.kv_caches, attn, output_rows)
        return hidden

    def _argmax(self, rows: torch.Tensor) -> list[int]:
        """[R, hidden] -> the draft's greedy token per row (the fused LM-head arg-max where the model has it)."""
        token_ids = self.model.compute_greedy_token_ids(rows)
        if token_ids is None:
            token_ids = self.model.compute_logits(rows).argmax(dim=-1)
        return [int(token) for token in token_ids.tolist()]
