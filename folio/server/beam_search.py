"""``use_beam_search`` on /v1/completions and /v1/chat/completions (vLLM's extra field; ``n`` is the beam width).

The search is folio/beam_search.py's; here each step's beams go to the engine as concurrent one-token requests,
and the answer is one ``RequestOutput`` whose ``n`` outputs are the best sequences, best first, so the endpoints'
own collect and stream code shapes it (a stream carries each whole choice in one chunk at the end, as vLLM's).

As vLLM's: ``n`` (1 to 10), ``length_penalty``, ``ignore_eos``, ``include_stop_str_in_output`` (the EOS token
stays in the choice's tokens; the text never shows it) and ``temperature`` (of the step requests; it does not
change the result) apply. Unlike vLLM, which ignores them silently, fields beam search cannot honour (top_p,
penalties, stop strings, seed, ...) are a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from folio.beam_search import (
    MAX_BEAM_WIDTH,
    BeamSearchInstance,
    BeamSearchParams,
    BeamSearchSequence,
    first_row,
    step_sampling_params,
)
from folio.outputs import CompletionOutput, Logprob, RequestOutput
from folio.sampling_params import SamplingParams
from folio.server.errors import bad_request
from folio.server.limits import MAX_TEMPERATURE
from folio.server.protocol import SamplingFields
from folio.server.serving_base import ServingContext

T = TypeVar("T")

# Fields that beam search cannot honour, with the value that means "not set".
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (None, 1.0),
    "seed": (None,),
    "stop": (None, [], ""),
    "stop_token_ids": (None, []),
    "min_tokens": (0,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "response_format": (None,),
    "structured_outputs": (None,),
}


@dataclass
class BeamSearchRequest:
    """A validated ``use_beam_search`` request: the search's parameters, and ``view``, the SamplingParams the
    endpoints' response code reads (n = beam width, the caller's logprobs)."""

    params: BeamSearchParams
    view: SamplingParams
    num_logprobs: int | None

    @classmethod
    def build(
        cls,
        ctx: ServingContext,
        body: SamplingFields,
        max_tokens: int,
        num_logprobs: int | None,
        field_renames: dict[str, str] | None = None,
    ) -> BeamSearchRequest:
        """Raises a 400 naming the field for input beam search refuses (nothing is queued)."""
        if not ctx.engine.config.cache_config.enable_prefix_caching:
            raise bad_request(
                "use_beam_search needs prefix caching, which this server runs without (--no-enable-prefix-caching): "
                "every step runs each beam as a request, and only prefix-cache hits share the beams' prefix",
                param="use_beam_search",
            )
        for name, unset in _UNSUPPORTED_DEFAULTS.items():
            if getattr(body, name) not in unset:
                raise bad_request(f"{name} is not supported with use_beam_search", param=name)
        if not (isinstance(body.n, int) and 1 <= body.n <= MAX_BEAM_WIDTH):
            raise bad_request(
                f"n (the beam width with use_beam_search) must be in [1, {MAX_BEAM_WIDTH}], got {body.n}", param="n"
            )
        if not math.isfinite(body.length_penalty):
            raise bad_request(f"length_penalty must be a finite number, got {body.length_penalty}", "length_penalty")
        temperature = 0.0 if body.temperature is None else body.temperature
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature!r}", "temperature")
        view = ctx.make_sampling_params(
            lambda: SamplingParams(n=body.n, temperature=temperature, max_tokens=max_tokens, logprobs=num_logprobs),
            field_renames,
        )
        params = BeamSearchParams(
            beam_width=body.n,
            max_tokens=max_tokens,
            ignore_eos=body.ignore_eos,
            temperature=temperature,
            length_penalty=body.length_penalty,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
        return cls(params, view, num_logprobs)

    async def generate(
        self, ctx: ServingContext, prompt_token_ids: list[int], prompt: str | None, request_id: str, priority: int
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields an empty output once the prompt is computed (first step), then the finished result."""
        eos_ids = set(ctx.engine.input_processor.eos_token_ids)
        search = BeamSearchInstance(prompt_token_ids, self.params, eos_ids)
        step_params = step_sampling_params(self.params, self.num_logprobs)
        while not search.done:
            steps = [
                _one_token(ctx, beam.tokens, step_params, f"{request_id}-beam{search.num_steps}-{i}", priority)
                for i, beam in enumerate(search.beams)
            ]
            search.step(await _all_or_none(steps))
            if search.num_steps == 1:
                yield _request_output(request_id, prompt, prompt_token_ids, [], finished=False)
        outputs = [await self._completion(ctx, i, seq) for i, seq in enumerate(search.results())]
        yield _request_output(request_id, prompt, prompt_token_ids, outputs, finished=True)

    async def _completion(self, ctx: ServingContext, index: int, seq: BeamSearchSequence) -> CompletionOutput:
        """vLLM's choice: the EOS token kept in the tokens only with include_stop_str_in_output, never in the text."""
        token_ids = seq.output_token_ids
        logprobs: list[dict[int, Logprob]] = seq.logprobs
        visible = token_ids[:-1] if seq.finish_reason == "stop" else token_ids
        if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            token_ids, logprobs = visible, logprobs[:-1]
        return CompletionOutput(
            index=index,
            text=await ctx.detokenize(visible) if visible else "",
            token_ids=token_ids,
            cumulative_logprob=seq.cum_logprob,
            logprobs=logprobs if self.num_logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )


def engine_stream(
    ctx: ServingContext,
    beam: BeamSearchRequest | None,
    prompt: dict[str, Any],
    params: SamplingParams,
    request_id: str,
    priority: int,
) -> AsyncGenerator[RequestOutput, None]:
    """One prompt's output stream: the engine's own, or a beam search's (``beam`` set)."""
    if beam is None:
        return ctx.generate(prompt, params, request_id, priority)
    return beam.generate(ctx, prompt["prompt_token_ids"], prompt.get("prompt"), request_id, priority)


async def _all_or_none(steps: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every step request's result; if one fails (or this is cancelled), the others are cancelled (aborted) too,
    rather than left to run for a search that is over."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _one_token(
    ctx: ServingContext, token_ids: list[int], params: SamplingParams, request_id: str, priority: int
) -> dict[int, Logprob] | None:
    """One beam's step request; cancelling this (client gone) closes the stream, which aborts it in the core."""
    generator = ctx.generate({"prompt_token_ids": token_ids}, params, request_id, priority)
    row = None
    try:
        async for output in generator:  # DELTA outputs: the one that carries the token carries its row
            row = row or first_row(output)
    finally:
        await generator.aclose()
    return row


def _request_output(
    request_id: str, prompt: str | None, prompt_token_ids: list[int], outputs: list[CompletionOutput], finished: bool
) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        prompt_logprobs=None,
        outputs=outputs,
        finished=finished,
    )
