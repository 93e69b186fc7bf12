"""`folio serve | generate | chat | bench` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields

from folio.config import MODEL_IMPLS, PREEMPTION_MODES, SCHEDULING_POLICIES, SUPPORTED_DTYPES, EngineArgs
from folio.kernels.isa import CPU_ISA_CHOICES, cpu_info, is_x86_64, library_isa_env, resolve_cpu_isa
from folio.logger import init_logger
from folio.server.limits import DEFAULT_MAX_N_SEQUENCES, DEFAULT_MAX_REQUEST_BODY_BYTES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags with vLLM's names; defaults come from EngineArgs."""
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    g.add_argument("--dtype", default=d.dtype, choices=SUPPORTED_DTYPES, help="weights and activations type")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the engine's random state")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (default on CPU: 30%% of free RAM, at most 4 GiB; on CUDA: sized from "
        "--gpu-memory-utilization)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help=f"CUDA: fraction of GPU memory for weights, activations and KV cache (default {d.gpu_memory_utilization})",
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="force the number of KV blocks")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV blocks of shared prompt prefixes across requests (default on)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help=f"most sequences in one step (default {d.max_num_seqs})",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step (default 2048)")
    g.add_argument(
        "--scheduling-policy",
        default=d.scheduling_policy,
        choices=SCHEDULING_POLICIES,
        help="fcfs: first come first served; priority: lower 'priority' value first, then arrival (default fcfs)",
    )
    g.add_argument(
        "--kv-offloading-size",
        type=float,
        default=d.kv_offloading_size,
        metavar="GIB",
        help="GiB of host memory for a second KV tier under the device's KV cache: evicted prefix blocks and "
        "swapped-out requests move there instead of being recomputed (pinned memory on CUDA; must fit the RAM "
        "available; default 0: no host tier)",
    )
    g.add_argument(
        "--kv-offloading-disk-path",
        default=d.kv_offloading_disk_path,
        metavar="DIR",
        help="a directory for a third KV tier under the host tier (needs --kv-offloading-size): blocks the host tier "
        "drops are written there as files named by block hash, in a subdirectory per model and KV layout, so that a "
        "restarted server finds its prefix cache warm (default: no disk tier)",
    )
    g.add_argument(
        "--kv-offloading-disk-size",
        type=float,
        default=d.kv_offloading_disk_size,
        metavar="GIB",
        help="GiB of block files in --kv-offloading-disk-path (must fit the free disk space; the least recently "
        "used files are deleted beyond it)",
    )
    g.add_argument(
        "--preemption-mode",
        default=d.preemption_mode,
        choices=PREEMPTION_MODES,
        help="when the KV cache runs out, swap: move the preempted request's blocks to the host tier and load them "
        "back on resume (needs --kv-offloading-size); recompute: free them and compute them again (default: swap "
        "when a host tier exists, else recompute)",
    )
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--model-impl",
        default=d.model_impl,
        choices=MODEL_IMPLS,
        help="auto: the checkpoint's model; noop: a stand-in of the same shapes whose forward does nothing and "
        "always predicts one token, to measure the engine's own overhead (meaningless text; default auto)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model layer by layer in Python: on the CPU instead of the fused decoder (one C call per "
        "step), on CUDA without the decode steps' CUDA graphs; the outputs are the same, for comparisons and "
        "debugging",
    )
    g.add_argument(
        "--cpu-isa",
        default=d.cpu_isa,
        choices=CPU_ISA_CHOICES,
        help="CPU: the instruction-set tier the kernels are built for; auto (default) is this CPU's best, a lower "
        "one runs the same engine as a CPU of that tier would (for tests, benchmarks and mixed fleets)",
    )
    g.add_argument(
        "--cpu-kv-prefetch-bytes",
        type=int,
        default=d.cpu_kv_prefetch_bytes,
        help="CPU fused decoder: bytes of the next layer's decode K/V that a layer's GEMMs prefetch "
        "(default: half the L3 cache; 0: off)",
    )
    g.add_argument(
        "--cpu-adaptive-threads",
        action=argparse.BooleanOptionalAction,
        default=d.cpu_adaptive_threads,
        help="CPU: run the kernels on fewer threads while other processes take cores (their run-queue wait "
        "says how many), so that a busy neighbour costs its share of the machine, not most of the throughput "
        "(default on)",
    )
    g.add_argument(
        "--structured-outputs-config",
        type=json_object_arg,
        default=None,
        metavar="JSON",
        help='structured outputs (JSON schema, regex, choice, grammar): {"backend": "auto" | "guidance" | '
        '"xgrammar"}; auto is llguidance (faster to compile and to mask here, see docs/performance.md)',
    )
    g.add_argument(
        "--speculative-config",
        type=json_object_arg,
        default=None,
        metavar="JSON",
        help='speculative decoding (docs/speculative_decoding.md): {"method": "ngram", "num_speculative_tokens": '
        'k, "prompt_lookup_max": n, "prompt_lookup_min": m} (vLLM\'s fields)',
    )


def json_object_arg(text: str) -> dict[str, object]:
    """A flag whose value is a JSON object (vLLM's --*-config flags)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})


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
