"""cpu_huge_pages: the packed weights, the LM head's screen and the KV cache are advised to 2 MiB pages by default
and advised against them when it is off (the mapping's VmFlags in /proc/self/smaps: "hg", "nh"), and the tokens
are the same either way."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from folio import LLM, SamplingParams
from folio.cli import build_parser, engine_args_from
from folio.kernels.hugepages import _HUGE_PAGE, _madvise, empty_hugepage_backed, slow_first_touch_hint

needs_madvise = pytest.mark.skipif(_madvise() is None, reason="no madvise here (not Linux): the advice is a no-op")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address`` ("hg": advised to huge pages, "nh": not)."""
    holds = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                holds = start <= address < end
            elif holds and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_madvise
@pytest.mark.parametrize("huge_pages", [True, False])
def test_an_arena_is_advised_to_huge_pages_only_when_asked(huge_pages: bool) -> None:
    """Also where the memory is the heap's again, advised the other way before (a small tensor's, below glibc's
    mmap threshold: the first run of this test failed there, finding "hg" on an arena asked to have none)."""
    for advice in (not huge_pages, huge_pages):
        arena = empty_hugepage_backed(3 * _HUGE_PAGE // 4, torch.float32, advice)  # 1.5 huge pages of floats
        assert arena.data_ptr() % _HUGE_PAGE == 0
        flags = vm_flags(arena.data_ptr())
        assert ("hg" in flags, "nh" in flags) == (advice, not advice)
        del arena


@needs_madvise
def test_the_engine_argument_places_weights_and_cache_and_keeps_the_tokens(make_llm: Callable[..., LLM]) -> None:
    prompts = [{"prompt_token_ids": [1, 504, 3458, 282, 4649, 314]}, {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for huge_pages in (True, False):
        llm = make_llm(cpu_huge_pages=huge_pages)
        worker = llm.llm_engine.executor.worker
        if worker.device.type != "cpu" or worker.cpu_kernels is None or worker.cpu_kernels.gemm is None:
            pytest.skip("Folio's CPU GEMM packs the weights only on the CPU, where the plan chose it")
        model = worker.model
        placed = {
            "packed weights": model.model.layers[0].self_attn.qkv_proj.packed_weight.data.data_ptr(),
            "KV cache": worker.model_runner.kv_caches[0].data_ptr(),
        }
        if model.lm_head_screen is not None:
            placed["LM head screen"] = model.lm_head_screen.packed.data.data_ptr()
        advised = {name: ("hg" in vm_flags(at), "nh" in vm_flags(at)) for name, at in placed.items()}
        assert advised == dict.fromkeys(placed, (huge_pages, not huge_pages))
        tokens[huge_pages] = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
        del llm, worker, model
    assert tokens[True] == tokens[False]


def test_the_flag_reaches_the_cpu_config() -> None:
    def huge_pages(*argv: str) -> bool:
        args = engine_args_from(build_parser().parse_args(["serve", *argv]))
        return args.create_engine_config("m", 64).cpu_config.huge_pages

    assert huge_pages() is True
    assert huge_pages("--no-cpu-huge-pages") is False
    assert huge_pages("--cpu-huge-pages") is True


def test_a_slow_first_touch_names_the_flag_and_a_quick_one_says_nothing() -> None:
    hint = slow_first_touch_hint("KV cache", 4 * 2**30, 16.0)
    assert hint is not None
    assert hint.startswith("KV cache: 4.00 GiB faulted in on 2 MiB pages in 16.0 s (0.25 GiB/s)")
    assert "--no-cpu-huge-pages" in hint and "cpu_huge_pages=False" in hint
    assert slow_first_touch_hint("KV cache", 4 * 2**30, 2.5) is None  # 1.6 GiB/s: not slow
    assert slow_first_touch_hint("KV cache", 2**30, 1.9) is None  # slow, but under 2 s: not worth a line
