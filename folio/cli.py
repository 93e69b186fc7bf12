"""`folio generate | chat` command line (serve and bench come with their issues)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields

from folio.config import SCHEDULING_POLICIES, SUPPORTED_DTYPES, EngineArgs
from folio.logger import init_logger


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
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache size in bytes")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="force the number of KV blocks")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step (default 2048)")
    g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=SCHEDULING_POLICIES)
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Folio LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    init_logger()
    try:
        return int(ns.func(ns))
    except (ValueError, FileNotFoundError) as e:
        print(f"folio: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
