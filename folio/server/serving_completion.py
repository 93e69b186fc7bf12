"""POST /v1/completions: prompts (text or token ids, one or many) -> choices, whole or streamed as SSE.

Choice indices follow OpenAI: prompt i's sample j is choice ``i * n + j``. Each prompt is one engine request;
their output streams are merged, and closing the response closes them all (which aborts them in the core).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from folio.outputs import RequestOutput
from folio.sampling_params import SamplingParams
from folio.server.beam_search import BeamSearchRequest, engine_stream
from folio.server.errors import bad_request
from folio.server.kv_transfer_params import kv_transfer_args
from folio.server.logprob_format import completion_logprobs
from folio.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from folio.server.serving_base import ChoiceState, ServingContext, engine_error, make_usage, random_id
from folio.server.streaming import (
    SSE_DONE,
    AbortingStreamingResponse,
    cancel_on_disconnect,
    merge_async_iterators,
    prime_all,
    sse,
)
from folio.server.structured_outputs import structured_outputs_params


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, raw_request: Request) -> Response:
        """Validates everything before any prompt reaches the engine, then answers whole or as a stream."""
        ctx = self.ctx
        ctx.check_model(body.model)
        _reject_unsupported(body)
        prompts = await self._prompts(body)
        max_tokens = min(ctx.resolve_max_tokens(body.max_tokens, len(ids)) for _, ids in prompts)
        beam = BeamSearchRequest.build(ctx, body, max_tokens, body.logprobs) if body.use_beam_search else None
        params = (
            beam.view if beam else ctx.make_sampling_params(lambda: body.to_sampling_params(max_tokens, body.logprobs))
        )
        params.structured_outputs = structured_outputs_params(
            body.response_format, body.structured_outputs, ctx.engine.config.structured_outputs_config.backend
        )
        kv_transfer = kv_transfer_args(body.kv_transfer_params, ctx.engine.config.kv_transfer_config, beam is not None)
        params.extra_args, kv_transfer_response = kv_transfer
        ticket = ctx.admission.admit([len(ids) for _, ids in prompts], params.n)  # 503 here when full
        handed_over = False  # a streamed response releases the ticket when it ends; otherwise this handler does
        try:
            request_id = random_id("cmpl")
            generators = []
            for i, (text, ids) in enumerate(prompts):
                prompt = {"prompt": text, "prompt_token_ids": ids}
                source = engine_stream(ctx, beam, prompt, params, f"{request_id}-{i}", body.priority)
                generators.append(ticket.track(i, source))
            num_prompt_tokens = sum(len(ids) for _, ids in prompts)
            if body.stream:
                primed = await cancel_on_disconnect(prime_all(generators), raw_request, request_id)
                stream = self._stream(request_id, body, params, primed, num_prompt_tokens)
                handed_over = True
                return AbortingStreamingResponse(stream, request_id, on_close=ticket.release)
            collect = self._collect(request_id, body, params, generators, num_prompt_tokens)
            response = await cancel_on_disconnect(collect, raw_request, request_id)
            response.kv_transfer_params = kv_transfer_response
            return JSONResponse(response.model_dump())
        finally:
            if not handed_over:
                ticket.release()

    async def _prompts(self, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) per prompt; the four OpenAI prompt shapes."""
        prompt: Any = body.prompt
        if isinstance(prompt, str):
            return [(prompt, await self.ctx.encode(prompt))]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [(None, list(prompt))]
        result: list[tuple[str | None, list[int]]] = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                result.append((p, await self.ctx.encode(p, f"prompt[{i}]")))
            elif not p:
                raise bad_request("prompt must not contain an empty token list", param="prompt")
            else:
                result.append((None, list(p)))
        return result

    async def _collect(
        self,
        request_id: str,
        body: CompletionRequest,
        params: SamplingParams,
        generators: list[AsyncGenerator[RequestOutput, None]],
        num_prompt_tokens: int,
    ) -> CompletionResponse:
        n = params.n
        choices = [ChoiceState() for _ in range(len(generators) * n)]
        try:
            async for prompt_index, output in merge_async_iterators(generators):
                for c in output.outputs:
                    choices[prompt_index * n + c.index].add(c)
        except Exception as e:
            raise engine_error(e) from e
        result = []
        for index, state in enumerate(choices):
            logprobs = None
            if params.logprobs is not None:
                logprobs, _ = completion_logprobs(
                    self.ctx.tokenizer, state.token_ids, state.logprobs, params.logprobs, 0
                )
            result.append(
                CompletionChoice(
                    index=index,
                    text=state.text,
                    logprobs=logprobs,
                    finish_reason=state.finish_reason,
                    stop_reason=state.stop_reason,
                )
            )
        usage = make_usage(num_prompt_tokens, choices)
        return CompletionResponse(id=request_id, model=self.ctx.model_name, choices=result, usage=usage)

    async def _stream(
        self,
        request_id: str,
        body: CompletionRequest,
        params: SamplingParams,
        generators: list[AsyncGenerator[RequestOutput, None]],
        num_prompt_tokens: int,
    ) -> AsyncGenerator[str, None]:
        """SSE chunks as tokens arrive; an engine failure becomes an error event; always ends with [DONE]."""
        n = params.n
        choices = [ChoiceState() for _ in range(len(generators) * n)]
        created = int(time.time())
        merged = merge_async_iterators(generators)
        try:
            async for prompt_index, output in merged:
                for c in output.outputs:
                    index = prompt_index * n + c.index
                    chunk = self._stream_choice(choices[index], index, c, params)
                    if chunk is not None:
                        yield sse(
                            CompletionStreamResponse(
                                id=request_id, created=created, model=self.ctx.model_name, choices=[chunk]
                            )
                        )
            if body.include_usage_in_stream:
                usage = make_usage(num_prompt_tokens, choices)
                yield sse(
                    CompletionStreamResponse(
                        id=request_id, created=created, model=self.ctx.model_name, choices=[], usage=usage
                    )
                )
        except Exception as e:
            yield engine_error(e).to_sse()
        finally:
            await merged.aclose()
        yield SSE_DONE

    def _stream_choice(
        self, state: ChoiceState, index: int, c: Any, params: SamplingParams
    ) -> CompletionStreamChoice | None:
        """The chunk for one choice's delta, or None when it carries nothing new."""
        if state.finish_sent:
            return None
        state.token_ids += c.token_ids
        newly_finished = c.finish_reason is not None
        if not c.text and not newly_finished and not (params.logprobs is not None and c.token_ids):
            return None
        logprobs = None
        if params.logprobs is not None:
            logprobs, state.text_offset = completion_logprobs(
                self.ctx.tokenizer, c.token_ids, c.logprobs or [], params.logprobs, state.text_offset
            )
        state.finish_sent = newly_finished
        return CompletionStreamChoice(
            index=index,
            text=c.text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason if newly_finished else None,
        )


def _reject_unsupported(body: CompletionRequest) -> None:
    """Fields OpenAI defines that Folio does not implement: a clear 400 rather than a silently different answer."""
    if body.echo:
        raise bad_request("echo is not supported by this server", param="echo")
    if body.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of ({body.best_of}) other than n ({body.n}) is not supported", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
