"""`folio bench latency --profile` on the no-op model, the step timer, and the no-op model's contract."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from folio.model.loader import read_model_spec
from folio.model.noop import NoopCausalLM, noop_token_id
from folio.step_timer import PHASES, StepTimer
from tests.server.conftest import folio_script
from tests.small_engine import TEST_KV_BYTES

BATCH, INPUT_LEN, OUTPUT_LEN, ITERS = 4, 8, 6, 2


def test_step_timer_tiles_the_step_and_ignores_laps_outside_one() -> None:
    timer = StepTimer()
    timer.lap("outside")  # never begun: ignored
    timer.begin()
    timer.lap("a")
    sum(range(10000))
    timer.lap("b")
    timer.lap("a")  # a repeated phase accumulates
    timer.set_batch(3, 3)
    timer.end()
    assert len(timer.steps) == 1
    step = timer.steps[0]
    assert set(step.wall_s) == set(step.cpu_s) == {"a", "b"}
    assert step.wall_s["b"] > 0 and step.is_pure_decode
    timer.set_batch(5, 5)  # after end: no current step
    assert (step.num_reqs, step.num_tokens) == (3, 3)


def test_noop_model_shapes_and_constant_token(default_model_path: str) -> None:
    spec = read_model_spec(default_model_path)  # shapes only: the no-op model reads no weights
    model = NoopCausalLM(spec, torch.float32, torch.device("cpu"))
    ids = torch.zeros(7, dtype=torch.long)
    hidden = model(ids, ids, [], None)  # type: ignore[arg-type]
    assert hidden.shape == (7, spec.hidden_size) and not hidden.any()
    logits = model.compute_logits(hidden[:3])
    assert logits.shape == (3, spec.vocab_size) and logits.dtype == torch.float32
    assert logits.argmax(-1).tolist() == [noop_token_id(spec)] * 3
    assert model.compute_logits(hidden[:5]).argmax(-1).tolist() == [noop_token_id(spec)] * 5  # grows on demand


def test_latency_profile_noop(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    args = [folio_script(), "bench", "latency", "--profile", "--batch-size", str(BATCH), "--input-len", str(INPUT_LEN)]
    args += ["--output-len", str(OUTPUT_LEN), "--num-iters", str(ITERS), "--num-iters-warmup", "1"]
    args += ["--output-json", str(out), "--max-model-len", "512", "--kv-cache-memory-bytes", str(TEST_KV_BYTES)]
    args += ["--no-cpu-huge-pages"]  # as tests/small_engine.py says
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stdout = proc.stdout
    requested = BATCH * OUTPUT_LEN
    assert f"Output tokens per run: {requested}, {requested} ({requested} requested)" in stdout
    # one row per phase with six positive numbers (CPU and wall mean/p50/p99, ms)
    for phase in PHASES:
        label = re.escape(phase + (" (no-op)" if phase == "model forward" else ""))
        match = re.search(rf"^{label} +((?:[0-9.]+ +){{5}}[0-9.]+)$", stdout, re.MULTILINE)
        assert match, f"no row for {phase!r} in:\n{stdout}"
        assert all(float(v) > 0 for v in match.group(1).split()), match.group(0)
    assert re.search(r"scheduler \+ input preparation: [0-9.]+ ms CPU per step .*target < 2 ms", stdout)
    profile = json.loads(out.read_text())["profile"]["noop"]
    # OUTPUT_LEN - 1 steps per run where all BATCH requests decode (the first step is the prefill)
    assert profile["num_steps"] == ITERS * (OUTPUT_LEN - 1)
    assert profile["output_tokens_per_run"] == [requested] * ITERS
    assert all(profile["phases"][p]["cpu_ms"]["mean"] > 0 for p in PHASES)


def test_profile_needs_a_decode_step() -> None:
    from folio.bench.profile import summarize_steps

    with pytest.raises(ValueError, match="no step had all 4 requests decoding"):
        summarize_steps([], 4)


def test_noop_engine_runs_the_real_engine_around_a_constant_token() -> None:
    from folio import LLM, SamplingParams

    llm = LLM(model_impl="noop", max_model_len=512, kv_cache_memory_bytes=TEST_KV_BYTES)
    engine = llm.llm_engine
    assert engine.step_timer is None and engine.engine_core.step_timer is None  # timings are off by default
    assert engine.executor.worker.model_runner.kv_caches == []  # blocks are accounted, no K/V memory
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": [10, 11, 12]}] * 3, params, use_tqdm=False)
    token_id = noop_token_id(engine.model_spec)
    assert [o.outputs[0].token_ids for o in outputs] == [[token_id] * 5] * 3
    assert outputs[0].outputs[0].text  # detokenized for real
