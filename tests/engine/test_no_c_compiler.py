"""A machine without a C compiler (slim container images have none): Folio's kernels cannot be built, and the
engine must still start and give transformers' greedy tokens through oneDNN and torch, and say why it is slower."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.engine.conftest import HF_REFERENCE_NEW_TOKENS
from tests.engine.greedy_compare import GreedyRun, compare_greedy
from tests.engine.prompts import all_prompt_token_ids

REPO = Path(__file__).resolve().parents[2]

# Run in a fresh process (the kernel libraries are loaded once per process): greedy runs with top-5 logprobs, as
# JSON on stdout; the log goes to stderr.
ENGINE_SCRIPT = """
import json, sys
from folio import LLM, SamplingParams
from tests.engine.greedy_compare import from_folio_output
from tests.small_engine import SMALL_ENGINE
prompts, max_tokens = json.load(open(sys.argv[1])), int(sys.argv[2])
llm = LLM(device="cpu", dtype="float32", **SMALL_ENGINE)
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
runs = [from_folio_output(out) for out in outs]
print(json.dumps([{"token_ids": r.token_ids, "top5": [sorted(s) for s in r.top5]} for r in runs]))
"""


def test_an_engine_without_a_c_compiler_runs_torchs_paths_and_matches_transformers(
    tmp_path: Path, tokenizer: Any, hf_reference: list[GreedyRun]
) -> None:
    prompts = all_prompt_token_ids(tokenizer)[:4]  # torch's ops at the engine's shapes: a third of the prompts
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    empty_path = tmp_path / "bin"  # a PATH with no cc or gcc on it (the interpreter is named in full)
    empty_path.mkdir()
    env = {**os.environ, "PATH": str(empty_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, str(prompts_file), str(HF_REFERENCE_NEW_TOKENS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # it says why, and the start-up line names what runs instead of Folio's kernels
    assert "no C compiler found" in proc.stderr, proc.stderr[-4000:]
    line = next(ln for ln in proc.stderr.splitlines() if "ISA tier" in ln)
    assert "gemm=onednn" in line and "decode_attention=torch" in line and "fused_decoder=off" in line, line
    runs = [GreedyRun(r["token_ids"], [set(s) for s in r["top5"]]) for r in json.loads(proc.stdout)]
    assert len(runs) == len(prompts)
    pairs = zip(hf_reference[: len(runs)], runs, strict=True)
    verdicts = [compare_greedy(ref, run, f"prompt {i}") for i, (ref, run) in enumerate(pairs)]
    print("verdicts without a C compiler:", verdicts)
    assert verdicts.count("identical") >= len(verdicts) - 1, verdicts
