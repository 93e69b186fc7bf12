"""Engine logprobs (one {token_id: Logprob} dict per position) in OpenAI's two formats.

Each position's dict holds the chosen token first, then the top-k alternatives (ranks 1..k); the chosen token
appears once even when it is also among the top-k. JSON has no -inf, so logprobs are clamped at -9999.0 as
vLLM does.
"""

from __future__ import annotations

from typing import Any

from folio.outputs import Logprob
from folio.server.protocol import ChatLogprobToken, ChatTopLogprob, CompletionLogProbs

_MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _token_text(tokenizer: Any, token_id: int, logprob: Logprob) -> str:
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return str(tokenizer.decode([token_id]))


def _top_k(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of a position, best first (rank 1 first)."""
    ranked = sorted(position.items(), key=lambda item: -item[1].logprob)
    return ranked[:k]


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    positions: list[dict[int, Logprob]],
    num_top: int,
    text_offset: int,
) -> tuple[CompletionLogProbs, int]:
    """The completions format for a run of tokens; returns it and the text offset after the run.

    ``top_logprobs`` holds the chosen token plus the ``num_top`` best, as vLLM's does.
    """
    result = CompletionLogProbs()
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        token = _token_text(tokenizer, token_id, chosen) if chosen else str(tokenizer.decode([token_id]))
        result.tokens.append(token)
        result.token_logprobs.append(_clamp(chosen.logprob) if chosen else None)
        result.text_offset.append(text_offset)
        text_offset += len(token)
        top: dict[str, float] = {}
        if chosen is not None:
            top[token] = _clamp(chosen.logprob)
        for top_id, top_logprob in _top_k(position, num_top):
            top.setdefault(_token_text(tokenizer, top_id, top_logprob), _clamp(top_logprob.logprob))
        result.top_logprobs.append(top if num_top > 0 or chosen is not None else None)
    return result, text_offset


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], positions: list[dict[int, Logprob]], num_top: int
) -> list[ChatLogprobToken]:
    """The chat format: one entry per token with its bytes and the ``num_top`` most likely alternatives."""
    content: list[ChatLogprobToken] = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        token = _token_text(tokenizer, token_id, chosen) if chosen else str(tokenizer.decode([token_id]))
        top = [
            ChatTopLogprob(
                token=(text := _token_text(tokenizer, i, lp)), logprob=_clamp(lp.logprob), bytes=_bytes(text)
            )
            for i, lp in _top_k(position, num_top)
        ]
        content.append(
            ChatLogprobToken(
                token=token,
                logprob=_clamp(chosen.logprob) if chosen else _MIN_LOGPROB,
                bytes=_bytes(token),
                top_logprobs=top,
            )
        )
    return content


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
