"""Sampler pipeline: each step on random logits with exact expected outcomes where the math gives them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from folio.sample import Sampler, SamplingMetadata
from folio.sample.sampler import apply_min_p, apply_top_k_top_p
from folio.sampling_params import SamplingParams

V = 64
CPU = torch.device("cpu")


def build(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    vocab_size: int = V,
) -> SamplingMetadata:
    """Metadata for the rows; a generator seeded with SamplingParams.seed for each seeded row."""
    gens = [None if p.seed is None else torch.Generator(CPU).manual_seed(p.seed) for p in params]
    return SamplingMetadata.build(
        params,
        prompts or [[] for _ in params],
        outputs or [[] for _ in params],
        gens,
        vocab_size,
        CPU,
    )


def rand_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def sample(logits: torch.Tensor, params: list[SamplingParams], **kw: Any) -> list[int]:
    return [int(t) for t in Sampler()(logits, build(params, **kw)).sampled_token_ids.tolist()]


def test_all_greedy_is_argmax_and_metadata_is_minimal() -> None:
    logits = rand_logits(5)
    md = build([SamplingParams(temperature=0.0) for _ in range(5)])
    assert md.all_greedy and not md.all_random
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.no_penalties
    assert md.logit_bias is None and md.disallowed_token_mask is None and md.max_num_logprobs is None
    assert md.generators == {}
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, True),
        ({"logprobs": 2}, False),
        ({"repetition_penalty": 1.2}, False),
        ({"logit_bias": {3: 1.0}}, False),
        ({"allowed_token_ids": [1, 2]}, False),
        ({"bad_words_token_ids": [[5]]}, False),
        ({"min_tokens": 2, "stop_token_ids": [7]}, False),
        ({"temperature": 0.7}, False),
    ],
)
def test_only_argmax_exactly_when_nothing_but_the_argmax_matters(extra: dict[str, Any], expected: bool) -> None:
    # the model may then hand over token ids instead of logits (LlamaForCausalLM.compute_greedy_token_ids)
    params = {"temperature": 0.0, **extra}
    bad_words = params.pop("bad_words_token_ids", None)
    row = SamplingParams(**params)
    if bad_words is not None:
        row.bad_words_token_ids = bad_words
    md = build([SamplingParams(temperature=0.0), row])
    assert Sampler.only_argmax(md) is expected


def test_top_k_1_and_tiny_top_p_are_argmax() -> None:
    logits = rand_logits(8, seed=1)
    expected = logits.argmax(-1).tolist()
    for _ in range(5):
        assert sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8) == expected
        assert sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 8) == expected
        assert sample(logits, [SamplingParams(temperature=1.5, top_k=3, top_p=1e-6)] * 8) == expected


def test_vocab_size_mismatch_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.zeros(1, V + 1), build([SamplingParams(temperature=0.0)]))


def test_input_logits_not_modified() -> None:
    logits = rand_logits(3)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3, logit_bias={1: 5.0}),
        SamplingParams(temperature=0.0, presence_penalty=1.0, allowed_token_ids=[1, 2, 3]),
        SamplingParams(temperature=1.0, logprobs=2),
    ]
    Sampler()(logits, build(params, outputs=[[1], [2], [3]], prompts=[[4], [5], [6]]))
    assert torch.equal(logits, before)


def test_top_k_mask_keeps_exactly_k() -> None:
    logits = rand_logits(3, seed=2)
    out = apply_top_k_top_p(logits.clone(), torch.tensor([1, 5, V]), None)
    kept = torch.isfinite(out).sum(-1).tolist()
    assert kept == [1, 5, V]
    top5 = set(logits[1].topk(5).indices.tolist())
    assert set(torch.isfinite(out[1]).nonzero().flatten().tolist()) == top5


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for p, expected_kept in [(0.4, 1), (0.6, 2), (0.75, 2), (0.85, 3), (0.97, 4), (1.0, 4)]:
        out = apply_top_k_top_p(logits.clone(), None, torch.tensor([p]))
        assert torch.isfinite(out).sum().item() == expected_kept, p


def test_min_p_masks_below_fraction_of_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.5, 0.0]))
    # 0.5 * 0.5 = 0.25: keeps 0.5 and 0.3 only; min_p 0 keeps all
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [True, True, True, True]]
    params = [SamplingParams(temperature=1.0, min_p=0.5)]
    picks = {sample(logits[:1].clone(), params, vocab_size=4)[0] for _ in range(200)}
    assert picks == {0, 1}


def test_temperature_statistics() -> None:
    torch.manual_seed(1234)
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(4000, 1)
    sampler = Sampler()

    def freqs(temp: float) -> list[float]:
        ids = sampler(logits, build([SamplingParams(temperature=temp)] * 4000, vocab_size=3)).sampled_token_ids
        return (torch.bincount(ids, minlength=3).float() / 4000).tolist()

    f1 = freqs(1.0)
    assert f1 == pytest.approx([0.6, 0.3, 0.1], abs=0.03)
    sharp = freqs(0.25)  # p^4 renormalized: [0.9408, 0.0588, 0.0007]
    assert sharp[0] == pytest.approx(0.9408, abs=0.02)
    flat = freqs(100.0)  # nearly uniform
    assert flat == pytest.approx([1 / 3] * 3, abs=0.04)


def test_seeded_row_independent_of_batch_and_row_index() -> None:
    row_logits = rand_logits(1, seed=7)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(batch_params: list[SamplingParams], row: int, steps: int = 6) -> list[int]:
        gens = [None if p.seed is None else torch.Generator(CPU).manual_seed(p.seed) for p in batch_params]
        logits = rand_logits(len(batch_params), seed=99)
        logits[row] = row_logits[0]
        tokens: list[int] = []
        for _ in range(steps):
            md = SamplingMetadata.build(batch_params, [[]] * len(batch_params), [[]] * len(batch_params), gens, V, CPU)
            tokens.append(int(Sampler()(logits, md).sampled_token_ids[row].item()))
        return tokens

    alone = run([seeded], 0)
    others = [SamplingParams(temperature=0.9), SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0)]
    mixed = run([others[0], others[1], seeded, others[2]], 2)
    mixed_other_index = run([others[2], seeded, others[0]], 1)
    assert alone == mixed == mixed_other_index
    assert len(set(alone)) > 1  # it really samples


def test_mixed_greedy_and_random_rows() -> None:
    logits = rand_logits(4, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)] * 2
    md = build(params)
    assert not md.all_greedy and not md.all_random
    assert sample(logits, params) == logits.argmax(-1).tolist()


def test_repetition_penalty_formula() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    md = build(params, prompts=[[0]], outputs=[[1]], vocab_size=5)
    out = Sampler().process_logits(logits, md)
    # seen (prompt or output): 0 -> 2/2, 1 -> -2*2; unseen untouched
    assert out.tolist() == [[1.0, -4.0, 3.0, -1.0, 0.5]]


def test_frequency_and_presence_penalty_formula() -> None:
    logits = torch.zeros(1, 5)
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)]
    # prompt tokens do not count for frequency / presence
    md = build(params, prompts=[[4, 4]], outputs=[[1, 1, 1, 2]], vocab_size=5)
    out = Sampler().process_logits(logits, md)
    assert out.tolist() == [[0.0, -1.75, -0.75, 0.0, 0.0]]


def test_penalties_only_on_rows_that_ask() -> None:
    logits = torch.ones(2, 5)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0)]
    md = build(params, prompts=[[0], [0]], outputs=[[1], [1]], vocab_size=5)
    out = Sampler().process_logits(logits, md)
    assert out.tolist() == [[0.5, 0.5, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0, 0.0]])
    md = build([SamplingParams(temperature=0.0, presence_penalty=0.2)], outputs=[[0]], vocab_size=4)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1]


def test_logit_bias_forces_token() -> None:
    logits = rand_logits(2, seed=4)
    params = [
        SamplingParams(temperature=0.0, logit_bias={17: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={3: 100}),
    ]
    assert sample(logits, params) == [17, 3]
    md = build([SamplingParams(temperature=0.0, logit_bias={5: -2.5})])
    out = Sampler().process_logits(logits[:1], md)
    assert out[0, 5].item() == pytest.approx(logits[0, 5].item() - 2.5)


def test_allowed_token_ids_restrict() -> None:
    logits = rand_logits(2, seed=5)
    allowed = [3, 9, 11]
    params = [SamplingParams(temperature=1.0, allowed_token_ids=allowed), SamplingParams(temperature=0.0)]
    for _ in range(30):
        tokens = sample(logits, params)
        assert tokens[0] in allowed
        assert tokens[1] == logits[1].argmax().item()
    greedy = sample(logits[:1], [SamplingParams(temperature=0.0, allowed_token_ids=allowed)])
    assert greedy == [allowed[int(logits[0, allowed].argmax())]]


def test_bad_words() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 7] = 5.0
    logits[:, 8] = 4.0
    single = SamplingParams(temperature=0.0, bad_words_token_ids=[[7]])
    multi = SamplingParams(temperature=0.0, bad_words_token_ids=[[2, 3, 7]])
    # single-token bad word always banned; [2, 3, 7] bans 7 only after output ends with [2, 3]
    tokens = sample(logits, [single, multi, multi], outputs=[[], [1, 2, 3], [2, 3, 1]], vocab_size=10)
    assert tokens == [8, 8, 7]
    assert sample(logits[:1], [multi], outputs=[[3]], vocab_size=10) == [7]  # too short for the prefix


def test_min_tokens_blocks_stop_ids_then_allows() -> None:
    eos = 5
    logits = torch.zeros(1, 10)
    logits[0, eos] = 10.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6], all_stop_token_ids={eos})
    assert params.all_stop_token_ids == {5, 6}
    output: list[int] = []
    md = build([params], outputs=[output], vocab_size=10)
    first = int(Sampler()(logits, md).sampled_token_ids.item())
    assert first not in (5, 6)
    output.append(first)  # metadata holds the live list
    assert Sampler()(logits, md).sampled_token_ids.item() != eos
    output.append(1)
    assert Sampler()(logits, md).sampled_token_ids.item() == eos


def test_logprobs_shapes_values_and_ranks() -> None:
    logits = rand_logits(3, seed=6)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, logit_bias={0: 100.0}, logprobs=1),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, build(params))
    assert out.logprobs is not None
    lp = out.logprobs
    assert lp.token_ids.shape == (3, 4) and lp.logprobs.shape == (3, 4) and lp.ranks.shape == (3,)
    ref = torch.log_softmax(logits, dim=-1)  # raw: before logit_bias
    assert lp.token_ids[:, 0].tolist() == out.sampled_token_ids.tolist()
    assert torch.allclose(lp.logprobs, ref.gather(1, lp.token_ids))
    assert lp.token_ids[:, 1:].tolist() == ref.topk(3).indices.tolist()
    assert lp.ranks[0].item() == 1  # greedy pick is the most likely
    assert lp.ranks[1].item() == 1 + int((ref[1] > ref[1, 0]).sum())  # biased pick: rank in the raw distribution
    # One row per request, cut to its own k: the chosen token + its top-k, the chosen token's rank; None for none.
    rows = lp.split_rows([3, 1, None])
    assert rows[2] is None
    assert rows[0] is not None and rows[1] is not None
    assert rows[0].token_ids == [lp.token_ids[0].tolist()] and rows[0].logprobs == [lp.logprobs[0].tolist()]
    assert rows[1].token_ids == [[0, lp.token_ids[1, 1].item()]]
    assert rows[1].logprobs == [lp.logprobs[1, :2].tolist()]
    assert (rows[0].ranks, rows[1].ranks) == ([1], [lp.ranks[1].item()])
    lists = lp.tolists()
    assert lists.ranks == lp.ranks.tolist() and len(lists.token_ids) == 3


def test_logprobs_zero_gives_only_chosen() -> None:
    out = Sampler()(rand_logits(2), build([SamplingParams(temperature=0.0, logprobs=0)] * 2))
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (2, 1)
