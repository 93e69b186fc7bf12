"""Ranks start forked from a fork server (folio/executor/rank_start.py): torch is imported before a rank's code
runs, and a rank started after the engine changed its environment or its stderr sees the engine's, not what the
fork server had when it started."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from folio.executor.rank_start import EngineSurroundings, rank_process_context

_PROBE_VARIABLE = "FOLIO_RANK_START_PROBE"


def _probe(surroundings: None, results: Any, line: str) -> None:
    """A rank's stand-in: reports what it started with and writes ``line`` (if any) to its stdout and stderr."""
    if line:
        print(line, flush=True)
        print(line, file=sys.stderr, flush=True)
    results.send(("torch" in sys.modules, os.environ.get(_PROBE_VARIABLE), os.getppid()))
    results.close()


def _start_probe(line: str, device_type: str = "cpu") -> tuple[bool, str | None, int]:
    ctx = rank_process_context(device_type)
    results_out, results_in = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_probe, args=(EngineSurroundings(), results_in, line), daemon=True)
    process.start()
    results_in.close()
    try:
        assert results_out.poll(60.0), "the probe rank never answered"  # hang guard only
        result: tuple[bool, str | None, int] = results_out.recv()
    finally:
        process.join(60.0)
    assert process.exitcode == 0
    return result


def test_cuda_ranks_are_spawned() -> None:
    """A fork after the parent initialised the CUDA driver cannot use CUDA: CUDA ranks keep spawn."""
    assert rank_process_context("cuda").get_start_method() == "spawn"
    assert rank_process_context("cpu").get_start_method() == "forkserver"


def test_a_rank_starts_with_torch_imported_and_the_engines_current_environment_and_stderr(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(_PROBE_VARIABLE, "before")
    with capfd.disabled():  # the fork server is running from here on, with the environment and stderr of now
        _start_probe("")
    monkeypatch.setenv(_PROBE_VARIABLE, "after")
    torch_imported, value, parent = _start_probe("second probe")
    assert torch_imported  # preloaded by the fork server: the rank does not import it
    assert value == "after"
    assert parent != os.getpid()  # forked by the server, not by this process
    captured = capfd.readouterr()
    assert "second probe" in captured.out and "second probe" in captured.err


def test_a_spawned_rank_keeps_the_engines_stdout_and_stderr(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """CUDA's start method (spawn) hands the descriptors over under their own numbers: they stay open."""
    monkeypatch.setenv(_PROBE_VARIABLE, "spawned")
    torch_imported, value, parent = _start_probe("spawned probe", "cuda")  # the probe itself touches no GPU
    assert (value, parent) == ("spawned", os.getpid())
    captured = capfd.readouterr()
    assert "spawned probe" in captured.out and "spawned probe" in captured.err
