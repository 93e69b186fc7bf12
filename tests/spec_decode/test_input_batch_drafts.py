"""prepare_model_input with drafts: a request's query is its next token plus its drafts, and the k + 1 rows that
verify them come after the sampled and prompt-logprob rows, exactly."""

from __future__ import annotations

import torch

from folio.core.sched_output import CachedRequestData
from folio.sampling_params import SamplingParams
from folio.worker.input_batch import prepare_model_input
from folio.worker.request_state import CachedRequestState, RequestStates


def state(req_id: str, prompt: list[int], output: list[int], blocks: list[int], computed: int) -> CachedRequestState:
    return CachedRequestState(req_id, prompt, output, SamplingParams(temperature=0.0), blocks, computed)


def test_drafts_extend_the_query_and_get_verification_rows() -> None:
    a = state("a", [1, 2, 3], [4], [5, 6], 3)  # decode of token 4 at position 3 + drafts [7, 8] at 4, 5
    b = state("b", [9, 10], [11], [2], 2)  # plain decode: samples one row
    c = state("c", [12, 13, 14, 15, 16], [], [3, 4], 0)  # a prompt
    model_input = prepare_model_input([a, b, c], [3, 1, 5], 4, torch.device("cpu"), {"a": [7, 8]})
    assert model_input.input_ids.tolist() == [4, 7, 8, 11, 12, 13, 14, 15, 16]
    assert model_input.positions.tolist() == [3, 4, 5, 2, 0, 1, 2, 3, 4]
    assert model_input.attn.seq_lens_cpu == [6, 3, 5]
    # a's positions 4, 5 -> block 6 (index 1): slots 24, 25
    assert model_input.attn.slot_mapping.tolist()[:3] == [5 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1]
    assert model_input.sample_req_ids == ["b", "c"]
    assert model_input.logits_indices.tolist() == [3, 8, 0, 1, 2]  # b's row, c's last row, then a's 3 rows
    assert (model_input.spec_req_ids, model_input.spec_draft_token_ids) == (["a"], [[7, 8]])


def test_no_drafts_changes_nothing() -> None:
    a = state("a", [1, 2, 3], [4], [5], 3)
    model_input = prepare_model_input([a], [1], 4, torch.device("cpu"), {})
    assert (model_input.input_ids.tolist(), model_input.logits_indices.tolist()) == ([4], [0])
    assert (model_input.sample_req_ids, model_input.spec_req_ids) == (["a"], [])


def test_block_table_cut_before_new_blocks_are_appended() -> None:
    """After blocks of rejected drafts were freed, the scheduler's diff cuts the worker's table first."""
    states = RequestStates()
    states.states["a"] = state("a", [1, 2, 3], [4], [5, 6, 7, 8], 3)
    states.states["b"] = state("b", [9], [10], [2, 3], 1)
    diff = CachedRequestData(["a", "b"], [[9], [11]], [[], []], [7, 2], num_kept_block_ids={"a": 2})
    states.apply_diffs(diff)
    assert (states["a"].block_ids, states["b"].block_ids) == ([5, 6, 9], [2, 3, 11])


def test_token_array_follows_appended_outputs_across_growth() -> None:
    s = state("a", list(range(50)), [], [1], 50)
    assert s.token_array().tolist() == list(range(50))
    for step in range(40):  # 1-3 tokens a step, 129 tokens in the end: past the first buffer's 100 slots
        s.output_token_ids.extend([1000 + step] * (1 + step % 3))
        assert s.token_array().tolist() == s.prompt_token_ids + s.output_token_ids
    assert len(s.token_array()) == s.num_tokens == 129 and s.token_array().dtype.name == "int64"
