"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> one engine request -> choices.

Streaming follows OpenAI's chunk shapes: a first chunk per choice with ``delta.role``, then content deltas, then
the finish reason; with ``stream_options.include_usage`` a last chunk with no choices carries the usage.
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
from folio.server.logprob_format import chat_logprobs
from folio.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from folio.server.serving_base import ChoiceState, ServingContext, engine_error, make_usage, random_id
from folio.server.streaming import SSE_DONE, AbortingStreamingResponse, cancel_on_disconnect, prime, sse
from folio.server.structured_outputs import structured_outputs_params


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(body.model)
        num_top = _check_logprob_fields(body)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        messages = [m.to_template_dict() for m in body.messages]
        prompt_ids = await ctx.apply_chat_template(messages, body.add_generation_prompt)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = ctx.resolve_max_tokens(body.requested_max_tokens, len(prompt_ids), field, "messages")
        renames = {"max_tokens": field, "logprobs": "top_logprobs"}
        beam = BeamSearchRequest.build(ctx, body, max_tokens, num_top, renames) if body.use_beam_search else None
        params = (
            beam.view
            if beam
            else ctx.make_sampling_params(lambda: body.to_sampling_params(max_tokens, num_top), renames)
        )
        params.structured_outputs = structured_outputs_params(
            body.response_format, body.structured_outputs, ctx.engine.config.structured_outputs_config.backend
        )
        kv_transfer = kv_transfer_args(body.kv_transfer_params, ctx.engine.config.kv_transfer_config, beam is not None)
        params.extra_args, kv_transfer_response = kv_transfer
        ticket = ctx.admission.admit([len(prompt_ids)], params.n)  # 503 here when full
        handed_over = False  # a streamed response releases the ticket when it ends; otherwise this handler does
        try:
            request_id = random_id("chatcmpl")
            source = engine_stream(ctx, beam, {"prompt_token_ids": prompt_ids}, params, request_id, body.priority)
            generator = ticket.track(0, source)
            if body.stream:
                primed = await cancel_on_disconnect(prime(generator), raw_request, request_id)
                stream = self._stream(request_id, body, params, primed, len(prompt_ids))
                handed_over = True
                return AbortingStreamingResponse(stream, request_id, on_close=ticket.release)
            response = await cancel_on_disconnect(
                self._collect(request_id, params, generator, len(prompt_ids)), raw_request, request_id
            )
            response.kv_transfer_params = kv_transfer_response
            return JSONResponse(response.model_dump())
        finally:
            if not handed_over:
                ticket.release()

    async def _collect(
        self,
        request_id: str,
        params: SamplingParams,
        generator: AsyncGenerator[RequestOutput, None],
        num_prompt_tokens: int,
    ) -> ChatCompletionResponse:
        choices = [ChoiceState() for _ in range(params.n)]
        try:
            async for output in generator:
                for c in output.outputs:
                    choices[c.index].add(c)
        except Exception as e:
            raise engine_error(e) from e
        finally:
            await generator.aclose()
        result = [
            ChatCompletionChoice(
                index=index,
                message=ChatResponseMessage(content=state.text),
                logprobs=self._logprobs(params, state.token_ids, state.logprobs),
                finish_reason=state.finish_reason,
                stop_reason=state.stop_reason,
            )
            for index, state in enumerate(choices)
        ]
        return ChatCompletionResponse(
            id=request_id, model=self.ctx.model_name, choices=result, usage=make_usage(num_prompt_tokens, choices)
        )

    def _logprobs(self, params: SamplingParams, token_ids: list[int], positions: list[Any]) -> ChatLogprobs | None:
        if params.logprobs is None:
            return None
        return ChatLogprobs(content=chat_logprobs(self.ctx.tokenizer, token_ids, positions, params.logprobs))

    async def _stream(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        params: SamplingParams,
        generator: AsyncGenerator[RequestOutput, None],
        num_prompt_tokens: int,
    ) -> AsyncGenerator[str, None]:
        """Role chunks first, then deltas; an engine failure becomes an error event; always ends with [DONE]."""
        created = int(time.time())
        choices = [ChoiceState() for _ in range(params.n)]

        def chunk(choice: ChatCompletionStreamChoice | None, usage: UsageInfo | None = None) -> str:
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.ctx.model_name,
                    choices=[choice] if choice else [],
                    usage=usage,
                )
            )

        try:
            for index in range(params.n):
                yield chunk(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            async for output in generator:
                for c in output.outputs:
                    choice = self._stream_choice(choices[c.index], c, params)
                    if choice is not None:
                        yield chunk(choice)
            if body.include_usage_in_stream:
                yield chunk(None, make_usage(num_prompt_tokens, choices))
        except Exception as e:
            yield engine_error(e).to_sse()
        finally:
            await generator.aclose()
        yield SSE_DONE

    def _stream_choice(self, state: ChoiceState, c: Any, params: SamplingParams) -> ChatCompletionStreamChoice | None:
        """The chunk for one choice's delta, or None when it carries nothing new."""
        if state.finish_sent:
            return None
        state.token_ids += c.token_ids
        newly_finished = c.finish_reason is not None
        if not c.text and not newly_finished and not (params.logprobs is not None and c.token_ids):
            return None
        state.finish_sent = newly_finished
        return ChatCompletionStreamChoice(
            index=c.index,
            delta=DeltaMessage(content=c.text) if c.text or not newly_finished else DeltaMessage(),
            logprobs=self._logprobs(params, c.token_ids, c.logprobs or []),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason if newly_finished else None,
        )


def _check_logprob_fields(body: ChatCompletionRequest) -> int | None:
    """OpenAI's rule: top_logprobs needs logprobs=true. Returns the engine's logprobs count (None: off)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0
