"""Structured outputs combined with n-gram speculative decoding, on the real default model: JSON-schema, regex and
choice requests (greedy and seeded temperature 1) give token for token the outputs of the same requests without
speculation, every JSON output validates, and drafts were really proposed, checked against the grammar (some cut)
and accepted for these constrained requests. The engine conftest checks for leaks after each test."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from folio import LLM, SamplingParams
from folio.outputs import RequestOutput
from folio.structured.params import StructuredOutputsParams
from tests.engine.conftest import assert_no_leaks
from tests.engine.test_spec_decode import SPEC
from tests.small_engine import SMALL_ENGINE

PERSON = {"name": "Ada Lovelace", "born": 1815, "city": "London", "skills": ["math", "poetry", "engines"]}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "city": {"type": "string", "maxLength": 20},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "born", "city", "skills"],
    "additionalProperties": False,
}
CODES = "AB-123 CD-456 EF-789 GH-012 IJ-345"
CODES_REGEX = r"([A-Z]{2}-[0-9]{3} ){4}[A-Z]{2}-[0-9]{3}"
CHOICES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "All that glitters is not gold.",
]


def _cases() -> list[tuple[str, StructuredOutputsParams]]:
    """(prompt, constraint): prompts that ask to copy what they hold, so the n-gram proposer fires."""
    person = json.dumps(PERSON)
    return [
        (
            f"Repeat this JSON object exactly.\nObject: {person}\nRepeated: ",
            StructuredOutputsParams(json=PERSON_SCHEMA),
        ),
        (f"Copy it: {person}\nCopy: {person}\nCopy: ", StructuredOutputsParams(json=PERSON_SCHEMA)),
        (f"Repeat these codes: {CODES}\nRepeated: {CODES}\nRepeated: ", StructuredOutputsParams(regex=CODES_REGEX)),
        ("Which proverb? " + " Or: ".join(CHOICES) + "\nAnswer: ", StructuredOutputsParams(choice=CHOICES)),
    ]


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return LLM(dtype="float32", **SMALL_ENGINE, speculative_config=SPEC)


def _run(
    llm: LLM, temperature: float, logprobs: int | None = None
) -> tuple[list[tuple[str, StructuredOutputsParams]], list[RequestOutput]]:
    cases = _cases()
    params = [
        SamplingParams(
            temperature=temperature, seed=11 + i, max_tokens=80, logprobs=logprobs, structured_outputs=constraint
        )
        for i, (_, constraint) in enumerate(cases)
    ]
    outputs = llm.generate([prompt for prompt, _ in cases], params, use_tqdm=False)
    assert_no_leaks(llm)
    return cases, outputs


def _check_follows(constraint: StructuredOutputsParams, output: RequestOutput) -> None:
    completion = output.outputs[0]
    assert completion.finish_reason == "stop", completion.text
    if constraint.json is not None:
        jsonschema.validate(json.loads(completion.text), PERSON_SCHEMA)
    elif constraint.regex is not None:
        assert re.fullmatch(CODES_REGEX, completion.text), completion.text
    else:
        assert completion.text in CHOICES, completion.text


@pytest.mark.parametrize(
    ("temperature", "logprobs"),
    [(0.0, None), (1.0, None), (0.0, 2)],
    ids=["greedy-fused-argmax", "seeded-t1", "greedy-logprobs"],
)
def test_constrained_requests_speculate_with_the_outputs_of_plain_decoding(
    llm: LLM, spec_llm: LLM, temperature: float, logprobs: int | None
) -> None:
    """Greedy rows go through the fused arg-max (logits only where the grammar bans it), greedy rows with logprobs
    and sampled rows through the sampler, the grammar row of each position as its first stage."""
    stats: Any = spec_llm.llm_engine.scheduler.spec_decoding_stats
    manager = spec_llm.llm_engine.engine_core.structured_output_manager
    before = (stats.num_drafts, stats.num_accepted_tokens, manager.num_draft_tokens_refused)
    cases, got = _run(spec_llm, temperature, logprobs)
    _, want = _run(llm, temperature, logprobs)
    for (prompt, constraint), g, w in zip(cases, got, want, strict=True):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids), (prompt, g.outputs[0].text)
        _check_follows(constraint, g)
        if logprobs is not None:  # the masked logits' logprobs, as plain decoding gives them
            g_logprobs, w_logprobs = g.outputs[0].logprobs, w.outputs[0].logprobs
            assert g_logprobs is not None and w_logprobs is not None and len(g_logprobs) == len(w_logprobs)
            for g_pos, w_pos in zip(g_logprobs, w_logprobs, strict=True):
                assert list(g_pos) == list(w_pos)
                for token_id, w_logprob in w_pos.items():
                    assert g_pos[token_id].logprob == pytest.approx(w_logprob.logprob, abs=1e-4)
    # Every request here is constrained: drafts were proposed and accepted for them, and the grammar cut some.
    assert stats.num_drafts > before[0] and stats.num_accepted_tokens > before[1], stats
    assert manager.num_draft_tokens_refused > before[2]
    if temperature == 0.0:
        assert got[0].outputs[0].text.replace(" ", "") == json.dumps(PERSON).replace(" ", "")  # really copied


def test_xgrammar_rows_under_chunked_prefill_and_preemption(make_llm: Callable[..., LLM]) -> None:
    """The xgrammar backend (its draft rows filled one draft position at a time) with speculation under a small
    token budget (chunked prefill, drafts cut by the budget) and few KV blocks (preemption drops the drafts):
    the outputs of the same backend without speculation, greedy and seeded."""
    pytest.importorskip("xgrammar")
    backend = {"backend": "xgrammar"}
    plain = make_llm(structured_outputs_config=backend)
    tight = make_llm(
        structured_outputs_config=backend,
        speculative_config=SPEC,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=16,
        max_model_len=256,
    )
    for temperature in (0.0, 1.0):
        cases, got = _run(tight, temperature)
        _, want = _run(plain, temperature)
        assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in want]
        for (_, constraint), output in zip(cases, got, strict=True):
            _check_follows(constraint, output)
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert tight.llm_engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0
