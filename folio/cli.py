"""`folio serve | generate | chat | bench` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from folio.engine.dp_router import DATA_PARALLEL_ROUTINGS
from folio.engine_flags import add_engine_args, engine_args_from
from folio.kernels.isa import cpu_info, is_x86_64, library_isa_env, resolve_cpu_isa
from folio.kv_transfer.proxy_cli import add_proxy_parser
from folio.logger import init_logger
from folio.server.limits import DEFAULT_MAX_N_SEQUENCES, DEFAULT_MAX_REQUEST_BODY_BYTES


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def sampling_params_from(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    from folio.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.sampling_seed
    )


def cmd_generate(ns: argparse.Namespace) -> int:
    from folio.llm import LLM

    params = sampling_params_from(ns)  # validate before the model loads
    llm = LLM(**vars(engine_args_from(ns)))
    outputs = llm.generate(ns.prompts, params, use_tqdm=len(ns.prompts) > 1)
    for out in outputs:
        if len(ns.prompts) > 1:
            print(f"--- {out.prompt!r}")
        print(out.outputs[0].text)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    """An interactive loop: one user line in, the assistant's reply out, history kept. EOF, 'exit' or 'quit' ends."""
    from folio.llm import LLM

    params = sampling_params_from(ns)
    llm = LLM(**vars(engine_args_from(ns)))
    messages: list[dict[str, str]] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("exit", "quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def cmd_serve(ns: argparse.Namespace) -> int:
    """Serves the OpenAI-compatible API until SIGTERM/SIGINT (exit 0) or the engine core dies (exit 1)."""
    from folio.server.api_server import run_server

    if ns.model_positional is not None:
        if ns.model is not None and ns.model != ns.model_positional:
            raise ValueError(f"the model is given twice: {ns.model_positional!r} and --model {ns.model!r}")
        ns.model = ns.model_positional
    ns.api_key = resolve_api_key(ns.api_key, os.environ)
    for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
        if getattr(ns, name) is not None and getattr(ns, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(ns, name)}")
    if ns.max_n_sequences < 1:
        raise ValueError(f"max_n_sequences must be >= 1, got {ns.max_n_sequences}")
    if ns.max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {ns.max_request_body_bytes}")
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {ns.port}")
    if ns.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size (--data-parallel-size) must be >= 1, got {ns.data_parallel_size}")
    if ns.data_parallel_size > 1 and ns.kv_transfer_config is not None:
        raise ValueError("kv_transfer_config with data_parallel_size (--data-parallel-size) > 1 is not supported yet")
    return run_server(ns, engine_args_from(ns))


def resolve_api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """--api-key wins over FOLIO_API_KEY (as vLLM's flag wins over VLLM_API_KEY); an empty key means none."""
    if flag is not None:
        return flag or None
    return environ.get("FOLIO_API_KEY") or None


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server flags with vLLM's names (the engine flags come from add_engine_args)."""
    parser.add_argument(
        "model_positional", nargs="?", default=None, metavar="MODEL", help="model to serve (same as --model)"
    )
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: local only, unlike vLLM's 0.0.0.0; pass 0.0.0.0 to expose "
        "the server on every interface)",
    )
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route except /health, /ping, /metrics and /version "
        "(default: the FOLIO_API_KEY environment variable; unset: no key needed)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: the model path's base name, or "
        "SmolLM2-135M-Instruct for the default model)",
    )
    g.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        help="admit at most --max-num-seqs plus this many requests at once (running plus queued, counted by the "
        "server as it admits them; a request with n samples over P prompts counts n x P); others get 503 with "
        "Retry-After (default: no limit)",
    )
    g.add_argument(
        "--max-num-queued-tokens",
        type=int,
        default=None,
        help="answer 503 with Retry-After while the admitted requests' prompt tokens awaiting prefill (prompts "
        "with no output yet; each prompt once, whatever n) plus the new request's would exceed this; a request "
        "arriving when none await prefill is always admitted (default: no limit)",
    )
    g.add_argument(
        "--max-n-sequences",
        type=int,
        default=DEFAULT_MAX_N_SEQUENCES,
        help="the most sequences one request may ask for with 'n' (400 beyond; vLLM's VLLM_MAX_N_SEQUENCES, 16384 "
        f"there). Default {DEFAULT_MAX_N_SEQUENCES}, OpenAI's own limit: the n sequences of a request are "
        "scheduled together, and a large n holds a small server's engine for minutes",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="refuse larger request bodies with 413 before reading them further (vLLM has no such limit). Default "
        f"{DEFAULT_MAX_REQUEST_BODY_BYTES} (8 MiB): a full 128k-token context is about 1 MB of JSON, and the limit "
        "bounds what one request can make the server buffer, parse and tokenize",
    )
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine cores behind this server, each with its own KV cache (on the CPU they split the threads, on "
        "CUDA core i takes GPUs i*tp..); a router sends each request to the core holding the longest cached prefix "
        "of its prompt, else the least loaded one (docs/scale_out.md; default 1)",
    )
    g.add_argument(
        "--data-parallel-routing",
        default="prefix",
        choices=DATA_PARALLEL_ROUTINGS,
        help="how --data-parallel-size > 1 picks a request's engine core: prefix (the longest cached prefix unless "
        "that core is too busy, else the least loaded), load (the least loaded), round_robin (in turn; for "
        "comparisons) (default prefix)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of uvicorn (access log at info; default info)",
    )


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`folio bench throughput | latency | serve | sweep`; the flag definitions live in folio.bench."""
    from folio.bench.datasets import add_dataset_args
    from folio.bench.offline import add_latency_args, add_throughput_args, cmd_bench_latency, cmd_bench_throughput
    from folio.bench.serve import add_serve_bench_args, cmd_bench_serve
    from folio.bench.sweep import add_sweep_args, cmd_bench_sweep

    bench = sub.add_parser("bench", help="benchmarks: offline throughput, batch latency, online serving")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_sub.add_parser(
        "throughput",
        help="offline throughput of the in-process engine (greedy, EOS ignored)",
        description="Generate a seeded request set with the in-process engine; print requests/s, output and total "
        "tokens/s.",
    )
    add_throughput_args(throughput)
    add_dataset_args(throughput, add_seed=False)
    add_engine_args(throughput)
    throughput.set_defaults(func=cmd_bench_throughput)
    latency = bench_sub.add_parser(
        "latency",
        help="end-to-end latency of one batch of random prompts, repeated; --profile: time per step phase",
        description="Time one batch (--batch-size x --input-len in / --output-len out) --num-iters times; print "
        "avg/p50/p90/p99. --profile adds a per-phase table of the engine steps (no-op model by default).",
    )
    add_latency_args(latency)
    add_engine_args(latency)
    latency.set_defaults(func=cmd_bench_latency)
    serve = bench_sub.add_parser(
        "serve",
        help="online benchmark of any OpenAI-compatible server (/v1/completions, streaming)",
        description="Stream a seeded request set to --base-url with Gamma arrivals; print TTFT/TPOT/ITL/E2EL "
        "statistics (vLLM's definitions), throughput and goodput.",
    )
    add_serve_bench_args(serve)
    serve.set_defaults(func=cmd_bench_serve)
    sweep = bench_sub.add_parser(
        "sweep",
        help="bench serve over a grid of --max-num-seqs x --max-num-batched-tokens; recommends a setting",
        description="For each setting start a fresh folio serve (other flags, e.g. --max-model-len 512, are passed "
        "to it), run bench serve's benchmark, then print a table and the setting with the highest goodput among "
        "those meeting --slo; write JSON and a PNG.",
        allow_abbrev=False,  # --max-num-seqs must not be taken for --max-num-seqs-grid
    )
    add_sweep_args(sweep)
    sweep.set_defaults(func=cmd_bench_sweep, passes_unknown_args=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Folio LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics, ...)",
        description="Serve MODEL (default: SmolLM2-135M-Instruct) over an OpenAI-compatible HTTP API.",
    )
    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="generate completions for prompts given on the command line")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template (reads stdin)")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)
    add_bench_parsers(sub)
    add_proxy_parser(sub)
    return parser


def _hold_libraries_to_cpu_isa(cpu_isa: str) -> None:
    """Under a --cpu-isa below this CPU's own, MKL, oneDNN and ATen run at that tier too (their environment
    variables, set before any of them runs and inherited by the engine's process); a user's own setting wins."""
    _, flags = cpu_info()
    native = resolve_cpu_isa("auto", flags, is_x86_64())
    for name, value in library_isa_env(resolve_cpu_isa(cpu_isa, flags, is_x86_64()), native).items():
        os.environ.setdefault(name, value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(ns, "passes_unknown_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    ns.extra_args = unknown  # `folio bench sweep` hands them to every `folio serve` it starts
    init_logger()
    try:
        _hold_libraries_to_cpu_isa(getattr(ns, "cpu_isa", "auto"))
        return int(ns.func(ns))
    except (ValueError, FileNotFoundError) as e:
        print(f"folio: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
