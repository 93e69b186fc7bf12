"""The multi-turn chat workload (issue 18): the dataset builder's exact prompts (no model), the recompute counter
over hand-written scheduler outputs, the two arrival patterns on a tiny real engine, and one small real
`folio bench throughput --compare-offloading` run."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from folio import LLM
from folio.bench.datasets import add_dataset_args, requests_from_args, sample_multi_turn
from folio.bench.multi_turn import ComputeCounter, run_multi_turn
from folio.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from folio.sampling_params import SamplingParams
from tests.server.conftest import folio_script
from tests.tiny_models import TINY_SHAPE, save_tiny_llama


def test_turn_prompts_are_the_history_plus_the_new_message() -> None:
    workload = sample_multi_turn(3, 4, system_len=8, user_len=5, output_len=2, vocab_size=50, seed=3, special_ids=[0])
    again = sample_multi_turn(3, 4, system_len=8, user_len=5, output_len=2, vocab_size=50, seed=3, special_ids=[0])
    assert workload == again  # seeded
    assert len(workload.system_prompt) == 8 and workload.num_turns == 4 and workload.output_len == 2
    users = workload.user_turns
    assert all(len(u) == 5 and 0 not in u for conv in users for u in conv)
    assert len({tuple(u) for conv in users for u in conv}) == 12  # every user message its own
    replies = [[100, 101], [102, 103]]
    assert workload.turn_prompt(1, 0, []) == workload.system_prompt + users[1][0]
    assert workload.turn_prompt(1, 2, replies) == (
        workload.system_prompt + users[1][0] + [100, 101] + users[1][1] + [102, 103] + users[1][2]
    )
    with pytest.raises(ValueError, match="turn 2 needs the 2 earlier replies, got 1"):
        workload.turn_prompt(1, 2, replies[:1])
    default = sample_multi_turn(32, 4, 512, 256, 64, vocab_size=1000, seed=0)
    assert default.working_set_tokens() == 512 + 32 * 4 * (256 + 64)
    last = default.turn_prompt(0, 3, [[1] * 64] * 3)
    assert len(last) == 512 + 3 * (256 + 64) + 256


def test_multi_turn_is_refused_where_turns_cannot_wait_for_outputs() -> None:
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    ns = parser.parse_args(["--dataset-name", "multi_turn"])
    assert (ns.multi_turn_num_conversations, ns.multi_turn_num_turns) == (32, 4)
    assert (ns.multi_turn_system_len, ns.multi_turn_user_len, ns.multi_turn_output_len) == (512, 256, 64)
    with pytest.raises(ValueError, match="multi_turn runs only in `folio bench throughput`"):
        requests_from_args(ns, vocab_size=100)


class _Inner:
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(list(sched.num_scheduled_tokens), [], [])


def _new(req_id: str, computed: int) -> NewRequestData:
    return NewRequestData(req_id, [1] * 10, [], SamplingParams(), [0], computed)


def _step(new: list[NewRequestData], cached: CachedRequestData, tokens: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(new, cached, tokens, sum(tokens.values()), set(), set())


def test_compute_counter_counts_tokens_computed_again() -> None:
    """'a' prefills 10, decodes 1, is preempted and recomputed from 4 (a prefix hit) to 11: 7 computed again;
    'b' resumes where it stopped (as a swap would): nothing computed again."""
    counter = ComputeCounter(_Inner())
    counter.execute_model(_step([_new("a", 0), _new("b", 0)], CachedRequestData(), {"a": 10, "b": 10}))
    counter.execute_model(_step([], CachedRequestData(["a", "b"], [[], []], [[], []], [10, 10]), {"a": 1, "b": 1}))
    counter.execute_model(_step([_new("a", 4), _new("b", 11)], CachedRequestData(), {"a": 7, "b": 1}))
    assert counter.forwarded == 10 + 10 + 1 + 1 + 7 + 1
    assert counter.recomputed == 7


def test_closed_loop_sends_a_conversations_next_turn_as_its_reply_finishes(tmp_path: Path) -> None:
    """3 conversations x 2 turns, 2 requests at a time: closed-loop, a conversation's turn 1 joins while another's
    turn 0 is still in the engine; in waves, only once every turn 0 has finished. Same replies either way."""
    llm = LLM(save_tiny_llama(tmp_path), device="cpu", dtype="float32", kv_cache_memory_bytes=2**22, max_num_seqs=2)
    workload = sample_multi_turn(
        3, 2, system_len=16, user_len=8, output_len=4, vocab_size=TINY_SHAPE["vocab_size"], seed=0
    )
    engine = llm.llm_engine
    original_add, original_step = engine.add_request, engine.step
    open_first_turns: set[str] = set()  # turn-0 requests added and not finished
    turn_1_beside_a_first_turn: list[bool] = []  # per turn-1 request added: was a turn-0 request still open?

    def logging_add(request_id: str, prompt: Any, *args: Any) -> Any:
        length = len(prompt["prompt_token_ids"])
        if length == 16 + 8:
            open_first_turns.add(request_id)
        elif length == 16 + 8 + 4 + 8:
            turn_1_beside_a_first_turn.append(bool(open_first_turns))
        return original_add(request_id, prompt, *args)

    def logging_step() -> Any:
        outputs = original_step()
        open_first_turns.difference_update(out.request_id for out in outputs if out.finished)
        return outputs

    engine.add_request, engine.step = logging_add, logging_step
    runs = {}
    for arrival in ("waves", "closed-loop"):
        turn_1_beside_a_first_turn.clear()
        runs[arrival] = run_multi_turn(llm, workload, arrival, arrival)
        seen = turn_1_beside_a_first_turn
        assert len(seen) == 3 and any(seen) == (arrival == "closed-loop"), (arrival, seen)
    waves, closed = runs["waves"], runs["closed-loop"]
    assert closed.replies == waves.replies and all(len(turns) == 2 for turns in closed.replies)
    assert closed.prompt_tokens == waves.prompt_tokens == 3 * (24 + 36) and len(closed.ttfts_s) == 6


def test_compare_offloading_runs_end_to_end(tmp_path: Path) -> None:
    """4 conversations x 2 turns on a 12-block pool (a wave's first turns share the system prompt's 4 blocks, computed
    once, and need 2 more each, 3 more once they decode): preemption is forced; every run's outputs are identical,
    the prompt tokens are the exact history sums, and the run without a host tier recomputes tokens. Two rounds:
    each side runs twice (the order swapped in the second) and its median run, the slower of two, is the one
    reported."""
    out = tmp_path / "mt.json"
    args = ["bench", "throughput", "--dataset-name", "multi_turn", "--multi-turn-num-conversations", "4"]
    args += ["--multi-turn-num-turns", "2", "--multi-turn-system-len", "64", "--multi-turn-user-len", "32"]
    args += ["--multi-turn-output-len", "8", "--dtype", "float32", "--max-model-len", "192"]
    args += ["--num-gpu-blocks-override", "12", "--kv-offloading-size", "0.01", "--compare-offloading"]
    args += ["--compare-rounds", "2", "--no-cpu-huge-pages"]
    proc = subprocess.run(
        [folio_script(), *args, "--output-json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Greedy outputs identical: yes (8 turns, every one of 4 runs)" in proc.stdout
    assert "Ratio (with / without host tier): total throughput" in proc.stdout
    assert "turns arrive in waves; --dtype float32, --kv-cache-dtype auto" in proc.stdout  # what the K/V cost read
    result = json.loads(out.read_text())
    assert result["greedy_identical"] is True and result["rounds"] == 2
    for key in ("without", "with"):
        elapsed = result["elapsed_s"][key]
        assert len(elapsed) == 2 and result[key]["elapsed_s"] == max(elapsed)
    for key in ("without", "with"):
        run = result[key]
        assert run["prompt_tokens"] == 4 * (96 + 136) and run["output_tokens"] == 4 * 2 * 8
        assert len(run["ttfts_s"]) == 8 and all(t > 0 for t in run["ttfts_s"])
    base = result["without"]
    assert base["num_host_blocks"] == 0 and base["preemption_mode"] == "recompute"
    assert base["counters"]["num_preemptions_total"] >= 1 and base["recomputed_tokens"] > 0
    assert result["with"]["num_host_blocks"] == int(0.01 * 2**30) // (2 * 30 * 16 * 3 * 64 * 4)
