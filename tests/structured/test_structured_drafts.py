"""Structured outputs with speculative decoding, the parts on their own (each installed grammar library, the real
tokenizer): the manager cuts a constrained request's drafts at the first token its grammar refuses and gives a
request with d scheduled drafts d + 1 bitmask rows (row j: the mask after drafts[:j]); both leave every matcher
where it was. The engine-level equality with decoding without drafts is in tests/engine/test_structured_spec.py."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from folio import SamplingParams
from folio.core.sched_output import EngineCoreOutput, SchedulerOutput
from folio.request import Request
from folio.structured.backend import allocate_bitmask
from folio.structured.bitmask import bitmask_for_rows
from folio.structured.manager import StructuredOutputManager
from folio.structured.params import StructuredOutputsParams
from tests.structured.test_structured_parts import BACKENDS, _tokenizer_and_spec

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TEXT = '{"name": "Ada", "age": 36}'


@pytest.fixture(params=BACKENDS)
def manager(request: pytest.FixtureRequest) -> Iterator[StructuredOutputManager]:
    tokenizer, spec = _tokenizer_and_spec()
    made = StructuredOutputManager(request.param, spec.vocab_size, list(spec.eos_token_ids), lambda: tokenizer)
    yield made
    made.shutdown()


def _admit(manager: StructuredOutputManager, *req_ids: str) -> list[Request]:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    requests = [Request(req_id, [1, 2, 3], params, max_tokens=64) for req_id in req_ids]
    for request in requests:
        manager.submit(request)
    while manager.num_waiting:  # the compile runs on the manager's thread
        manager.take_ready(wait=True)
    return requests


def _ids(text: str) -> list[int]:
    return list(_tokenizer_and_spec()[0].encode(text, add_special_tokens=False))


def _fill(manager: StructuredOutputManager, requests: list[Request], drafts: dict[str, list[int]]) -> SchedulerOutput:
    """fill_bitmask as after schedule(): each request's last token and its drafts are this step's tokens."""
    sched = SchedulerOutput.make_empty()
    for request in requests:
        num_drafts = len(drafts.get(request.request_id, []))
        request.num_computed_tokens = request.num_tokens + num_drafts
        sched.num_scheduled_tokens[request.request_id] = 1 + num_drafts
    sched.scheduled_spec_decode_tokens = {r: d for r, d in drafts.items() if d}
    manager.fill_bitmask({r.request_id: r for r in requests}, sched)
    return sched


def _mask_now(manager: StructuredOutputManager, request: Request) -> np.ndarray:
    """The request's mask at its matcher's current position (one row, no drafts)."""
    bitmask = _fill(manager, [request], {}).grammar_bitmask
    assert bitmask.shape[0] == 1
    return np.asarray(bitmask[0]).copy()


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(manager: StructuredOutputManager) -> None:
    (request,) = _admit(manager, "a")
    tokens = _ids(TEXT)  # '{"', 'name', '":', ' "', 'Ad', 'a', '",', ' "', 'age', '":', ' ', '3', '6', '}'
    assert manager.accept([EngineCoreOutput("a", tokens[:6])]) == []  # the request's output so far
    before = _mask_now(manager, request)
    refused = _ids("]")[0]  # after '"age":' an integer must follow
    request.spec_token_ids = tokens[6:10] + [refused] + tokens[10:12]
    manager.validate_drafts({"a": request})
    assert request.spec_token_ids == tokens[6:10]
    assert manager.num_draft_tokens_refused == 3
    assert (_mask_now(manager, request) == before).all()  # the matcher is where it was
    request.spec_token_ids = tokens[6:]  # every draft valid: kept whole
    manager.validate_drafts({"a": request})
    assert request.spec_token_ids == tokens[6:] and manager.num_draft_tokens_refused == 3
    assert (_mask_now(manager, request) == before).all()
    # The real continuation is still accepted from where the matcher stood.
    assert manager.accept([EngineCoreOutput("a", tokens[6:])]) == []


def test_nothing_is_drafted_past_the_grammars_end(manager: StructuredOutputManager) -> None:
    """Where the grammar ends, a stop token would be allowed: drafts stop before it all the same."""
    (request,) = _admit(manager, "a")
    tokens = _ids(TEXT)
    assert manager.accept([EngineCoreOutput("a", tokens[:-1])]) == []
    request.spec_token_ids = tokens[-1:] + [manager.stop_token_ids[0]] + _ids(" more")
    manager.validate_drafts({"a": request})
    assert request.spec_token_ids == tokens[-1:]
    assert manager.accept([EngineCoreOutput("a", tokens[-1:])]) == []  # the matcher still stood before '}'


def test_a_request_with_drafts_gets_one_mask_row_per_verified_position(manager: StructuredOutputManager) -> None:
    drafted, plain = _admit(manager, "drafted", "plain")
    tokens = _ids(TEXT)
    assert manager.accept([EngineCoreOutput("drafted", tokens[:2]), EngineCoreOutput("plain", tokens[:5])]) == []
    plain_mask = _mask_now(manager, plain)
    # The masks one-token decoding would see at each of the drafted request's next positions.
    expected = []
    for j in range(4):
        expected.append(_mask_now(manager, drafted))
        assert manager.accept([EngineCoreOutput("drafted", tokens[2 + j : 3 + j])]) == []
    manager.matchers["drafted"].rollback(4)
    drafts = tokens[2:5]
    sched = _fill(manager, [drafted, plain], {"drafted": drafts})
    assert sched.structured_output_request_ids == ["drafted"] * 4 + ["plain"]
    for j in range(4):
        assert (sched.grammar_bitmask[j] == expected[j]).all(), f"row {j}"
    assert (sched.grammar_bitmask[4] == plain_mask).all()
    assert not (expected[0] == expected[1]).all()  # the rows really differ
    assert (_mask_now(manager, drafted) == expected[0]).all()  # the matcher is where it was


def test_a_verified_requests_rows_take_its_consecutive_bitmask_rows() -> None:
    bitmask = allocate_bitmask(5, 64)
    bitmask[:, 0] = [10, 11, 12, 13, 14]  # tell the rows apart
    # Sampling rows: a has 2 (one draft), b 1 (free), c 3 (two drafts); the bitmask holds c's 3 rows, then a's 2.
    mask = bitmask_for_rows(["a", "b", "c"], ["c", "c", "c", "a", "a"], bitmask, torch.device("cpu"), [2, 1, 3])
    assert mask is not None
    rows, selected = mask
    assert rows.tolist() == [0, 1, 3, 4, 5]
    assert selected[:, 0].tolist() == [13, 14, 10, 11, 12]
