"""The default model's float32 weights kept as their 4-bit codes (cpu_compact_weights, folio/kernels/gemm_codes4.h):
the same tokens and the same logprobs, bit for bit, as the float32 layout, through the fused decoder and layer by
layer, greedy and seeded; and the tied Q8_0 LM head's greedy arg-max over its 8-bit codes, the same tokens.
On the amx tier the codes' steps of more than 8 rows run on AMX (cpu_amx_float32, gemm_codes4_amx.h), in a native
library with AVX512-VNNI and without AMX through vpdpbusd (cpu_vnni_float32, gemm_codes4_vnni.h): float32 accuracy,
not the float32 layout's bits, so there the default engine is held to the float32 layout's greedy tokens (or the
top-5 rule at a divergence) and logprobs within float32 noise, and the same engine without them to its bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from folio import LLM, SamplingParams
from folio.kernels.cpu_gemm import PackedWeight
from folio.model.layers.linear import Linear
from tests.engine.greedy_compare import GreedyRun, compare_greedy
from tests.engine.prompts import all_prompt_token_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=5)


def _packed_linears(llm: LLM) -> list[PackedWeight]:
    model = llm.llm_engine.executor.worker.model_runner.model
    return [m.packed_weight for m in model.modules() if isinstance(m, Linear)]


def _outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [GREEDY] * (len(prompts) - 1) + [SEEDED]
    runs = []
    for out in llm.generate(requests, params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        runs.append(
            (list(completion.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs])
        )
    return runs


def _greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy without logprobs: the LM head's arg-max path (8-bit codes for the tied Q8_0 head), not the logits."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def _assert_float32_close(
    reference: list[tuple[list[int], list[dict[int, float]]]], runs: list[tuple[list[int], list[dict[int, float]]]]
) -> None:
    """Each greedy run (all but the last, seeded, one) the reference's tokens, or diverging where each side's token
    is in the other's top 5; logprobs within 1e-3 of the reference's while the tokens agree."""
    for i, ((want_tokens, want_lps), (tokens, lps)) in enumerate(zip(reference[:-1], runs[:-1], strict=True)):
        want = GreedyRun(want_tokens, [set(step) for step in want_lps])
        verdict = compare_greedy(want, GreedyRun(tokens, [set(step) for step in lps]), f"prompt {i}")
        agreed = len(tokens) if verdict == "identical" else int(verdict.split("@")[1])
        for step in range(agreed):
            for token, logprob in lps[step].items():
                if token in want_lps[step]:
                    assert abs(logprob - want_lps[step][token]) < 1e-3, (i, step, token)


def test_codes_give_the_float32_engines_outputs(llm: LLM, make_llm: Callable[..., LLM], tokenizer: Any) -> None:
    packed = _packed_linears(llm)
    if not all(isinstance(p, PackedWeight) for p in packed):
        pytest.skip("this CPU's float32 plan packs with oneDNN: no codes")
    assert all(p.codes4 for p in packed), "every projection of the Q4_1 GGUF is exactly 4-bit codes"
    prompts = all_prompt_token_ids(tokenizer)[:4]
    compact = _outputs(llm, prompts)
    one_by_one = [_greedy_tokens(llm, [p])[0] for p in prompts[:2]]  # one row: the codes' arg-max
    assert llm.llm_engine.executor.worker.model_runner.model.lm_head_codes8 is not None

    float32 = make_llm(cpu_compact_weights=False)
    assert not any(p.codes4 for p in _packed_linears(float32))
    float32_outputs = _outputs(float32, prompts)
    assert [_greedy_tokens(float32, [p])[0] for p in prompts[:2]] == one_by_one  # one row: never on AMX

    layer_by_layer = make_llm(enforce_eager=True)  # the codes through the per-layer GEMM calls, not the fused decoder
    assert all(p.codes4 for p in _packed_linears(layer_by_layer))
    layer_outputs = _outputs(layer_by_layer, prompts)
    if not any(p.codes4_amx or p.codes4_vnni for p in packed):
        assert layer_outputs == compact
        assert float32_outputs == compact
        return
    # above 8 rows on AMX or through vpdpbusd: the fused decoder runs its last layer past attention over only the
    # rows that need logits (8 or fewer here: the FMA tiles) where the layer-by-layer run takes every row
    _assert_float32_close(compact, layer_outputs)
    _assert_float32_close(float32_outputs, compact)
    on_fma_tiles = make_llm(cpu_amx_float32=False, cpu_vnni_float32=False)
    assert not any(p.codes4_amx or p.codes4_vnni for p in _packed_linears(on_fma_tiles))
    assert _outputs(on_fma_tiles, prompts) == float32_outputs
