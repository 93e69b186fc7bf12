"""The parts of structured outputs on their own: the request's params, the bitmask applied by the sampler, each
installed grammar library behind the backend interface (on the default model's real tokenizer), and the manager's
choice of which rows get a mask."""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import pytest
import torch

from folio import SamplingParams
from folio.core.sched_output import SchedulerOutput
from folio.model.loader import default_model_path, load_tokenizer, read_model_spec
from folio.request import Request
from folio.sample.metadata import SamplingMetadata
from folio.sample.sampler import Sampler
from folio.structured.backend import (
    GrammarError,
    allocate_bitmask,
    create_backend,
    resolve_backend_name,
    validate_grammar_spec,
)
from folio.structured.bitmask import (
    allowed_tokens_by_shifts,
    apply_token_bitmask_rows,
    bitmask_for_rows,
    constrained_greedy,
    masked_logits,
)
from folio.structured.manager import StructuredOutputManager
from folio.structured.params import GrammarSpec, StructuredOutputsParams
from folio.structured.token_bytes import PROBE

BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(_missing, reason=f"{name} not installed"))
    for name, _missing in (
        ("guidance", not __import__("importlib").util.find_spec("llguidance")),
        ("xgrammar", not __import__("importlib").util.find_spec("xgrammar")),
    )
]


@functools.cache
def _tokenizer_and_spec() -> tuple[Any, Any]:
    path = default_model_path()
    return load_tokenizer(path), read_model_spec(path)


# ---------------------------------------------------------------------------------------------- params


def test_exactly_one_kind_is_required_and_named() -> None:
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of .*; got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs.json must be a JSON schema"):
        StructuredOutputsParams(json="[1, 2]")
    assert StructuredOutputsParams(json_object=False, regex="a").kind == "regex"  # False is not a choice


def test_sampling_params_take_a_dict_and_reject_other_types() -> None:
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.structured_outputs.grammar_spec() == GrammarSpec("choice", '["a", "b"]')
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")  # type: ignore[arg-type]


def test_equal_schemas_share_one_spec_and_keep_their_property_order() -> None:
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object",  "properties": {"x": {"type": "integer"}, "a": {}}}')
    assert a.grammar_spec() == b.grammar_spec() and hash(a.grammar_spec()) == hash(b.grammar_spec())
    reordered = StructuredOutputsParams(json={"properties": {"a": {}, "x": {"type": "integer"}}, "type": "object"})
    assert reordered.grammar_spec() != a.grammar_spec()  # the output lists properties in the schema's order


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_properties_come_in_the_schemas_order(backend_name: str) -> None:
    tokenizer, spec = _tokenizer_and_spec()
    backend = create_backend(backend_name, tokenizer, spec.vocab_size, list(spec.eos_token_ids))
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    compiled = backend.compile(StructuredOutputsParams(json=schema).grammar_spec())
    in_order = backend.new_matcher(compiled)
    assert in_order.accept_tokens(tokenizer.encode('{"zeta": 1, "alpha": 2}', add_special_tokens=False))
    sorted_order = backend.new_matcher(compiled)
    assert not sorted_order.accept_tokens(tokenizer.encode('{"alpha": 2, "zeta": 1}', add_special_tokens=False))


# ---------------------------------------------------------------------------------------------- bitmask


def _reference_mask(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    for row in range(out.shape[0]):
        for token in range(out.shape[1]):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab_size", [3, 32, 70])  # a partial last word, one word, several
def test_apply_token_bitmask_matches_the_bit_by_bit_rule(vocab_size: int) -> None:
    rng = np.random.default_rng(vocab_size)
    bitmask = rng.integers(-(2**31), 2**31, size=(4, (vocab_size + 31) // 32), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # all banned
    logits = torch.randn(4, vocab_size)
    expected = _reference_mask(logits, bitmask)
    assert torch.equal(masked_logits(logits, torch.from_numpy(bitmask)), expected)
    by_shifts = allowed_tokens_by_shifts(torch.from_numpy(bitmask), vocab_size)  # the other devices' path
    assert torch.equal(torch.where(by_shifts, logits, float("-inf")), expected)


def test_masking_selected_rows_leaves_the_others_and_the_input_alone() -> None:
    logits = torch.randn(3, 40)
    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask[0, 0] = 0b1010  # tokens 1 and 3
    out = apply_token_bitmask_rows(logits, torch.tensor([1]), torch.from_numpy(bitmask))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(logits).all()  # the caller's logits are not modified


def test_bitmask_rows_follow_the_sampling_rows() -> None:
    bitmask = np.arange(4, dtype=np.int32).reshape(2, 2)  # row 0 is c's, row 1 is a's
    rows, selected = bitmask_for_rows(["a", "b", "c"], ["c", "a"], bitmask, torch.device("cpu")) or (None, None)
    assert rows is not None and selected is not None
    assert rows.tolist() == [0, 2] and selected.tolist() == [[2, 3], [0, 1]]
    assert bitmask_for_rows(["b"], ["c", "a"], bitmask, torch.device("cpu")) is None


def test_constrained_greedy_from_the_unconstrained_argmax_is_exact() -> None:
    """Rows whose arg-max is allowed keep it (ties: the first index); only banned rows get logits."""
    logits = torch.tensor(
        [[1.0, 9, 9, 0], [5.0, 1, 2, 3], [0.0, 7, 1, 7], [2.0, 2, 2, 2]]  # row 2: tie between tokens 1 and 3
    )
    bitmask = torch.tensor([[0b0110], [0b1100], [0b1010]], dtype=torch.int32)  # rows 0, 1, 2 constrained
    rows = torch.tensor([0, 1, 2])
    asked: list[list[int]] = []

    def logits_of(indices: torch.Tensor) -> torch.Tensor:
        asked.append(indices.tolist())
        return logits.index_select(0, indices)

    result = constrained_greedy(logits.argmax(dim=-1), (rows, bitmask), logits_of)
    expected = logits.argmax(dim=-1).clone()
    expected[rows] = masked_logits(logits[rows], bitmask).argmax(dim=-1)
    assert result.tolist() == expected.tolist() == [1, 3, 1, 0]
    assert asked == [[1]]  # row 1's arg-max (token 0) is banned; rows 0 and 2 keep theirs


def test_the_sampler_masks_before_logprobs_and_skips_the_argmax_shortcut() -> None:
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0)]
    metadata = SamplingMetadata.build(params, [[1], [1]], [[], []], [None, None], 8, torch.device("cpu"))
    logits = torch.tensor([[5.0, 4, 3, 2, 1, 0, 0, 0]] * 2)
    bitmask = np.array([[0b01000100]], dtype=np.int32)  # row 0 may only say tokens 2 and 6
    metadata.grammar_bitmask = (torch.tensor([0]), torch.from_numpy(bitmask))
    assert not Sampler.only_argmax(metadata)
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.tolist() == [2, 0]
    assert out.logprobs is not None
    row0 = out.logprobs.token_ids[0].tolist()
    assert row0[:2] == [2, 2] and row0[2] == 6  # chosen, then top-2 among the allowed tokens only
    assert torch.isfinite(out.logprobs.logprobs[0, :3]).all()


# ---------------------------------------------------------------------------------------------- backends


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (StructuredOutputsParams(json={"type": "objekt"}), "structured_outputs.json"),
        (StructuredOutputsParams(json={"type": "string", "pattern": "(["}), "structured_outputs.json"),
        (StructuredOutputsParams(json={"not": {"type": "string"}}), "structured_outputs.json"),  # unenforceable
        (StructuredOutputsParams(regex="(["), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    ],
)
def test_invalid_specs_raise_the_compilers_message(
    backend: str, params: StructuredOutputsParams, expected: str
) -> None:
    with pytest.raises(GrammarError) as info:
        validate_grammar_spec(backend, params.grammar_spec())
    assert str(info.value).startswith(expected + ": ")
    assert info.value.detail  # the compiler's own words, not an empty message


def test_auto_is_llguidance_and_unknown_names_are_refused() -> None:
    assert resolve_backend_name("auto") == "guidance"
    with pytest.raises(ValueError, match="structured_outputs_config.backend must be one of"):
        resolve_backend_name("outlines")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_matcher_allows_exactly_the_choices_then_only_eos(backend_name: str) -> None:
    tokenizer, spec = _tokenizer_and_spec()
    eos = list(spec.eos_token_ids)
    backend = create_backend(backend_name, tokenizer, spec.vocab_size, eos)
    compiled = backend.compile(StructuredOutputsParams(choice=["yes", "no"]).grammar_spec())
    matcher = backend.new_matcher(compiled)
    bitmask = allocate_bitmask(2, spec.vocab_size)
    backend.fill_bitmask([(matcher, 1)], bitmask)
    assert (bitmask[0] == -1).all()  # a row nobody asked for is untouched
    allowed = _allowed(bitmask[1], spec.vocab_size)
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert eos[0] not in allowed  # nothing is complete yet
    assert matcher.accept_tokens(tokenizer.encode("yes", add_special_tokens=False))
    backend.fill_bitmask([(matcher, 0)], bitmask)
    assert _allowed(bitmask[0], spec.vocab_size) == eos  # complete: the stop token alone
    assert matcher.accept_tokens([eos[0]]) and matcher.is_terminated()


def _allowed(row: np.ndarray, vocab_size: int) -> list[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


# ---------------------------------------------------------------------------------------------- manager


def test_the_manager_masks_only_rows_that_sample_and_frees_finished_requests() -> None:
    tokenizer, spec = _tokenizer_and_spec()
    manager = StructuredOutputManager("auto", spec.vocab_size, list(spec.eos_token_ids), lambda: tokenizer)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    decoding = Request("decode", [1, 2, 3], params, max_tokens=8)
    prefilling = Request("prefill", [1] * 40, params, max_tokens=8)
    free = Request("free", [1, 2], SamplingParams(), max_tokens=8)
    for request in (decoding, prefilling):
        manager.submit(request)
    ready: list[Request] = []
    while manager.num_waiting:  # the compile runs on the manager's thread; take_ready(wait) blocks up to 50 ms
        ready += manager.take_ready(wait=True)[0]
    assert [r.request_id for r in ready] == ["decode", "prefill"]
    decoding.num_computed_tokens = 3  # after schedule(): its last token is computed this step -> it samples
    prefilling.num_computed_tokens = 16  # a first chunk of 16 of 40 tokens: no sample, no mask row
    free.num_computed_tokens = 2
    sched = SchedulerOutput.make_empty()
    sched.num_scheduled_tokens = {"free": 2, "prefill": 16, "decode": 1}
    manager.fill_bitmask({r.request_id: r for r in (decoding, prefilling, free)}, sched)
    assert sched.structured_output_request_ids == ["decode"]
    allowed = _allowed(sched.grammar_bitmask[0], spec.vocab_size)
    assert {tokenizer.decode([t]).strip()[:1] for t in allowed} <= {"{", ""}  # a JSON object starts with {
    open_brace = tokenizer.encode("{", add_special_tokens=False)
    from folio.core.sched_output import EngineCoreOutput

    assert manager.accept([EngineCoreOutput("decode", open_brace)]) == []
    assert manager.accept([EngineCoreOutput("decode", tokenizer.encode("]", add_special_tokens=False))]) == [
        "decode"
    ]  # a token the grammar forbids is reported
    manager.remove(["decode", "prefill"])
    assert manager.matchers == {}
    manager.shutdown()


def test_a_schema_compiles_once_for_many_requests() -> None:
    tokenizer, spec = _tokenizer_and_spec()
    calls: list[str] = []

    def load() -> Any:
        calls.append("tokenizer")
        return tokenizer

    manager = StructuredOutputManager("auto", spec.vocab_size, list(spec.eos_token_ids), load)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    for i in range(3):
        manager.submit(Request(str(i), [1], SamplingParams(structured_outputs={"json": schema}), max_tokens=4))
    assert len(manager._compiled) == 1
    while manager.num_waiting:
        manager.take_ready(wait=True)
    assert len(manager.matchers) == 3 and calls == ["tokenizer"]
    manager.shutdown()


def _as_transformers_5_17_converted_it(tokenizer: Any) -> Any:
    """The real tokenizer as transformers 5.17 converted the GGUF: byte_fallback BPE, a sentencepiece decoder."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    described = json.loads(tokenizer.backend_tokenizer.to_str())
    described["model"]["byte_fallback"] = True
    replace_marker = {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}
    steps = [{"type": "ByteFallback"}, {"type": "Fuse"}, replace_marker, described["decoder"]]
    described["decoder"] = {"type": "Sequence", "decoders": steps}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(described)))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_backend_that_misreads_the_vocabulary_refuses_to_start(backend_name: str) -> None:
    """Seen on a GPU machine's transformers 5.17: transformers still decodes the text right, llguidance does not,
    and every grammar would refuse valid JSON. Its backend refuses to start, naming the way out; xgrammar reads
    that vocabulary right (it tells byte-level from byte-fallback otherwise) and starts."""
    tokenizer, spec = _tokenizer_and_spec()
    eos = list(spec.eos_token_ids)
    create_backend(backend_name, tokenizer, spec.vocab_size, eos)  # the tokenizer as converted today passes
    misread = _as_transformers_5_17_converted_it(tokenizer)
    assert misread.decode(misread.encode(PROBE, add_special_tokens=False)) == PROBE
    if backend_name == "xgrammar":
        create_backend(backend_name, misread, spec.vocab_size, eos)
        return
    with pytest.raises(ValueError, match=r"reads this tokenizer's tokens as other bytes .* transformers>=5\.18"):
        create_backend(backend_name, misread, spec.vocab_size, eos)


# ---------------------------------------------------------------------------------------------- config


def test_structured_outputs_config_flag_reaches_the_engine_config() -> None:
    from folio.cli import build_parser, engine_args_from

    pytest.importorskip("xgrammar")  # the config refuses a backend whose package is missing
    ns = build_parser().parse_args(["serve", "--structured-outputs-config", '{"backend": "xgrammar"}'])
    config = engine_args_from(ns).create_engine_config("model.gguf", 2048)
    assert config.structured_outputs_config.backend == "xgrammar"
    default = engine_args_from(build_parser().parse_args(["serve"])).create_engine_config("model.gguf", 2048)
    assert default.structured_outputs_config.backend == "auto"
    with pytest.raises(SystemExit):  # argparse: "not valid JSON"
        build_parser().parse_args(["serve", "--structured-outputs-config", "{backend: x}"])
    bad = build_parser().parse_args(["serve", "--structured-outputs-config", '{"backend": "outlines"}'])
    with pytest.raises(ValueError, match="structured_outputs_config.backend must be one of"):
        engine_args_from(bad).create_engine_config("model.gguf", 2048)
    unknown = build_parser().parse_args(["serve", "--structured-outputs-config", '{"backend": "auto", "x": 1}'])
    with pytest.raises(ValueError, match=r"unknown fields \['x'\]"):
        engine_args_from(unknown).create_engine_config("model.gguf", 2048)
