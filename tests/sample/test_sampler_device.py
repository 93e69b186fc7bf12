"""The same sampler code on CUDA (skipped without a GPU): deterministic steps match the CPU exactly, seeded rows
stay independent of the batch with device generators."""

from __future__ import annotations

import pytest
import torch

from folio.sample import Sampler, SamplingMetadata
from folio.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
V = 128


def build(params: list[SamplingParams], outputs: list[list[int]], device: torch.device) -> SamplingMetadata:
    gens = [None if p.seed is None else torch.Generator(device).manual_seed(p.seed) for p in params]
    prompts = [[1, 2, 3] for _ in params]
    return SamplingMetadata.build(params, prompts, outputs, gens, V, device)


def test_full_pipeline_matches_cpu() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(
            temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3, logprobs=3
        ),
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[4, 5, 6]),
        SamplingParams(temperature=0.0, bad_words_token_ids=[[int(logits[3].argmax())]], logprobs=0),
        SamplingParams(temperature=0.8, top_k=1, top_p=0.5, min_p=0.2, logprobs=2),
        SamplingParams(temperature=0.0, min_tokens=3, all_stop_token_ids={int(logits[5].argmax())}),
    ]
    outputs = [[1, 1, 9], [], [], [], [], [2]]
    cpu = Sampler()(logits, build(params, outputs, torch.device("cpu")))
    cuda = Sampler()(logits.cuda(), build(params, outputs, torch.device("cuda")))
    assert cuda.sampled_token_ids.cpu().tolist() == cpu.sampled_token_ids.tolist()
    assert cpu.logprobs is not None and cuda.logprobs is not None
    assert cuda.logprobs.token_ids.cpu().tolist() == cpu.logprobs.token_ids.tolist()
    assert torch.allclose(cuda.logprobs.logprobs.cpu(), cpu.logprobs.logprobs, atol=1e-5)
    assert cuda.logprobs.ranks.cpu().tolist() == cpu.logprobs.ranks.tolist()


def test_seeded_row_independent_on_cuda() -> None:
    device = torch.device("cuda")
    row_logits = torch.randn(V, device=device)
    seeded = SamplingParams(temperature=1.0, seed=3, top_p=0.9)

    def run(batch: list[SamplingParams], row: int) -> list[int]:
        gens = [None if p.seed is None else torch.Generator(device).manual_seed(p.seed) for p in batch]
        logits = torch.randn(len(batch), V, device=device)
        logits[row] = row_logits
        tokens: list[int] = []
        for _ in range(8):
            md = SamplingMetadata.build(batch, [[]] * len(batch), [[]] * len(batch), gens, V, device)
            tokens.append(int(Sampler()(logits, md).sampled_token_ids[row].item()))
        return tokens

    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, seed=9), SamplingParams(temperature=0)]
    alone = run([seeded], 0)
    assert alone == run([others[0], seeded, others[1], others[2]], 1) == run([others[2], others[1], seeded], 2)
    assert len(set(alone)) > 1
