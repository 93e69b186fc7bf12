"""SpeculativeConfig: vLLM's fields and defaults, errors that name the field, the --speculative-config flag."""

from __future__ import annotations

import pytest

from folio.config import EngineArgs
from folio.spec_decode.config import SpeculativeConfig


def test_ngram_defaults_follow_vllm() -> None:
    both = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    given = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=5, prompt_lookup_min=2)
    assert (given.method, given.num_speculative_tokens, given.prompt_lookup_min, given.prompt_lookup_max) == (
        "ngram",
        4,
        2,
        5,
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, r"speculative_config.method must be one of"),
        ({"method": "ngram"}, r"speculative_config.num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, r"speculative_config.num_speculative_tokens must be an integer >= 1, got 0"),
        ({"num_speculative_tokens": True}, r"num_speculative_tokens must be an integer >= 1, got True"),
        ({"num_speculative_tokens": "3"}, r"num_speculative_tokens must be an integer >= 1, got '3'"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, r"speculative_config.prompt_lookup_min must be"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": -1}, r"speculative_config.prompt_lookup_max must be"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_min=4 must be <= prompt_lookup_max=2",
        ),
        ({"num_speculative_tokens": 2, "model": "x.gguf"}, r"speculative_config.model is for method 'draft_model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config.model \(the draft model"),
        (
            {"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            r"speculative_config.prompt_lookup_max is for method 'ngram'",
        ),
        ({"num_speculative_tokens": 2, "lookahead": 3}, r"unknown fields \['lookahead'\]"),
        ({"method": 5, "num_speculative_tokens": 2}, r"speculative_config.method must be a string"),
    ],
)
def test_bad_fields_are_refused_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_value(fields)


def test_from_value() -> None:
    assert SpeculativeConfig.from_value(None) is None
    config = SpeculativeConfig(num_speculative_tokens=2)
    assert SpeculativeConfig.from_value(config) is config
    with pytest.raises(ValueError, match="speculative_config must be a JSON object, got 3"):
        SpeculativeConfig.from_value(3)  # type: ignore[arg-type]
    draft = SpeculativeConfig.from_value({"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 2})
    assert draft is not None and (draft.model, draft.prompt_lookup_min) == ("d.gguf", None)


def test_engine_config_without_speculation_has_none() -> None:
    assert EngineArgs().create_engine_config("model.gguf", 2048).speculative_config is None


def test_flag_reaches_engine_args_and_unsupported_combinations_are_refused_not_ignored() -> None:
    from folio.cli import build_parser, engine_args_from

    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    args = engine_args_from(build_parser().parse_args(["serve", "--speculative-config", flag]))
    assert args.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    config = args.create_engine_config("model.gguf", 2048).speculative_config
    assert config == SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=2)
    with pytest.raises(SystemExit):  # argparse: "not valid JSON"
        build_parser().parse_args(["serve", "--speculative-config", "{method: ngram}"])
    bad = engine_args_from(build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram"}']))
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens is required"):
        bad.create_engine_config("model.gguf", 2048)
    spec = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}
    config = EngineArgs(speculative_config=spec).create_engine_config("model.gguf", 2048).speculative_config
    assert config == SpeculativeConfig("draft_model", 2, model="d")
    with pytest.raises(ValueError, match="'draft_model' with kv_offloading_size is not implemented yet"):
        EngineArgs(speculative_config=spec, kv_offloading_size=1.0).create_engine_config("model.gguf", 2048)
    with pytest.raises(ValueError, match="'draft_model' needs a real target model, not model_impl noop"):
        EngineArgs(speculative_config=spec, model_impl="noop").create_engine_config("model.gguf", 2048)
    tp3 = EngineArgs(speculative_config=spec, tensor_parallel_size=3).create_engine_config("model.gguf", 2048)
    assert tp3.speculative_config == config  # the draft runs under tensor parallelism (tests/parallel)
