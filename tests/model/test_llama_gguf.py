"""The default SmolLM2 GGUF through Folio vs transformers' model built from the same file (float32)."""

from __future__ import annotations

from typing import Any

import torch

from folio.attention.builder import assign_contiguous_blocks, build_attn_metadata, compute_positions
from folio.model.loader import load_model

BLOCK_SIZE = 16
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _kv_caches(spec: Any, num_blocks: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK_SIZE, spec.num_key_value_heads, spec.head_dim)
    return [torch.zeros(shape) for _ in range(spec.num_hidden_layers)]


def _last_logits(model: Any, spec: Any, prompts: list[list[int]]) -> torch.Tensor:
    """One flattened prefill of all prompts -> logits at each prompt's last position [R, vocab]."""
    lens = [len(p) for p in prompts]
    tables = assign_contiguous_blocks(lens, BLOCK_SIZE)
    attn = build_attn_metadata(lens, lens, tables, BLOCK_SIZE)
    positions = torch.tensor(compute_positions(lens, lens))
    with torch.no_grad():
        hidden = model(torch.tensor(sum(prompts, [])), positions, _kv_caches(spec, sum(map(len, tables))), attn)
        return model.compute_logits(hidden[attn.query_start_loc[1:].long() - 1])


def test_last_logits_match_transformers(folio_model: Any, hf_model: Any, tokenizer: Any) -> None:
    model, spec = folio_model
    prompts = [_chat_ids(tokenizer, text) for text in PROMPTS]
    logits = _last_logits(model, spec, prompts)
    with torch.no_grad():
        expected = torch.cat([hf_model(torch.tensor([p])).logits[0, -1:] for p in prompts])
    max_diff = (logits - expected).abs().max().item()
    print(f"max |folio - transformers| last-position logits: {max_diff:.3g} (logit range {expected.abs().max():.1f})")
    assert max_diff < 2e-3
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_greedy_answer_with_decode_steps(folio_model: Any, tokenizer: Any) -> None:
    """Prefill, then decode one token at a time through the paged cache (block_size 16 crosses blocks)."""
    model, spec = folio_model
    prompt = _chat_ids(tokenizer, PROMPTS[0])
    max_new = 8
    tables = assign_contiguous_blocks([len(prompt) + max_new], BLOCK_SIZE)
    kv_caches = _kv_caches(spec, len(tables[0]))
    input_ids, query_len, seq_len, output = prompt, len(prompt), len(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            attn = build_attn_metadata([query_len], [seq_len], tables, BLOCK_SIZE)
            positions = torch.tensor(compute_positions([query_len], [seq_len]))
            hidden = model(torch.tensor(input_ids), positions, kv_caches, attn)
            token = int(model.compute_logits(hidden[-1:]).argmax(-1))
            output.append(token)
            input_ids, query_len, seq_len = [token], 1, seq_len + 1
    assert tokenizer.decode(output) == "The capital of France is Paris.<|im_end|>"


def test_hf_directory_matches_gguf(folio_model: Any, hf_model_dir: str, tokenizer: Any) -> None:
    """The same weights saved by transformers as safetensors: Folio's HF loader (transformers un-permuted q/k)
    and its GGUF loader (Folio un-permuted them) must agree."""
    gguf_model, gguf_spec = folio_model
    dir_model, dir_spec = load_model(hf_model_dir, torch.float32, torch.device("cpu"), show_progress=False)
    for field in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "head_dim", "vocab_size"):
        assert getattr(dir_spec, field) == getattr(gguf_spec, field)
    assert dir_spec.rope_theta == gguf_spec.rope_theta
    prompts = [_chat_ids(tokenizer, PROMPTS[1])]
    torch.testing.assert_close(
        _last_logits(dir_model, dir_spec, prompts), _last_logits(gguf_model, gguf_spec, prompts), rtol=1e-5, atol=1e-5
    )
