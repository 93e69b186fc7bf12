"""Issue 19's speculation benchmark: the copy_edit dataset (real tokenizer and chat template), the per-request
timing of folio.bench.stepping, and one small real `folio bench throughput --compare-speculative` run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from folio.bench.client import completion_payload
from folio.bench.copy_edit import CODE, PROSE, chat_renderer, copy_edit_prompts, sample_copy_edit
from folio.bench.datasets import SampleRequest, add_dataset_args, requests_from_args
from folio.bench.stepping import SteppedRequest
from folio.cli import main
from folio.model.loader import default_model_path, load_tokenizer


def test_copy_edit_prompts_hold_their_passage_under_the_chat_template() -> None:
    tokenizer = load_tokenizer(default_model_path())
    render = chat_renderer(tokenizer)
    pairs = copy_edit_prompts()
    assert len(pairs) == 16 and len({p.message() for p in pairs}) == 16
    typo_passages = [p.passage for p in pairs if p.instruction.startswith("Correct")]
    assert len(typo_passages) == 4 and all(t not in PROSE and "teh " in t for t in typo_passages)
    requests = sample_copy_edit(20, 64, seed=1, render_chat=render)
    assert requests == sample_copy_edit(20, 64, seed=1, render_chat=render)  # seeded
    assert requests != sample_copy_edit(20, 64, seed=2, render_chat=render)
    assert requests[16:] == requests[:4]  # cycles through every pair
    assert len({tuple(r.prompt_token_ids) for r in requests[:16]}) == 16
    assert all(r.output_len == 64 and r.ignore_eos is False for r in requests)
    text = tokenizer.decode(requests[0].prompt_token_ids)
    assert any(passage in text for passage in PROSE + CODE) or any(t in text for t in typo_passages)
    assert text.rstrip().endswith("assistant")  # the generation prompt
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    ns = parser.parse_args(["--dataset-name", "copy_edit", "--num-prompts", "3", "--copy-edit-output-len", "9"])
    assert requests_from_args(ns, len(tokenizer), render_chat=render) == sample_copy_edit(3, 9, 0, render)
    payload = completion_payload("m", requests[0])
    assert payload["ignore_eos"] is False and payload["prompt"] == requests[0].prompt_token_ids
    assert completion_payload("m", SampleRequest([1, 2], 4))["ignore_eos"] is True


def test_tpot_is_the_time_after_the_first_token_per_later_token() -> None:
    assert SteppedRequest([5, 6, 7, 8, 9], 0.5, 1.3, 2).tpot_s == (1.3 - 0.5) / 4
    assert SteppedRequest([5], 0.5, 0.5, 0).tpot_s is None


def test_compare_speculative_runs_end_to_end(tmp_path: Path, capsys: object) -> None:
    """Two copy prompts at batch 1: identical greedy outputs, one token per request step without speculation and
    more than one with it (the drafts come from the passage in the prompt), so fewer engine steps."""
    out = tmp_path / "spec.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    rc = main(
        ["bench", "throughput", "--dataset-name", "copy_edit", "--num-prompts", "2", "--copy-edit-output-len", "24"]
        + ["--max-num-seqs", "1", "--dtype", "float32", "--max-model-len", "512", "--seed", "3"]
        + ["--kv-cache-memory-bytes", str(64 * 2**20), "--no-cpu-huge-pages"]
        + ["--speculative-config", spec, "--compare-speculative", "--compare-rounds", "1", "--output-json", str(out)]
    )
    printed = capsys.readouterr().out  # type: ignore[attr-defined]
    assert rc == 0, printed
    assert "Greedy outputs identical: yes (2 requests, every round)" in printed
    assert "Ratio (with / without speculation): output throughput" in printed
    result = json.loads(out.read_text())
    base, with_spec = result["without"], result["with"]
    assert result["greedy_identical"] is True and base["output_tokens"] == with_spec["output_tokens"]
    assert base["tokens_per_request_step"] == 1.0
    assert with_spec["tokens_per_request_step"] > 1.5
    assert with_spec["num_steps"] < base["num_steps"]
