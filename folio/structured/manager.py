"""StructuredOutputManager: beside the scheduler in the engine core, it owns every constrained request's grammar.

A constrained request's life here:
  1. ``submit`` (EngineCore.add_request): the request waits in this manager, not in the scheduler, while its grammar
     compiles on the manager's own thread. Equal specs share one compile (an LRU cache keyed by GrammarSpec).
  2. ``take_ready`` (start of each step): requests whose grammar is ready get a matcher and go to the scheduler.
     So a request is never scheduled, and holds no KV block, before its grammar is ready; the step loop never
     waits on a compile while other requests run (with nothing else to run it waits at most _WAIT_S per step).
  3. ``fill_bitmask`` (after ``schedule()``): one backend call fills the bitmask rows of every constrained request
     that samples this step (its chunk reaches its last token: a chunked prefill's earlier chunks get no row).
  4. ``accept`` (after ``update_from_output``): each matcher advances over its request's new tokens (with
     speculative decoding: the accepted drafts and the bonus token; a draft the target rejected never reaches it).
  5. ``validate_drafts`` (after ``accept``): the drafts the worker proposed for the next step (Request.spec_token_ids)
     are cut at the first token the grammar refuses, so only drafts the grammar accepts are scheduled; with d
     drafts scheduled, ``fill_bitmask`` gives the request d + 1 rows (row j: the mask after drafts[:j]).
  6. ``remove``: the request finished or was aborted.
Preemption needs nothing here: a preempted request keeps its output tokens (recompute computes them again as
input, swap keeps their K/V) and samples next after the last of them, which is where its matcher stands.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from folio.core.sched_output import EngineCoreOutput, SchedulerOutput
from folio.request import Request
from folio.structured.backend import Matcher, StructuredOutputBackend, allocate_bitmask, create_backend
from folio.structured.params import GrammarSpec

logger = logging.getLogger("folio")

_CACHE_SIZE = 128  # compiled grammars kept (llguidance's are small; xgrammar's hold a token-mask cache)
_WAIT_S = 0.05  # how long an otherwise idle step waits for a compile to finish before returning


class StructuredOutputManager:
    """Compile cache, one matcher per running constrained request, and one bitmask per step."""

    def __init__(
        self, backend_name: str, vocab_size: int, stop_token_ids: list[int], load_tokenizer: Callable[[], Any]
    ) -> None:
        self.backend_name = backend_name
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._stop_ids = frozenset(stop_token_ids)
        self._load_tokenizer = load_tokenizer  # called once, on the compile thread, at the first constrained request
        self._backend: StructuredOutputBackend | None = None  # set on the compile thread before any compile ends
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="folio-grammar")
        self._compiled: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._waiting: list[tuple[Request, Future[Any]]] = []  # in arrival order
        self.matchers: dict[str, Matcher] = {}
        self.num_draft_tokens_refused = 0  # drafts cut by validate_drafts (speculative decoding), ever

    # ---------------------------------------------------------------- compile

    @staticmethod
    def is_constrained(request: Request) -> bool:
        return request.sampling_params.structured_outputs is not None

    def submit(self, request: Request) -> None:
        """Start (or join) the compile of ``request``'s grammar; the request waits here until take_ready."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        spec = params.grammar_spec()
        future = self._compiled.get(spec)
        if future is None:
            future = self._executor.submit(self._compile, spec)
            self._compiled[spec] = future
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        self._waiting.append((request, future))

    def _compile(self, spec: GrammarSpec) -> Any:
        if self._backend is None:
            self._backend = create_backend(
                self.backend_name, self._load_tokenizer(), self.vocab_size, self.stop_token_ids
            )
        return self._backend.compile(spec)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def take_ready(self, wait: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose grammar is ready, each with its matcher made; requests whose compile failed, with the
        error), both in arrival order. ``wait``: block up to _WAIT_S for a first compile to finish."""
        if not self._waiting:
            return [], []
        if wait:
            concurrent.futures.wait(
                [f for _, f in self._waiting], timeout=_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED
            )
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        still_waiting: list[tuple[Request, Future[Any]]] = []
        for request, future in self._waiting:
            if not future.done():
                still_waiting.append((request, future))
                continue
            error = future.exception()
            if error is not None:
                failed.append((request, str(error)))
                self._forget_failed(future)
                continue
            assert self._backend is not None
            self.matchers[request.request_id] = self._backend.new_matcher(future.result())
            ready.append(request)
        self._waiting = still_waiting
        return ready, failed

    def _forget_failed(self, future: Future[Any]) -> None:
        for spec, cached in list(self._compiled.items()):
            if cached is future:
                del self._compiled[spec]

    # ---------------------------------------------------------------- per step

    def fill_bitmask(self, requests: Mapping[str, Request], scheduler_output: SchedulerOutput) -> None:
        """Set scheduler_output's grammar bitmask: rows for each constrained request that samples this step, in
        scheduling order: one, or d + 1 consecutive ones for a request with d scheduled drafts (row j: the mask
        after drafts[:j]; its id repeats d + 1 times in structured_output_request_ids). One backend call. Call
        after schedule() (num_computed_tokens already counts this step's tokens)."""
        if not self.matchers:
            return
        req_ids: list[str] = []
        rows: list[tuple[Matcher, int, list[int]]] = []  # (matcher, first row, scheduled drafts)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if req_id in self.matchers and request is not None and request.num_computed_tokens >= request.num_tokens:
                drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
                rows.append((self.matchers[req_id], len(req_ids), drafts))
                req_ids.extend([req_id] * (len(drafts) + 1))
        if not req_ids:
            return
        assert self._backend is not None
        bitmask = allocate_bitmask(len(req_ids), self.vocab_size)
        if len(req_ids) > len(rows):  # some request has drafts
            self._backend.fill_bitmask_with_drafts(rows, bitmask)
        else:
            self._backend.fill_bitmask([(matcher, row) for matcher, row, _ in rows], bitmask)
        scheduler_output.structured_output_request_ids = req_ids
        scheduler_output.grammar_bitmask = bitmask

    def validate_drafts(self, requests: Mapping[str, Request]) -> None:
        """Cut each constrained request's drafts (``spec_token_ids``, just stored by update_from_output) before the
        first token its grammar refuses, and before the first stop token (a stop token ends the request or, with
        ignore_eos, can only be followed by more of them: nothing to gain). Call after ``accept``: each matcher
        stands after its request's last token. The matchers end where they started."""
        for req_id, matcher in self.matchers.items():
            request = requests.get(req_id)
            if request is None or not request.spec_token_ids:
                continue
            drafts = request.spec_token_ids
            end = next((i for i, token_id in enumerate(drafts) if token_id in self._stop_ids), len(drafts))
            num_valid = matcher.validate_tokens(drafts[:end]) if end else 0
            if num_valid < len(drafts):
                request.spec_token_ids = drafts[:num_valid]
                self.num_draft_tokens_refused += len(drafts) - num_valid

    def accept(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Advance each constrained request's matcher over its new tokens; forget finished ones. Returns the ids
        of unfinished requests that sampled a token their grammar forbids (only possible when other constraints,
        such as min_tokens against a complete grammar, banned every token the grammar allowed)."""
        rejected: list[str] = []
        for output in outputs:
            matcher = self.matchers.get(output.request_id)
            if matcher is None:
                continue
            if output.finished:  # its last token may be a user stop token outside the grammar: nothing to check
                del self.matchers[output.request_id]
            elif output.new_token_ids and not matcher.accept_tokens(output.new_token_ids):
                rejected.append(output.request_id)
        return rejected

    def remove(self, request_ids: list[str]) -> None:
        """Forget aborted or finished requests, waiting or running."""
        gone = set(request_ids)
        for req_id in gone:
            self.matchers.pop(req_id, None)
        self._waiting = [(r, f) for r, f in self._waiting if r.request_id not in gone]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
