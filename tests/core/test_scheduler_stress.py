"""Randomized runs under block pressure: every step passes the FakeWorker's KV read-back check, no block leaks,
and every request that was not aborted produces exactly the tokens of an unconstrained run (preemption, prefix
hits, forks and chunking must not change outputs)."""

import random

import pytest

from folio.request import Request
from tests.helpers import make_request, make_scheduler, make_worker, run_to_completion, step

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32


def random_requests(rng: random.Random) -> list[Request]:
    prefixes = [[rng.randrange(10, 500) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
    requests: list[Request] = []
    for i in range(rng.randrange(4, 12)):
        prompt = rng.choice(prefixes) + [rng.randrange(10, 500) for _ in range(rng.randrange(1, 10))]
        max_tokens = rng.randrange(1, MAX_MODEL_LEN - len(prompt) + 2)
        priority = rng.randrange(3)
        requests.append(make_request(f"r{i}", prompt, max_tokens=max_tokens, priority=priority, arrival_time=i))
        for j in range(1, rng.choice([1, 1, 2, 3])):  # n > 1 families
            child = make_request(f"r{i}#{j}", prompt, max_tokens=max_tokens, priority=priority, arrival_time=i)
            child.fork_of = f"r{i}"
            requests.append(child)
    return requests


def reference_outputs(requests: list[Request]) -> dict[str, list[int]]:
    scheduler = make_scheduler(num_blocks=512, max_num_seqs=64, max_model_len=MAX_MODEL_LEN)
    for request in requests:
        copy = make_request(request.request_id, request.prompt_token_ids, max_tokens=request.max_tokens)
        scheduler.add_request(copy)
    return run_to_completion(scheduler, make_worker(scheduler)).outputs


@pytest.mark.parametrize("seed", range(40))
def test_random_workload_matches_unconstrained_run(seed: int) -> None:
    rng = random.Random(seed)
    requests = random_requests(rng)
    expected = reference_outputs(requests)
    scheduler = make_scheduler(
        num_blocks=rng.randrange(MAX_MODEL_LEN // BLOCK_SIZE, 24),
        max_num_seqs=rng.randrange(1, 8),
        max_num_batched_tokens=rng.randrange(1, 40),
        max_model_len=MAX_MODEL_LEN,
        policy=rng.choice(["fcfs", "priority"]),
        long_prefill_token_threshold=rng.choice([0, 0, 3]),
        enable_prefix_caching=rng.random() < 0.8,
    )
    worker = make_worker(scheduler)
    pending = list(requests)
    aborted: set[str] = set()
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if rng.random() < 0.03 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort_requests(victim)
            aborted.add(victim)
        if not pending and not scheduler.has_unfinished_requests():
            break
        step(scheduler, worker)
    else:
        raise AssertionError("did not finish")
    scheduler.kv_cache_manager.assert_no_leaks()
    assert not scheduler.running and len(scheduler.waiting) == 0 and scheduler.num_waiting == 0
    for request in requests:
        if request.request_id not in aborted:
            assert request.output_token_ids == expected[request.request_id], request.request_id
