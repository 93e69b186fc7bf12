"""OutputProcessor: EngineCoreOutputs -> RequestOutputs. Detokenizes, applies stop strings, joins n > 1 samples.

Stop strings are decided here (they need text); a request stopped by one is reported back so the engine aborts
it in the core and its blocks are freed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from folio.core.sched_output import EngineCoreOutput, LogprobsLists
from folio.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer, decode_token, make_detokenizer
from folio.engine.input_processor import ProcessedPrompt, child_request_id
from folio.engine.stop_checker import check_stop_strings, stop_string_holdback
from folio.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from folio.sampling_params import SamplingParams


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output when the request is finished (offline generate)


@dataclass
class SampleState:
    """One of the n sequences of a request."""

    index: int
    detokenizer: IncrementalDetokenizer | StreamDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    output_kind: RequestOutputKind
    samples: dict[str, SampleState]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    child_ids_to_abort: list[str]  # stopped by a stop string: the core must still free them


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        output_kind: RequestOutputKind,
        core_request_id: str | None = None,
    ) -> None:
        """Outputs carry ``request_id``; the core knows the request as ``core_request_id`` (default: the same),
        whose child ids are the keys outputs from the core are matched on."""
        samples = {}
        for index in range(params.n):
            child_id = child_request_id(core_request_id or request_id, index, params.n)
            detok = make_detokenizer(
                self.tokenizer,
                prompt.prompt_token_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
            samples[child_id] = SampleState(
                index=index,
                detokenizer=detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            self.child_to_parent[child_id] = request_id
        initial_prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.requests[request_id] = RequestState(
            request_id, prompt, params, output_kind, samples, prompt_logprobs=initial_prompt_logprobs
        )

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.samples) if state else []

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            for child_id in state.samples if state else ():
                self.child_to_parent.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None:
                continue  # aborted by the user meanwhile
            state = self.requests[parent_id]
            sample = state.samples[out.request_id]
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._to_logprob_dicts(out.new_prompt_logprobs))
            stopped_by_string = self._update_sample(sample, state.params, out)
            if stopped_by_string:
                to_abort.append(out.request_id)
            touched[parent_id] = state
        request_outputs = []
        for state in touched.values():
            request_output = self._make_request_output(state)
            if request_output is not None:
                request_outputs.append(request_output)
            if state.finished:
                self.abort_requests([state.request_id])
        return ProcessedOutputs(request_outputs, to_abort)

    def _update_sample(self, sample: SampleState, params: SamplingParams, out: EngineCoreOutput) -> bool:
        """Appends tokens and text; returns True when a stop string ended the sample here."""
        if sample.finish_reason is not None:
            return False
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and sample.logprobs is not None:
            dicts = self._to_logprob_dicts(out.new_logprobs)
            sample.logprobs.extend(dicts)
            assert sample.cumulative_logprob is not None
            sample.cumulative_logprob += sum(out.new_logprobs.logprobs[i][0] for i in range(len(dicts)))
        new_text = sample.detokenizer.update(out.new_token_ids) if params.detokenize else ""
        sample.text += new_text
        if out.finish_reason is not None:
            sample.finish_reason = str(out.finish_reason)
            sample.stop_reason = out.stop_reason
        if params.stop_strings and new_text and sample.finish_reason is None:
            match = check_stop_strings(
                sample.text, len(new_text), params.stop_strings, params.include_stop_str_in_output
            )
            if match is not None:
                stop_str, truncate_to = match
                sample.text = sample.text[:truncate_to]
                sample.finish_reason, sample.stop_reason = "stop", stop_str
                return True
        return False

    def _to_logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        rows: list[dict[int, Logprob]] = []
        for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            row = {}
            for j, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
                if token_id in row:
                    continue  # the chosen token also among the top-k
                row[token_id] = Logprob(logprob, rank if j == 0 else j, decode_token(self.tokenizer, token_id))
            rows.append(row)
        return rows

    def _make_request_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        completions = [self._make_completion(s, state.params, kind) for s in state.samples.values()]
        completions.sort(key=lambda c: c.index)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt.prompt,
            prompt_token_ids=state.prompt.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=completions,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
        )

    def _make_completion(
        self, sample: SampleState, params: SamplingParams, kind: RequestOutputKind
    ) -> CompletionOutput:
        visible = len(sample.text)
        if sample.finish_reason is None and params.stop_strings:
            visible -= stop_string_holdback(sample.text, params.stop_strings)
        if kind is RequestOutputKind.DELTA:
            text = sample.text[sample.num_sent_chars : visible]
            token_ids = sample.token_ids[sample.num_sent_tokens :]
            logprobs = sample.logprobs[sample.num_sent_tokens :] if sample.logprobs is not None else None
        else:
            text, token_ids, logprobs = sample.text[:visible], list(sample.token_ids), sample.logprobs
        sample.num_sent_chars, sample.num_sent_tokens = max(sample.num_sent_chars, visible), len(sample.token_ids)
        return CompletionOutput(
            index=sample.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )
