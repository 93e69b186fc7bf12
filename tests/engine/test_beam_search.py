"""LLM.beam_search on the real default model: transformers' beam search finds the same sequences on the same
weights, the beams share their prefix's KV blocks through the prefix cache, and bad input is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from folio import LLM, BeamSearchParams
from tests.engine.prompts import all_prompt_token_ids

WIDTH = 4
MAX_TOKENS = 12
EOS = 2  # the default model's (transformers' generation_config says the same)


@torch.inference_mode()
def hf_beam_search(hf_model: Any, prompt: list[int], num_return: int) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search with the flags whose stopping is Folio's: early_stopping="never" (stop only when no
    live beam can still win; Folio's early stop uses the same exact bound), the EOS ending a hypothesis."""
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=WIDTH,
        do_sample=False,
        num_return_sequences=num_return,
        length_penalty=1.0,
        early_stopping="never",
        max_new_tokens=MAX_TOKENS,
        eos_token_id=EOS,
        pad_token_id=EOS,
        output_scores=True,
        return_dict_in_generate=True,
    )
    sequences = []
    for seq in out.sequences:
        tokens = seq[len(prompt) :].tolist()
        sequences.append(tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens)  # drop the padding
    return sequences, out.sequences_scores.tolist()


@torch.inference_mode()
def hf_score(hf_model: Any, prompt: list[int], output: list[int]) -> float:
    """transformers' length-penalised score (penalty 1) of ``output`` after ``prompt``, teacher-forced."""
    logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(output).unsqueeze(1))
    return float(logprobs.sum()) / len(output)


def test_same_sequences_as_transformers(llm: LLM, hf_model: Any, tokenizer: Any) -> None:
    """8 prompts (6 plain, 2 chat-templated, which end in EOS): the top sequence is transformers', or, where float
    noise flips a near-tie, transformers scores Folio's winner within 1e-4 of its own. The 196-token story is left
    out: transformers prefills every prompt once per beam, and that one prompt took a third of the test's CPU."""
    prompts = all_prompt_token_ids(tokenizer)
    prompts = prompts[:5] + prompts[6:7] + prompts[-2:]
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(WIDTH, MAX_TOKENS))
    verdicts = []
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        assert len(result.sequences) == WIDTH
        top = result.sequences[0]
        hf_sequences, hf_scores = hf_beam_search(hf_model, prompt, num_return=WIDTH)
        if top.output_token_ids == hf_sequences[0]:
            verdicts.append("identical" if [s.output_token_ids for s in result.sequences] == hf_sequences else "top")
            assert top.cum_logprob / len(top.output_token_ids) == pytest.approx(hf_scores[0], abs=1e-4), i
        else:
            verdicts.append("near-tie")
            assert hf_score(hf_model, prompt, top.output_token_ids) == pytest.approx(hf_scores[0], abs=1e-4), i
        assert top.tokens == prompt + top.output_token_ids
        assert top.text == tokenizer.decode(top.tokens)
    print(f"beam search vs transformers (width {WIDTH}, {MAX_TOKENS} tokens): {verdicts}")
    finished_by_eos = [seq.finish_reason == "stop" for result in results for seq in result.sequences]
    assert any(finished_by_eos) and not all(finished_by_eos)  # both endings were compared
    assert verdicts.count("identical") >= 6


def test_beams_share_the_prefix_blocks(llm: LLM, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's beams hit the prefix cache for every full block before their last token (exact counts), and
    once scheduled, the WIDTH beams of a step hold the prompt's first block together (ref count WIDTH) and fewer
    blocks than their block lists name: the prefix's blocks are shared, not copied."""
    prompt = tokenizer.encode("A prompt used by this test only: " + "the quick brown fox jumps over the lazy dog " * 5)
    block_size = llm.llm_engine.config.cache_config.block_size
    manager = llm.llm_engine.kv_cache_manager
    queries, hits = manager.prefix_cache_queries, manager.prefix_cache_hits
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule
    seen: list[tuple[int, int, int]] = []  # per schedule(): (ref count of block 0, block-list entries, blocks used)

    def watched_schedule() -> Any:
        output = schedule()
        lists = list(manager.req_to_blocks.values())
        first_refs = max((blocks[0].ref_count for blocks in lists if blocks), default=0)
        seen.append((first_refs, sum(len(blocks) for blocks in lists), manager.num_used_blocks))
        return output

    monkeypatch.setattr(scheduler, "schedule", watched_schedule)
    params = BeamSearchParams(WIDTH, max_tokens=8, ignore_eos=True)  # no EOS: every step runs WIDTH beams
    [result] = llm.beam_search({"prompt_token_ids": prompt}, params)
    assert len(result.sequences) == WIDTH and all(len(s.output_token_ids) == 8 for s in result.sequences)
    # Step 1 runs the prompt (a miss: no earlier request had it); step s > 1 runs WIDTH beams of len(prompt) + s - 1
    # tokens, each finding its full blocks before the last token cached by its ancestors.
    lengths = [len(prompt) + s - 1 for s in range(2, params.max_tokens + 1) for _ in range(WIDTH)]
    expected_hits = sum((length - 1) // block_size * block_size for length in lengths)
    assert manager.prefix_cache_queries - queries == len(prompt) + sum(lengths)
    assert manager.prefix_cache_hits - hits == expected_hits
    hit_rate = expected_hits / (len(prompt) + sum(lengths))
    print(f"prefix-cache hit rate during the search: {hit_rate:.1%} ({len(prompt)}-token prompt, block {block_size})")
    shared_steps = [(refs, named, used) for refs, named, used in seen if refs == WIDTH]
    assert len(shared_steps) == params.max_tokens - 1
    # Each beam names its len // block_size + 1 blocks; all but the last partial one are the shared ones.
    for _, named, used in shared_steps:
        assert used < named


def test_bad_input_is_refused(llm: LLM, make_llm: Callable[..., LLM]) -> None:
    max_model_len = llm.llm_engine.config.scheduler_config.max_model_len
    with pytest.raises(ValueError, match=f"^max_tokens {max_model_len} plus the prompt's 2 tokens exceeds"):
        llm.beam_search([[1, 2]], BeamSearchParams(2, max_tokens=max_model_len))
    with pytest.raises(ValueError, match="^beam_width must be an integer in"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    no_cache = make_llm(enable_prefix_caching=False, max_model_len=256)
    with pytest.raises(ValueError, match=r"beam search needs prefix caching \(enable_prefix_caching=True\)"):
        no_cache.beam_search("Hello", BeamSearchParams(2, max_tokens=4))
