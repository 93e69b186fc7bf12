"""A case the scheduler state machine (test_properties.py) found, kept as a plain test: after a disk-tier file is
lost, a request with n=2 whose parent loads the lost block forks its siblings in the same step; the load fails, the
worker drops the parent, and the siblings (unknown to the worker in that step) read the unwritten block. Found in
session 25; fixed by forking only from a parent whose loads have answered (``Scheduler._fork_ready_siblings``)."""

from __future__ import annotations

from collections.abc import Callable

from tests.core.test_properties import RequestSpec, SchedulerMachine


def _spec(prefix_len: int, suffix_len: int, n: int = 1) -> RequestSpec:
    """A request on shared prefix 0, one output token, no stop, sampling nothing else."""
    return RequestSpec(
        prefix=0, prefix_len=prefix_len, suffix_len=suffix_len, max_tokens=1, min_tokens=0, stop="none",
        stop_at=0, ignore_eos=False, script_seed=0, n=n, priority=0, prompt_logprobs=None,
    )  # fmt: skip


def test_a_lost_disk_file_under_shared_siblings_keeps_every_block_right() -> None:
    state = SchedulerMachine()
    state.configure(
        block_size=1, max_model_len=3, extra_blocks=0, max_num_seqs=2, max_num_batched_tokens=3,
        long_prefill_token_threshold=0, policy="fcfs", enable_prefix_caching=True, num_host_blocks=1,
        num_disk_blocks=1, preemption_mode=None, end_by_abort=False, initial_requests=[_spec(1, 0)],
    )  # fmt: skip
    abort_first_three_times: list[Callable[[], None]] = [lambda: state.abort(index=0)] * 3
    actions: list[Callable[[], None]] = [
        lambda: state.add_request(spec=_spec(0, 0)),
        lambda: state.step(abort_mid_step=None, num_steps=1),
        *abort_first_three_times,
        lambda: state.add_request(spec=_spec(0, 0)),
        lambda: state.add_request(spec=_spec(0, 2)),
        lambda: state.step(abort_mid_step=None, num_steps=1),
        *abort_first_three_times,
        lambda: state.add_request(spec=_spec(1, 1, n=2)),
        lambda: state.lose_disk_file(index=0),
        lambda: state.step(abort_mid_step=None, num_steps=2),
    ]
    for action in actions:  # the invariants after every rule, as hypothesis runs them
        state.state_is_consistent()
        action()
    state.teardown()
