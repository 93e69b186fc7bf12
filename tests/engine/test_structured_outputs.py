"""Structured outputs end to end on the real default model (offline ``LLM``): every sample follows its grammar, at
temperature 0 and 1, and constrained requests work with every other engine feature. The engine conftest checks
after each test that no request and no KV block is left behind."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from folio import LLM, SamplingParams
from folio.structured.backend import GrammarError
from folio.structured.params import StructuredOutputsParams

SHORT = {"type": "string", "minLength": 1, "maxLength": 12}  # bounded, so every sample can complete

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": SHORT,
            "address": {
                "type": "object",
                "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_of_strings": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["age", "score", "ratio"],
        "additionalProperties": False,
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "nick": SHORT,
            "vip": {"type": "boolean"},
        },
        "required": ["id", "vip"],
        "additionalProperties": False,
    },
    "patterned_strings": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        },
        "required": ["date", "code"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["name", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "unions_and_null": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "null"}]},
            "label": {"type": ["string", "null"], "maxLength": 10},
            "ok": {"type": "boolean"},
        },
        "required": ["value", "label", "ok"],
        "additionalProperties": False,
    },
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "maxItems": 4},
}

ARITHMETIC_GBNF = r"""
root ::= expr
expr ::= term (" "? ("+" | "-" | "*") " "? term){0,3}
term ::= number | "(" number " "? ("+" | "-") " "? number ")"
number ::= "0" | [1-9] [0-9]?
"""


def _chat(llm: LLM, prompts: list[str], params: list[SamplingParams] | SamplingParams) -> list[Any]:
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


def _json_params(schema: dict[str, Any], temperature: float, **kwargs: Any) -> SamplingParams:
    kwargs.setdefault("max_tokens", 160)
    return SamplingParams(
        temperature=temperature, seed=7, structured_outputs=StructuredOutputsParams(json=schema), **kwargs
    )


def test_every_sample_follows_its_json_schema_at_temperature_0_and_1(llm: LLM) -> None:
    cases = [(name, t) for name in SCHEMAS for t in (0.0, 1.0)]
    prompts = [f"Reply with a JSON value for '{name}'." for name, _ in cases]
    outputs = _chat(llm, prompts, [_json_params(SCHEMAS[name], t) for name, t in cases])
    for (name, temperature), output in zip(cases, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, temperature, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])


def test_regex_choice_and_grammar_are_followed_exactly(llm: LLM) -> None:
    regex = r"[A-Z]{2}-[0-9]{3}-[a-z]{2,4}"
    choices = ["positive", "negative", "neutral"]
    kinds = [
        StructuredOutputsParams(regex=regex),
        StructuredOutputsParams(choice=choices),
        StructuredOutputsParams(grammar=ARITHMETIC_GBNF),
    ]
    prompts = ["Give me a licence code.", "Sentiment of 'I loved it':", "Compute 3+4"]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=3, max_tokens=60, structured_outputs=k) for k in kinds]
        outputs = [o.outputs[0] for o in _chat(llm, prompts, params)]
        assert all(o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
        assert re.fullmatch(regex, outputs[0].text), outputs[0].text
        assert outputs[1].text in choices, outputs[1].text
        _assert_arithmetic(outputs[2].text)


def test_json_object_is_any_json_object(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs={"json_object": True})
    completion = _chat(llm, ['What is 2+2? Reply as JSON like {"answer": 4}.'], params)[0].outputs[0]
    assert completion.finish_reason == "stop", completion.text
    assert isinstance(json.loads(completion.text), dict)  # the model alone writes '4' here


def _assert_arithmetic(text: str) -> None:
    """The text parses as an expression of small non-negative integers, + - * and one level of parentheses."""
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    tree = ast.parse(text, mode="eval")
    assert all(isinstance(node, allowed) for node in ast.walk(tree)), text
    assert all(0 <= n.value <= 99 for n in ast.walk(tree) if isinstance(n, ast.Constant)), text


def test_free_rows_in_a_mixed_batch_give_their_greedy_output_alone(llm: LLM) -> None:
    free_prompts = ["Tell me about the sea.", "List three fruits."]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in _chat(llm, free_prompts, greedy)]
    constrained = _json_params(SCHEMAS["enums"], 0.0)
    mixed = _chat(llm, [free_prompts[0], "Pick a shirt.", free_prompts[1]], [greedy, constrained, greedy])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["enums"])


def test_n_samples_logprobs_and_prefix_caching(llm: LLM) -> None:
    schema = SCHEMAS["bounded_numbers"]
    params = _json_params(schema, 1.0, n=3, logprobs=2)
    first = _chat(llm, ["Make up a player's stats."], params)[0]
    assert len(first.outputs) == 3
    # A sample may keep to the grammar without ever closing it: on an H100 (CUDA's own random streams) one wrote
    # "ratio":1.000... until max_tokens. Those end by length; every sample that stops is a valid object.
    stopped = [c for c in first.outputs if c.finish_reason == "stop"]
    assert stopped and all(len(c.token_ids) == 160 for c in first.outputs if c not in stopped)
    for completion in first.outputs:
        if completion in stopped:
            jsonschema.validate(json.loads(completion.text), schema)
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
        for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
            assert position[token_id].logprob > float("-inf")  # sampled tokens are always allowed ones
    again = _chat(llm, ["Make up a player's stats."], params)[0]  # same seed, prompt from the prefix cache
    assert again.num_cached_tokens > 0
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]


def test_greedy_argmax_among_allowed_tokens_has_rank_one(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, structured_outputs={"choice": ["no", "yes"]})
    completion = _chat(llm, ["Is the sky green? Answer yes or no."], params)[0].outputs[0]
    assert completion.text in ("no", "yes") and completion.finish_reason == "stop"
    assert completion.logprobs is not None
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert position[token_id].rank == 1


def test_greedy_through_the_fused_argmax_equals_greedy_through_masked_logits(llm: LLM) -> None:
    """Without logprobs a greedy constrained batch takes the model's fused LM-head arg-max and computes logits only
    for rows whose arg-max the grammar bans; with logprobs every row goes through masked logits. Same tokens."""
    names = ["nested_object", "enums", "patterned_strings", "top_level_array"]
    prompts = [f"Some JSON for {name}." for name in names]
    fast = _chat(llm, prompts, [_json_params(SCHEMAS[n], 0.0) for n in names])
    full = _chat(llm, prompts, [_json_params(SCHEMAS[n], 0.0, logprobs=0) for n in names])
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in full]


def test_truncation_is_length_and_stop_strings_still_apply(llm: LLM) -> None:
    truncated = _chat(llm, ["A person as JSON."], _json_params(SCHEMAS["nested_object"], 0.0, max_tokens=4))[0]
    assert truncated.outputs[0].finish_reason == "length" and len(truncated.outputs[0].token_ids) == 4
    regex = StructuredOutputsParams(regex=r"[a-z]+ [a-z]+ [a-z]+")
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[" "], structured_outputs=regex)
    stopped = _chat(llm, ["Say three words."], params)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " " and re.fullmatch("[a-z]+", stopped.text)


def test_constraints_that_ban_every_allowed_token_end_the_request_as_abort(llm: LLM) -> None:
    """min_tokens bans EOS, the only token a complete choice allows: the request ends with finish_reason abort
    and only the tokens the grammar allowed; nothing is left allocated (conftest)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5, structured_outputs={"choice": ["yes", "no"]})
    completion = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "abort"
    assert completion.text in ("yes", "no")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "nope"),
        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= missing"), "missing"),
    ],
)
def test_invalid_grammars_fail_at_add_request_and_allocate_nothing(
    llm: LLM, params: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)):
        llm.generate(["hello"], SamplingParams(max_tokens=4, structured_outputs=params), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    ok = llm.generate(["hello"], SamplingParams(max_tokens=4, structured_outputs={"choice": ["a"]}), use_tqdm=False)
    assert ok[0].outputs[0].text == "a"


def test_chunked_prefill_and_preemption_keep_the_grammar(make_llm: Callable[..., LLM], llm: LLM) -> None:
    """A small KV cache forces recompute preemptions and prompts go in 16-token chunks; the greedy outputs equal
    those of the roomy default engine, and each follows its schema."""
    names = ["nested_object", "array_of_objects", "patterned_strings", "unions_and_null", "enums", "bounded_numbers"]
    prompts = [f"Reply with JSON for {name}, please, in full." for name in names]
    params = [_json_params(SCHEMAS[name], 0.0) for name in names]
    expected = [o.outputs[0].token_ids for o in _chat(llm, prompts, params)]
    block_bytes = 737280  # 16 tokens x 30 layers x K and V x 3 heads x 64 x float32
    tight = make_llm(kv_cache_memory_bytes=16 * block_bytes, max_model_len=256, long_prefill_token_threshold=16)
    outputs = _chat(tight, prompts, params)
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for name, output in zip(names, outputs, strict=True):
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS[name])


def test_the_xgrammar_backend_gives_valid_json_too(make_llm: Callable[..., LLM]) -> None:
    pytest.importorskip("xgrammar")
    xgr = make_llm(structured_outputs_config={"backend": "xgrammar"})
    names = ["nested_object", "bounded_numbers", "patterned_strings"]
    outputs = _chat(xgr, [f"JSON for {n}." for n in names], [_json_params(SCHEMAS[n], 1.0) for n in names])
    for name, output in zip(names, outputs, strict=True):
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS[name])
    with pytest.raises(GrammarError, match="cannot enforce 'uniqueItems'"):  # refused, not silently ignored
        xgr.generate(["x"], _json_params({"type": "array", "uniqueItems": True}, 0.0), use_tqdm=False)
