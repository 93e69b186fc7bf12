"""The engine on every ISA tier this CPU can run (``--cpu-isa``), held to transformers by the top-5 rule.

A tier changes which kernels run (folio/kernels/cpu_plan.py), never the model's maths beyond float noise: each
tier's greedy runs over the reference prompts must match transformers' (identical, or each side's token in the
other's top-5 where a near-tie flips).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from folio import LLM, SamplingParams
from folio.bench.datasets import DEFAULT_W1_PATH, load_w1
from folio.kernels.cpu_build import native_tier
from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.isa import IsaTier
from tests.conftest import EXTENDED_LIBRARIES
from tests.engine.conftest import assert_no_leaks, greedy_verdicts
from tests.engine.greedy_compare import GreedyRun
from tests.small_engine import SMALL_ENGINE


def _matches_transformers(
    cpu_isa: str, tokenizer: Any, hf_reference: list[GreedyRun], caplog: pytest.LogCaptureFixture, prompts: int | None
) -> list[str]:
    """An engine of ``cpu_isa`` held to transformers by the top-5 rule, its blocks all back at the end; returns
    the folio logger's start-up lines, the first of them the one naming the tier."""
    folio_logger = logging.getLogger("folio")  # it does not propagate to the root logger caplog listens on
    folio_logger.addHandler(caplog.handler)
    try:
        llm = LLM(
            device="cpu",
            dtype="float32",
            cpu_isa=cpu_isa,
            **SMALL_ENGINE,
        )
    finally:
        folio_logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records]
    # the start-up line names the tier and the implementation chosen for each operation
    line = next(line for line in lines if "ISA tier" in line)
    assert f"ISA tier {cpu_isa} " in line and "gemm=" in line and "decode_attention=" in line, line
    verdicts = greedy_verdicts(llm, tokenizer, hf_reference, prompts)
    print(cpu_isa, "verdicts:", verdicts)
    assert verdicts.count("identical") >= len(verdicts) - 2, verdicts
    assert_no_leaks(llm)
    return [line, *(other for other in lines if other != line)]


def test_each_tier_matches_transformers(
    cpu_tier: IsaTier, tokenizer: Any, hf_reference: list[GreedyRun], caplog: pytest.LogCaptureFixture
) -> None:
    # the generic tier runs torch's ops, slow at the engine's shapes: a third of the prompts keep CI's time
    prompts = 4 if cpu_tier == IsaTier.GENERIC else None
    _matches_transformers(cpu_tier.flag_name, tokenizer, hf_reference, caplog, prompts)


@pytest.mark.parametrize(
    "cpu_isa", ["+".join([tier.flag_name, *extensions]) for tier, extensions in EXTENDED_LIBRARIES] or ["none"]
)
def test_a_lower_tier_with_this_cpus_extensions_matches_transformers(
    cpu_isa: str, tokenizer: Any, hf_reference: list[GreedyRun], caplog: pytest.LogCaptureFixture
) -> None:
    """--cpu-isa avx2+avx_vnni / avx512+avx512_vnni: the kernels an Intel client core or a Cascade Lake / Ice Lake
    Xeon builds natively, the codes' GEMMs of more than one vector tile of rows through vpdpbusd
    (gemm_codes4_vnni.h), in the fused decoder."""
    if cpu_isa == "none":
        pytest.skip("this CPU has no extension above a lower tier (tests/conftest.py EXTENDED_LIBRARIES)")
    lines = _matches_transformers(cpu_isa, tokenizer, hf_reference, caplog, None)
    assert any("through vpdpbusd above one vector tile of rows" in line for line in lines), lines


def test_bfloat16_below_avx512_is_refused_with_the_way_out() -> None:
    with pytest.raises(ValueError, match="dtype bfloat16 on the CPU needs the avx512 ISA tier.*use dtype float32"):
        LLM(
            device="cpu",
            dtype="bfloat16",
            cpu_isa="generic",
            **SMALL_ENGINE,
        )


def _screened_and_exact_tokens(llm: LLM, gemm: Any, method: str) -> tuple[list[Any], list[Any], list[int]]:
    """Greedy tokens of 24 W1 prompts (cut to 16 tokens) through the LM head's screen, the kernel entry point
    ``method`` of ``gemm`` with its statuses recorded: (prompts, tokens, statuses)."""
    statuses: list[int] = []
    screened_argmax = getattr(gemm, method)

    def recording(*args: Any) -> Any:
        out, status = screened_argmax(*args)
        statuses.append(status)
        return out, status

    setattr(gemm, method, recording)
    prompts = [{"prompt_token_ids": r.prompt_token_ids[:16]} for r in load_w1(str(DEFAULT_W1_PATH), 24, 32)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    try:
        screened = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        delattr(gemm, method)
    return prompts, screened, statuses


def _tokens(llm: LLM, prompts: list[Any]) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _native_plan_screens_in_int8() -> bool:
    return load_cpu_kernels(native_tier(), torch.float32).plan.lm_head_argmax == "folio_int8_screen"


def test_bf16_screened_lm_head_gives_the_float32_tokens() -> None:
    """Where the plan screens the float32 greedy LM head in bfloat16 (avx512_bf16; on a CPU whose own library has
    the int8 screen, which takes a head of 8-bit codes, the head kept in float32: cpu_compact_weights off), every
    greedy token of 24 W1 prompts is the one the float32 arg-max picks, and the screen did the work (status 0 at
    every step). The prompts are cut to their first 16 tokens: the screen runs on the decode steps, and the whole
    prompts' prefills were two thirds of the test's CPU."""
    llm = LLM(dtype="float32", cpu_compact_weights=not _native_plan_screens_in_int8(), **SMALL_ENGINE)
    model = llm.llm_engine.executor.worker.model
    if model.lm_head_screen is None:
        pytest.skip("no bfloat16 screen below the avx512_bf16 tier")
    prompts, screened, statuses = _screened_and_exact_tokens(llm, model.tied_lm_head_packed.gemm, "screened_argmax")
    assert statuses and set(statuses) == {0}, statuses
    model.lm_head_screen = None
    assert screened == _tokens(llm, prompts)
    assert_no_leaks(llm)


def _int8_screen_isa() -> str:
    """A --cpu-isa whose library has the int8 screen: this CPU's own (AVX512-VNNI without AMX) or, above an AMX
    tier, avx512+avx512_vnni's (tests/conftest.py EXTENDED_LIBRARIES); "none" where neither runs here."""
    if native_tier() >= IsaTier.AVX512 and _native_plan_screens_in_int8():
        return "auto"
    vnni = ["+".join([t.flag_name, *ext]) for t, ext in EXTENDED_LIBRARIES if "avx512_vnni" in ext]
    return vnni[0] if vnni else "none"


@pytest.mark.parametrize(("cpu_isa", "screen"), [("avx2", "int16"), (_int8_screen_isa(), "int8")])
def test_integer_screened_lm_head_gives_the_float32_tokens(cpu_isa: str, screen: str) -> None:
    """SmolLM2's Q8_0 LM head screened in int16 on the avx2 tier (which every CI machine runs) and in int8 where a
    library has vpdpbusd's screen: every greedy token of 24 W1 prompts is the one the codes' float32 arg-max picks,
    and the screen did the work (status 0 at every step), as above."""
    if cpu_isa == "none" or native_tier() < IsaTier.AVX2:
        pytest.skip(f"no library here has the {screen} screen")
    llm = LLM(dtype="float32", cpu_isa=cpu_isa, **SMALL_ENGINE)
    model = llm.llm_engine.executor.worker.model
    assert model.lm_head_codes8 is not None and model.lm_head_codes8_screened
    assert (model.lm_head_codes8.quads is not None) == (screen == "int8") and model.lm_head_screen is None
    gemm = model.tied_lm_head_packed.gemm
    prompts, screened, statuses = _screened_and_exact_tokens(llm, gemm, "argmax_codes8_screened")
    assert statuses and set(statuses) == {0}, statuses
    model.lm_head_codes8_screened = False
    assert screened == _tokens(llm, prompts)
    assert_no_leaks(llm)
