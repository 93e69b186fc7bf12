"""DecodeGraphs' padding, checked on the CPU with capture off (the same padded forward, run eagerly): padded rows
write only the scratch block and attend nowhere, so every request's tokens are those of the plain engine."""

from __future__ import annotations

from collections.abc import Callable

from folio import LLM, SamplingParams
from folio.worker.decode_graphs import capture_sizes
from tests.engine.conftest import assert_no_leaks

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of the planets of the solar system:",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "A haiku about the sea:\n",
    "Translate to French: I would like a cup of coffee, please.",
]


def test_capture_sizes() -> None:
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1000)[-3:] == [448, 480, 512]


def test_padded_decode_steps_match_the_plain_engine(make_llm: Callable[..., LLM]) -> None:
    # requests end at different steps, so the decode batch shrinks 7 -> 1 through padded sizes 5 (of 5), 4 (of 3)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    plain = make_llm()
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]

    padded = make_llm()
    engine = padded.llm_engine
    runner = engine.executor.worker.model_runner
    block_size = engine.config.cache_config.block_size
    scratch_slot = engine.config.cache_config.num_blocks * block_size
    graphs = runner.enable_decode_graphs(5, engine.config.scheduler_config.max_model_len, scratch_slot, capture=False)
    assert runner.decode_graphs is graphs and graphs.sizes == [1, 2, 4, 5]
    got = [o.outputs[0].token_ids for o in padded.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    assert graphs.num_runs >= 15  # the decode-only steps with at most 5 requests
    assert_no_leaks(padded)
