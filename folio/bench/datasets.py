"""Reproducible benchmark request sets, with vLLM's dataset names and flags.

Every request is token ids plus an output length, so the offline engine and every HTTP peer get byte-identical
input: no tokenizer round trip can change a prompt's length. A seed fixes the whole set.

- ``random``: prompt and output lengths drawn uniformly from ``[len * (1 - r), len * (1 + r)]``; an optional
  shared prefix of ``--random-prefix-len`` tokens is prepended (so a prompt is prefix + input-len tokens, as in
  vLLM); ids are drawn from the vocabulary, skipping the ids given as special.
- ``prefix_repetition``: ``--prefix-repetition-num-prefixes`` random prefixes, each shared by an equal share of the
  prompts (round robin), followed by a unique random suffix; shuffled so shared prefixes interleave.
- ``custom``: a JSONL file, one ``{"prompt": str | [ids], "output_len"?: int}`` per line (text needs a tokenizer).
- ``w1``: the W1 JSON of ../shared/workloads (``prompts[i].ids``), 128 new tokens each unless told otherwise.
- ``multi_turn``: chat conversations whose every turn's prompt is the whole history (a shared system prompt, each
  earlier user message and reply) plus a new user message (issue 18's KV-tier workload). A turn needs the previous
  turn's output, so it runs only in `folio bench throughput`, in waves (folio/bench/multi_turn.py).
- ``copy_edit``: chat prompts asking to repeat or lightly edit a passage or piece of code (folio/bench/copy_edit.py);
  generation stops at EOS. The workload of n-gram speculation.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASET_NAMES = ("random", "prefix_repetition", "custom", "w1", "multi_turn", "copy_edit")
# /work/main/folio/bench/datasets.py -> parents[3] = /work; the workloads live in /work/shared/workloads.
DEFAULT_W1_PATH = Path(__file__).resolve().parents[3] / "shared" / "workloads" / "w1_prompts.json"

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the exact prompt token ids and the number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int
    ignore_eos: bool = True  # False where the text has a natural end (copy_edit)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of a length drawn with vLLM's range ratio: 100 tokens, ratio 0.1 -> [90, 110]."""
    return int(length * (1 - range_ratio)), int(length * (1 + range_ratio))


def _token_pool(vocab_size: int, special_ids: Collection[int]) -> np.ndarray:
    """Ids a random prompt may use: the vocabulary minus special tokens (BOS/EOS would end or restart a text)."""
    excluded = np.array(sorted(set(special_ids)), dtype=np.int64)
    pool = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), excluded)
    if pool.size == 0:
        raise ValueError(f"no token ids to draw from (vocab_size={vocab_size})")
    return pool


def sample_random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    special_ids: Collection[int] = (),
) -> list[SampleRequest]:
    """vLLM's random dataset: every prompt is ``prefix_len`` shared tokens plus its own drawn input length."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError("random input/output lengths must be >= 1 and the prefix length >= 0")
    rng = np.random.default_rng(seed)
    pool = _token_pool(vocab_size, special_ids)
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    input_lens = rng.integers(max(in_lo, 1), in_hi + 1, size=num_prompts)
    output_lens = rng.integers(max(out_lo, 1), out_hi + 1, size=num_prompts)
    prefix = rng.choice(pool, size=prefix_len).tolist()
    return [
        SampleRequest(prefix + rng.choice(pool, size=int(n_in)).tolist(), int(n_out))
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def sample_prefix_repetition(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    special_ids: Collection[int] = (),
) -> list[SampleRequest]:
    """Prompt i gets prefix ``i % num_prefixes`` then a fresh suffix; the list is shuffled (seeded)."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError("prefix_repetition needs >= 1 prefix, a non-empty prompt and output_len >= 1")
    rng = np.random.default_rng(seed)
    pool = _token_pool(vocab_size, special_ids)
    prefixes = [rng.choice(pool, size=prefix_len).tolist() for _ in range(num_prefixes)]
    requests = [
        SampleRequest(prefixes[i % num_prefixes] + rng.choice(pool, size=suffix_len).tolist(), output_len)
        for i in range(num_prompts)
    ]
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]


def load_custom(path: str, num_prompts: int, default_output_len: int, tokenize: Tokenize | None) -> list[SampleRequest]:
    """The first ``num_prompts`` lines of a JSONL file; a text prompt is tokenized once, here, by ``tokenize``."""
    requests: list[SampleRequest] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if len(requests) >= num_prompts:
                break
            if not line.strip():
                continue
            item = json.loads(line)
            prompt = item.get("prompt")
            if isinstance(prompt, str):
                if tokenize is None:
                    raise ValueError(f"{path}:{line_no}: a text prompt needs a tokenizer")
                ids = tokenize(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise ValueError(f"{path}:{line_no}: 'prompt' must be a string or a list of token ids")
            requests.append(SampleRequest(ids, int(item.get("output_len", default_output_len))))
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests


def load_w1(path: str, num_prompts: int, output_len: int) -> list[SampleRequest]:
    """The first ``num_prompts`` prompts of a W1-format JSON file (``prompts[i].ids``)."""
    data = json.loads(Path(path).read_text())
    return [SampleRequest(list(p["ids"]), output_len) for p in data["prompts"][:num_prompts]]


@dataclass(frozen=True)
class MultiTurnWorkload:
    """Conversations of token ids: ``user_turns[c][t]`` is conversation c's user message of turn t."""

    system_prompt: list[int]
    user_turns: list[list[list[int]]]
    output_len: int

    @property
    def num_turns(self) -> int:
        return len(self.user_turns[0])

    def turn_prompt(self, conversation: int, turn: int, replies: list[list[int]]) -> list[int]:
        """Turn ``turn``'s prompt: the system prompt, then each earlier user message and its reply (``replies``,
        one per earlier turn), then this turn's user message."""
        if len(replies) != turn:
            raise ValueError(f"turn {turn} needs the {turn} earlier replies, got {len(replies)}")
        ids = list(self.system_prompt)
        for user, reply in zip(self.user_turns[conversation][:turn], replies, strict=True):
            ids += user + reply
        return ids + self.user_turns[conversation][turn]

    def working_set_tokens(self) -> int:
        """Distinct tokens whose K/V the whole workload holds at its end: the system prompt once, and every
        conversation's user messages and replies (the final turn's reply included)."""
        per_conversation = self.num_turns * (len(self.user_turns[0][0]) + self.output_len)
        return len(self.system_prompt) + len(self.user_turns) * per_conversation


def sample_multi_turn(
    num_conversations: int,
    num_turns: int,
    system_len: int,
    user_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    special_ids: Collection[int] = (),
) -> MultiTurnWorkload:
    """Random token ids (seeded): one system prompt shared by every conversation, a fresh user message per turn."""
    if min(num_conversations, num_turns, user_len, output_len) < 1 or system_len < 0:
        raise ValueError(
            "multi_turn needs >= 1 conversation, turn, user token and output token, and a system length >= 0"
        )
    rng = np.random.default_rng(seed)
    pool = _token_pool(vocab_size, special_ids)
    system = rng.choice(pool, size=system_len).tolist()
    turns = [[rng.choice(pool, size=user_len).tolist() for _ in range(num_turns)] for _ in range(num_conversations)]
    return MultiTurnWorkload(system, turns, output_len)


def multi_turn_from_args(
    ns: argparse.Namespace, vocab_size: int, special_ids: Collection[int] = ()
) -> MultiTurnWorkload:
    return sample_multi_turn(
        ns.multi_turn_num_conversations,
        ns.multi_turn_num_turns,
        ns.multi_turn_system_len,
        ns.multi_turn_user_len,
        ns.multi_turn_output_len,
        vocab_size,
        ns.seed,
        special_ids,
    )


def add_dataset_args(parser: argparse.ArgumentParser, add_seed: bool = True) -> None:
    """Dataset flags with vLLM's names. ``add_seed=False`` where the engine flags already define ``--seed``."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASET_NAMES, help="request set (default random)")
    g.add_argument(
        "--dataset-path",
        default=None,
        help="custom: a JSONL file of {'prompt': ..., 'output_len'?: ...}; "
        f"w1: the W1 JSON (default {DEFAULT_W1_PATH})",
    )
    g.add_argument("--num-prompts", type=int, default=1000, help="number of requests (default 1000)")
    if add_seed:
        g.add_argument("--seed", type=int, default=0, help="seed of the request set and arrival times (default 0)")
    g.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens after the prefix")
    g.add_argument("--random-output-len", type=int, default=128, help="random: tokens to generate")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random: lengths drawn uniformly from [len*(1-r), len*(1+r)], 0 <= r < 1 (default 0: exact)",
    )
    g.add_argument("--random-prefix-len", type=int, default=0, help="random: tokens of a prefix shared by all prompts")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="prefix_repetition: prefix tokens")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="prefix_repetition: suffix tokens")
    g.add_argument(
        "--prefix-repetition-num-prefixes", type=int, default=10, help="prefix_repetition: distinct prefixes"
    )
    g.add_argument(
        "--prefix-repetition-output-len", type=int, default=128, help="prefix_repetition: tokens to generate"
    )
    g.add_argument(
        "--custom-output-len", type=int, default=256, help="custom: output length of lines without 'output_len'"
    )
    g.add_argument(
        "--copy-edit-output-len", type=int, default=256, help="copy_edit: most tokens per reply (default 256)"
    )
    g.add_argument("--w1-output-len", type=int, default=128, help="w1: tokens to generate per prompt (default 128)")
    g.add_argument(
        "--multi-turn-num-conversations", type=int, default=32, help="multi_turn: conversations (default 32)"
    )
    g.add_argument("--multi-turn-num-turns", type=int, default=4, help="multi_turn: turns each (default 4)")
    g.add_argument(
        "--multi-turn-system-len", type=int, default=512, help="multi_turn: shared system prompt tokens (default 512)"
    )
    g.add_argument(
        "--multi-turn-user-len", type=int, default=256, help="multi_turn: new user tokens per turn (default 256)"
    )
    g.add_argument(
        "--multi-turn-output-len", type=int, default=64, help="multi_turn: tokens generated per turn (default 64)"
    )
    g.add_argument(
        "--multi-turn-arrival",
        choices=("waves", "closed-loop"),
        default="waves",
        help="multi_turn: turn t of every conversation at once after every turn t-1 (waves, the default), or each "
        "conversation's next turn as soon as its last reply finished (closed-loop, as chat clients send them)",
    )


def requests_from_args(
    ns: argparse.Namespace,
    vocab_size: int,
    special_ids: Collection[int] = (),
    tokenize: Tokenize | None = None,
    render_chat: Tokenize | None = None,
) -> list[SampleRequest]:
    """The request set the dataset flags describe (``render_chat``: one user message -> prompt ids, for copy_edit)."""
    if ns.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {ns.num_prompts}")
    if ns.dataset_name == "random":
        return sample_random(
            ns.num_prompts,
            ns.random_input_len,
            ns.random_output_len,
            vocab_size,
            ns.seed,
            ns.random_range_ratio,
            ns.random_prefix_len,
            special_ids,
        )
    if ns.dataset_name == "prefix_repetition":
        return sample_prefix_repetition(
            ns.num_prompts,
            ns.prefix_repetition_prefix_len,
            ns.prefix_repetition_suffix_len,
            ns.prefix_repetition_num_prefixes,
            ns.prefix_repetition_output_len,
            vocab_size,
            ns.seed,
            special_ids,
        )
    if ns.dataset_name == "multi_turn":
        raise ValueError(
            "--dataset-name multi_turn runs only in `folio bench throughput`: a turn is sent after the previous "
            "turn's output exists, which a flat request set cannot express"
        )
    if ns.dataset_name == "copy_edit":
        from folio.bench.copy_edit import sample_copy_edit

        if render_chat is None:
            raise ValueError("--dataset-name copy_edit needs the model's tokenizer and chat template")
        return sample_copy_edit(ns.num_prompts, ns.copy_edit_output_len, ns.seed, render_chat)
    if ns.dataset_name == "custom":
        if ns.dataset_path is None:
            raise ValueError("--dataset-name custom needs --dataset-path")
        return load_custom(ns.dataset_path, ns.num_prompts, ns.custom_output_len, tokenize)
    return load_w1(ns.dataset_path or str(DEFAULT_W1_PATH), ns.num_prompts, ns.w1_output_len)
