"""The CUDA path (skipped without a GPU): dtype auto, KV sizing by profiling, and the engine's answers.

In bfloat16 the answers are held to the project's rule against transformers in float32 (identical greedy tokens,
or each side's token in the other's top-5 at the first divergence), not to exact text: on an H200, a one-ulp
difference in one attention output (the Triton kernel against torch's SDPA, both within bf16 rounding of the
float32 reference) flipped the first token of the capital-of-France chat, a near-tie in bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from folio import LLM, SamplingParams
from folio.attention.backends.triton_paged import TritonPagedBackend
from folio.worker.worker import profile_prefill_lens
from tests.engine.conftest import assert_no_leaks, greedy_verdicts
from tests.engine.greedy_compare import GreedyRun

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_auto_dtype_and_profiled_kv_cache_on_cuda(tokenizer: object, hf_reference: list[GreedyRun]) -> None:
    llm = LLM(device="cuda", gpu_memory_utilization=0.3, max_model_len=4096)
    worker = llm.llm_engine.executor.worker
    assert worker.device.type == "cuda"
    assert worker.dtype == torch.bfloat16  # auto: the GGUF dequantizes to float32 -> bfloat16 on CUDA
    assert isinstance(worker.model.attn_backend, TritonPagedBackend)
    num_blocks = llm.llm_engine.config.cache_config.num_blocks
    _free, total = torch.cuda.mem_get_info()
    assert num_blocks * worker.kv_shape.bytes_per_block <= 0.3 * total
    assert num_blocks * 16 >= 4096
    verdicts = greedy_verdicts(llm, tokenizer, hf_reference)
    print("bfloat16 on CUDA vs transformers float32:", verdicts)
    assert verdicts.count("identical") >= 3, verdicts  # 5 and 6 of 11 in the H200 runs (docs/performance.md)
    seeded = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    first = llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0]
    again = llm.generate(
        ["Once upon a time", "Hello"], [seeded, SamplingParams(temperature=1.0, max_tokens=12)], use_tqdm=False
    )[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert_no_leaks(llm)


def test_profile_run_on_any_device(make_llm: Callable[..., LLM]) -> None:
    """The memory-profiling forward that sizes the KV cache on CUDA is device-agnostic: run it here too, and check
    what it produces: the model's logits for the last max_num_seqs of max_num_batched_tokens tokens, split into
    prefills of up to max_model_len, computed on a scratch cache that leaves the engine's KV cache as it was."""
    assert (profile_prefill_lens(300, 128), profile_prefill_lens(100, 128)) == ([128, 128, 44], [100])
    llm = make_llm(max_model_len=128, max_num_batched_tokens=300, max_num_seqs=64, num_gpu_blocks_override=32)
    worker = llm.llm_engine.executor.worker
    kv_before = [cache.clone() for cache in worker.model_runner.kv_caches]

    logits = worker._profile_run()  # prefills of 128, 128 and 44 times token 0; logits of the last 64 tokens

    assert logits.shape == (64, worker.spec.vocab_size) and logits.dtype == torch.float32
    kv_after = worker.model_runner.kv_caches
    assert all(torch.equal(after, before) for after, before in zip(kv_after, kv_before, strict=True)), (
        "the profile run wrote the KV cache"
    )
    # Every position holds token 0, so every position attends to equal values: each row is the model's
    # prediction after the one-token prompt [0], which the engine's own forward gives as its top-5 logprobs.
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    (step,) = llm.generate([{"prompt_token_ids": [0]}], params, use_tqdm=False)[0].outputs[0].logprobs or []
    top5 = sorted(step.items(), key=lambda item: -item[1].logprob)[:5]
    for row in torch.log_softmax(logits, dim=-1):
        values, token_ids = row.topk(5)
        assert token_ids.tolist() == [token_id for token_id, _ in top5]
        torch.testing.assert_close(values.cpu(), torch.tensor([lp.logprob for _, lp in top5]), rtol=0, atol=1e-3)
    assert_no_leaks(llm)
