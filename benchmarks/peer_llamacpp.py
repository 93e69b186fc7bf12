"""Peer: llama.cpp's server (continuous batching, 64 slots) vs `folio serve`, on W1, in one run.

    .venv/bin/python benchmarks/peer_llamacpp.py                         # W1 at saturation (64 in flight)
    .venv/bin/python benchmarks/peer_llamacpp.py --request-rate 2        # ... then also at Poisson 2 req/s
    .venv/bin/python benchmarks/peer_llamacpp.py --num-prompts 8 --output-len 16   # a quick end-to-end check
    .venv/bin/python benchmarks/peer_llamacpp.py --server python         # llama-cpp-python's own server instead

Installs (once; later runs reuse it) under .peers/llamacpp/ (gitignored):
- ``--server native`` (default): llama.cpp's ``llama-server``, built with cmake from the llama.cpp source that the
  llama-cpp-python 0.3.36 sdist on PyPI vendors (so the llama.cpp version is pinned by a PyPI release), native CPU
  flags (-DGGML_NATIVE=ON), into .peers/llamacpp/bin/llama-server (needs cmake and g++; about 15 minutes on 2
  cores). Its server has parallel slots and continuous batching, takes token-id prompts and ``ignore_eos`` on
  /v1/completions and sends ``usage`` in the stream.
- ``--server python``: ``pip install llama-cpp-python[server]==0.3.36`` (built from source, GGML_NATIVE) into the
  venv .peers/llamacpp, run as ``python -m llama_cpp.server``. That server has no parallel slots (one request at a
  time behind a lock), drops ``ignore_eos``, sends no ``usage`` in a stream, and its /v1/completions takes ``prompt``
  only as a string or a list of strings: W1's token-id prompts get HTTP 500 ("Input should be a valid string", a
  pydantic validation error), so it cannot run this workload as-is; the option is kept to show that.

Both serve the same file as Folio, the default Q4_1 GGUF, with 2 threads on 127.0.0.1 at a free port; llama.cpp
computes in Q4_1 (its native format) where Folio dequantizes to float32, so the peer does less arithmetic per token.
llama-server runs with --parallel 64 (one slot per request in flight) --cont-batching --no-kv-unified (each slot its
own KV, 512 tokens: W1 needs 328) --ctx-size 64*512. Then `folio serve` (float32) gets the identical request set:
`folio bench serve --dataset-name w1` (token ids, greedy, ignore_eos, max_tokens = --output-len, streamed), at rate
inf with --max-concurrency 64 and, with --request-rate R, at Poisson rate R; every run gets a freshly started server.
Results: bench_results/peer_*.json; server logs: bench_results/logs/.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer_serve import (  # noqa: E402 - the shared module sits beside this script
    PEERS,
    PORT,
    RESULTS,
    Server,
    add_common_args,
    compare,
    default_model_path,
    dir_size_mib,
    ensure_venv,
    header,
    log,
    run_step,
    spec_from_args,
    timestamp,
)

VERSION = "0.3.36"
VENV = PEERS / "llamacpp"
LLAMA_SERVER = VENV / "bin" / "llama-server"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
]


def install_native() -> Path:
    """llama-server from the llama.cpp that llama-cpp-python==VERSION vendors; returns the binary."""
    if LLAMA_SERVER.exists():
        log(f"reusing {LLAMA_SERVER}")
        return LLAMA_SERVER
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"building llama-server needs {missing} on PATH (Debian: apt-get install cmake g++)")
    python = ensure_venv(VENV)
    src = VENV / "src"
    sdist = src / f"llama_cpp_python-{VERSION}.tar.gz"
    logs = VENV / "logs"
    if not sdist.exists():
        run_step(
            [str(python), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(src)]
            + [f"llama-cpp-python=={VERSION}"],
            logs / "sdist-download.log",
        )
    tree = src / f"llama_cpp_python-{VERSION}"
    if not tree.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    build = VENV / "build-server"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run_step(
        ["cmake", "-S", str(tree / "vendor" / "llama.cpp"), "-B", str(build), *generator, *CMAKE_FLAGS],
        logs / "cmake-configure.log",
    )
    run_step(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
        logs / "cmake-build.log",
    )
    LLAMA_SERVER.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", LLAMA_SERVER)
    log(f"installed {LLAMA_SERVER}; .peers/llamacpp is {dir_size_mib(VENV):.0f} MiB")
    return LLAMA_SERVER


def install_python() -> Path:
    """llama-cpp-python[server]==VERSION built from source in the venv; returns the venv's python."""
    python = ensure_venv(VENV)
    check = f"import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '{VERSION}')"
    if subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0:
        log(f"reusing llama-cpp-python {VERSION} in {VENV}")
        return python
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON")
    run_step(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-binary",
            "llama-cpp-python",
            f"llama-cpp-python[server]=={VERSION}",
        ],
        VENV / "logs" / "pip-install.log",
        env=env,
    )
    log(f"installed llama-cpp-python {VERSION}; .peers/llamacpp is {dir_size_mib(VENV):.0f} MiB")
    return python


def native_server(model: str, ns: argparse.Namespace, stamp: str) -> Server:
    """llama-server with one slot per concurrent request, each with its own KV (not unified).

    W1 needs at most 328 tokens a slot; llama.cpp gives a slot at least 512 (it raises a smaller --ctx-size).
    """
    slots = ns.parallel or ns.max_concurrency
    cmd = [
        str(LLAMA_SERVER),
        "--model",
        model,
        "--alias",
        "SmolLM2-135M-Instruct",
        "--host",
        "127.0.0.1",
        "--port",
        PORT,
        "--threads",
        str(ns.threads),
        "--threads-batch",
        str(ns.threads),
        "--parallel",
        str(slots),
        "--cont-batching",
        "--no-kv-unified",
        "--ctx-size",
        str(slots * ns.ctx_per_slot),
        "--no-webui",
    ]
    return Server("llama-server", cmd, RESULTS / "logs" / f"llama_server_{stamp}.log")


def python_server(python: Path, model: str, ns: argparse.Namespace, stamp: str) -> Server:
    cmd = [str(python), "-m", "llama_cpp.server", "--model", model, "--model_alias", "SmolLM2-135M-Instruct"]
    cmd += ["--host", "127.0.0.1", "--port", PORT, "--n_threads", str(ns.threads)]
    cmd += ["--n_threads_batch", str(ns.threads), "--n_ctx", str(ns.ctx_per_slot)]
    return Server("llama_cpp.server", cmd, RESULTS / "logs" / f"llama_cpp_python_server_{stamp}.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--server", choices=("native", "python"), default="native", help="see the module doc")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="peer threads (default: all cores)")
    parser.add_argument("--parallel", type=int, default=None, help="llama-server slots (default --max-concurrency)")
    parser.add_argument("--ctx-per-slot", type=int, default=512, help="KV tokens per slot (default 512; W1 needs 328)")
    ns = parser.parse_args()
    if ns.server == "native":
        what = (
            f"llama.cpp llama-server built with cmake (-DGGML_NATIVE=ON) from the llama.cpp vendored in the "
            f"llama-cpp-python=={VERSION} sdist (PyPI) -> {LLAMA_SERVER}"
        )
    else:
        what = f"pip install llama-cpp-python[server]=={VERSION} (source build, GGML_NATIVE) -> venv {VENV}"
    header(
        [
            "peer_llamacpp: llama.cpp server vs folio serve on W1 (same requests, same run)",
            f"  installs (once): {what}",
            "  and nothing else: folio and `folio bench serve` come from .venv; results in bench_results/",
        ]
    )
    model = default_model_path()
    stamp = timestamp()
    if ns.server == "native":
        install_native()
        peer = native_server(model, ns, stamp)
    else:
        peer = python_server(install_python(), model, ns, stamp)
    compare([(f"llama.cpp-{ns.server}", peer)], spec_from_args(ns), ns, model, stamp)


if __name__ == "__main__":
    main()
