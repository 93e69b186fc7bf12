"""The scheduler's side of speculative decoding (docs/speculative_decoding.md): which scheduled tokens are drafts,
the roll-back of the rejected ones, the drafts kept for the next step, the KV slots a draft model writes past the
scheduled tokens (``Lookahead``), and the counters (vLLM's ``SpecDecodingStats`` names: the base of the
``folio:spec_decode_*`` metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from folio.request import Request
from folio.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:  # the KV manager imports this module (Lookahead)
    from folio.core.kv_cache_manager import KVCacheManager


@dataclass(frozen=True)
class Lookahead:
    """KV slots past a request's scheduled tokens that the worker writes in the same step (vLLM's
    ``num_lookahead_tokens``): a draft model, after the target's step, computes the K/V of the request's new token
    and of k - 1 drafts, at positions up to k past the scheduled ones. ``allocate_slots`` covers them, and the
    roll-back keeps them. Never past max_model_len (the worker drafts no position there).

    Example (k 4, max_model_len 64): 6 computed + 4 scheduled -> 14 slots; 58 + 4 -> 64 (capped)."""

    num_tokens: int = 0
    max_model_len: int | None = None

    def num_slots(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Slots a request needs to compute ``num_new_tokens`` after its computed ones (no lookahead for none)."""
        num_slots = num_computed_tokens + num_new_tokens
        if self.num_tokens == 0 or num_new_tokens == 0:
            return num_slots
        with_lookahead = num_slots + self.num_tokens
        return with_lookahead if self.max_model_len is None else max(num_slots, min(with_lookahead, self.max_model_len))

    @staticmethod
    def for_config(config: SpeculativeConfig | None, max_model_len: int) -> Lookahead:
        """k lookahead slots for the draft-model method (its k - 1 drafts' K/V after the new token, which may itself
        lie one past the scheduled tokens when every draft was accepted); none for n-gram or no speculation."""
        if config is None or config.method != "draft_model" or config.num_speculative_tokens is None:
            return NO_LOOKAHEAD
        return Lookahead(config.num_speculative_tokens, max_model_len)


NO_LOOKAHEAD = Lookahead()


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verifications of one request's drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at draft position j

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One verification: ``num_accepted_tokens`` of a request's ``num_draft_tokens`` drafts (a prefix) accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend([0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def snapshot(self) -> SpecDecodingStats:
        """A copy for the step's stats (the scheduler goes on adding to its own): one list copied, no deepcopy."""
        return SpecDecodingStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos)
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: 1 + accepted / drafts (1.0 before any)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def take_scheduled_drafts(request: Request, num_scheduled_tokens: int) -> list[int]:
    """The drafts among a request's scheduled tokens (those past its known tokens: all its drafts, or as many as
    the step's caps left), before num_computed_tokens advances. Clears ``spec_token_ids``: drafts are used once."""
    num_drafts = num_scheduled_tokens - (request.num_tokens - request.num_computed_tokens)
    drafts = request.spec_token_ids[:num_drafts] if num_drafts > 0 else []
    request.spec_token_ids = []
    return drafts


def roll_back_rejected(
    request: Request, num_drafts: int, num_sampled: int, stats: SpecDecodingStats, kv: KVCacheManager
) -> None:
    """After verification: ``num_sampled`` = a accepted drafts + 1 token. The K/V of the rejected drafts' positions
    were written but are not this request's tokens: num_computed_tokens no longer counts them (before any block
    is hashed or cached), and the next step overwrites them. Blocks that held only rejected positions are freed:
    the request keeps the blocks up to the slot of its next token, plus its lookahead slots (a draft model wrote
    there in this step: the K/V of the drafts it proposed).

    Example (block_size 4): 6 computed, token at 6 plus drafts at 7, 8, 9 (blocks 0-2); one draft accepted ->
    num_computed_tokens 8, the next token goes to position 8 (block 2): nothing freed. With none accepted ->
    7 computed, the next token at 7 (block 1): block 2 is freed."""
    if num_drafts == 0 or num_sampled == 0:
        return
    request.num_computed_tokens -= num_drafts + 1 - num_sampled
    stats.observe(num_drafts, num_sampled - 1)
    num_slots = kv.lookahead.num_slots(request.num_computed_tokens, 1)
    kv.free_blocks_past(request, -(-num_slots // kv.block_size))  # blocks covering the slots


def keep_drafts(request: Request, draft_token_ids: list[int] | None) -> None:
    """The worker's drafts for the next step, cut so that the last token they can yield (a + 1 tokens for a
    accepted drafts) is still within max_tokens."""
    room = request.max_tokens - request.num_output_tokens - 1
    request.spec_token_ids = list(draft_token_ids[: max(0, room)]) if draft_token_ids else []
