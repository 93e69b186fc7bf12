"""Speculative decoding's Prometheus counters and its part of the periodic log line (vLLM's names under ``folio:``).

Both read the core's cumulative ``SpecDecodingStats`` (a copy in each scheduler snapshot): the counters advance by
the difference since the last snapshot, the log line reports the interval since it last logged. They exist only
when the server runs with a ``speculative_config`` (as vLLM's).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from folio.core.spec_decode import SpecDecodingStats


class SpecDecodePrometheus:
    """``folio:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
    ``..._num_accepted_tokens_per_pos{position}`` (exposed with ``_total``), every series at 0 from the start."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        num_speculative_tokens: int,
        engines: list[str] | None = None,
    ) -> None:
        self.model_name = model_name
        self.engines = engines or ["0"]
        labels = ["model_name", "engine"]
        self.num_drafts = Counter(
            "folio:spec_decode_num_drafts", "Verifications of a request's drafts.", labels, registry=registry
        )
        self.num_draft_tokens = Counter(
            "folio:spec_decode_num_draft_tokens", "Draft tokens verified.", labels, registry=registry
        )
        self.num_accepted_tokens = Counter(
            "folio:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels, registry=registry
        )
        self.num_accepted_tokens_per_pos = Counter(
            "folio:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first draft).",
            [*labels, "position"],
            registry=registry,
        )
        for engine in self.engines:
            for counter in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens):
                counter.labels(model_name, engine)
            for position in range(num_speculative_tokens):
                self.num_accepted_tokens_per_pos.labels(model_name, engine, str(position))
        self._last = [SpecDecodingStats() for _ in self.engines]  # each engine core's last snapshot

    def record(self, stats: SpecDecodingStats, engine_index: int = 0) -> None:
        """Advance every counter by the difference between ``stats`` (core ``engine_index``'s cumulative counts)
        and that core's last snapshot."""
        last, labels = self._last[engine_index], (self.model_name, self.engines[engine_index])
        _advance(self.num_drafts.labels(*labels), stats.num_drafts - last.num_drafts)
        _advance(self.num_draft_tokens.labels(*labels), stats.num_draft_tokens - last.num_draft_tokens)
        _advance(self.num_accepted_tokens.labels(*labels), stats.num_accepted_tokens - last.num_accepted_tokens)
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            before = (
                last.num_accepted_tokens_per_pos[position] if position < len(last.num_accepted_tokens_per_pos) else 0
            )
            _advance(self.num_accepted_tokens_per_pos.labels(*labels, str(position)), count - before)
        self._last[engine_index] = stats


def _advance(child: Counter, delta: int) -> None:
    if delta > 0:
        child.inc(delta)


class SpecDecodeLogPart:
    """The periodic line's part: mean acceptance length (1 + accepted / drafts), the drafts' acceptance rate and
    the acceptance rate at each draft position (accepted there / drafts), over the interval; '' when nothing was
    drafted in it."""

    def __init__(self) -> None:
        self._last = SpecDecodingStats()

    def text(self, stats: SpecDecodingStats | None) -> str:
        """The part for the interval that ends now; the next interval starts from ``stats``."""
        if stats is None:
            return ""
        last, self._last = self._last, stats
        num_drafts = stats.num_drafts - last.num_drafts
        if num_drafts <= 0:
            return ""
        accepted = stats.num_accepted_tokens - last.num_accepted_tokens
        draft_tokens = stats.num_draft_tokens - last.num_draft_tokens
        before = last.num_accepted_tokens_per_pos + [0] * len(stats.num_accepted_tokens_per_pos)
        per_position = [(count - before[i]) / num_drafts for i, count in enumerate(stats.num_accepted_tokens_per_pos)]
        return (
            f", Mean acceptance length: {1 + accepted / num_drafts:.2f}, "
            f"Avg draft acceptance rate: {100 * accepted / max(draft_tokens, 1):.1f}%, "
            f"Per-position acceptance rate: {', '.join(f'{rate:.3f}' for rate in per_position)}"
        )
