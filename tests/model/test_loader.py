"""Loader: spec of the real GGUF, error messages, and tiny random Hugging Face checkpoints vs transformers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from folio.attention.builder import assign_contiguous_blocks, build_attn_metadata, compute_positions
from folio.model.llama import LlamaForCausalLM
from folio.model.loader import load_model, load_tokenizer, read_model_spec
from folio.model.spec import ModelSpec
from tests.tiny_models import TINY_SHAPE

# ---------------------------------------------------------------------------------------------- real GGUF spec


def test_spec_of_default_gguf(default_model_path: str) -> None:
    spec = read_model_spec(default_model_path)
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.vocab_size, spec.hidden_size, spec.intermediate_size) == (49152, 576, 1536)
    assert (spec.num_hidden_layers, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.max_position_embeddings == 8192
    assert spec.rope_theta == 100000.0
    assert spec.rope_scaling is None
    assert spec.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert spec.tie_word_embeddings is True
    assert spec.attention_bias is False
    assert (spec.bos_token_id, spec.eos_token_ids) == (1, [2])
    assert spec.checkpoint_dtype == "float32"


# ---------------------------------------------------------------------------------------------- error messages


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.gguf")
    for fn in (read_model_spec, load_tokenizer, lambda p: load_model(p, torch.float32, torch.device("cpu"))):
        with pytest.raises(FileNotFoundError, match="nope.gguf"):
            fn(missing)


def test_dir_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*no config.json"):
        read_model_spec(str(tmp_path))


def test_garbage_file_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ValueError, match="garbage.gguf: not a GGUF file"):
        read_model_spec(str(path))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(str(path))


@pytest.mark.parametrize("keep_bytes", [100_000, 50_000_000])
def test_truncated_gguf(default_model_path: str, tmp_path: Path, keep_bytes: int) -> None:
    """Cut in the header (tokenizer arrays) or in the tensor data: both name the file and say truncated."""
    path = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as src:
        path.write_bytes(src.read(keep_bytes))
    with pytest.raises(ValueError, match="cut.gguf: GGUF file is truncated"):
        load_model(str(path), torch.float32, torch.device("cpu"))


def _write_config(directory: Path, **overrides: Any) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    config.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))


def test_unknown_architecture_is_named_with_supported_list(tmp_path: Path) -> None:
    _write_config(tmp_path, architectures=["FooForCausalLM"])
    with pytest.raises(ValueError, match="'FooForCausalLM'.*supported: LlamaForCausalLM, MistralForCausalLM"):
        read_model_spec(str(tmp_path))


def test_dir_without_safetensors(tmp_path: Path) -> None:
    _write_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no \\*.safetensors"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_corrupt_safetensors(tmp_path: Path) -> None:
    _write_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated safetensors"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- tiny HF models

_TINY = TINY_SHAPE  # tests/tiny_models.py


def _save_tiny(kind: str, directory: Path, max_shard_size: str | None = None) -> Any:
    """A random transformers model of the given kind saved as safetensors into directory; returns it (eval)."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config: Any = transformers.LlamaConfig(**_TINY, rms_norm_eps=1e-5)
    elif kind == "llama3_rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        config = transformers.LlamaConfig(**_TINY, rope_parameters=rope)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**_TINY, tie_word_embeddings=True)
    elif kind == "mistral":
        config = transformers.MistralConfig(**_TINY, sliding_window=None)
    else:
        raise AssertionError(kind)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0; randomize so a mix-up would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.3)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


def _compare_with_transformers(hf_model: Any, path: str, prompts: list[list[int]], block_size: int) -> float:
    """Prefill all prompts in one flattened batch, then one decode step for all; returns the max abs diff."""
    model, spec = load_model(path, torch.float32, torch.device("cpu"), show_progress=False)
    seq_lens = [len(p) + 1 for p in prompts]
    tables = assign_contiguous_blocks(seq_lens, block_size)
    num_blocks = sum(len(t) for t in tables)
    kv_caches = [
        torch.zeros(2, num_blocks, block_size, spec.num_key_value_heads, spec.head_dim)
        for _ in range(spec.num_hidden_layers)
    ]
    next_ids = [7, 11, 13, 17][: len(prompts)]
    max_diff = 0.0
    with torch.no_grad():
        lens = [len(p) for p in prompts]
        attn = build_attn_metadata(lens, lens, tables, block_size)
        positions = torch.tensor(compute_positions(lens, lens))
        hidden = model(torch.tensor(sum(prompts, [])), positions, kv_caches, attn)
        logits = model.compute_logits(hidden)
        expected = torch.cat([hf_model(torch.tensor([p])).logits[0] for p in prompts])
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        max_diff = max(max_diff, (logits - expected).abs().max().item())

        attn = build_attn_metadata([1] * len(prompts), seq_lens, tables, block_size)
        positions = torch.tensor(compute_positions([1] * len(prompts), seq_lens))
        logits = model.compute_logits(model(torch.tensor(next_ids), positions, kv_caches, attn))
        expected = torch.cat(
            [hf_model(torch.tensor([p + [t]])).logits[0, -1:] for p, t in zip(prompts, next_ids, strict=True)]
        )
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        max_diff = max(max_diff, (logits - expected).abs().max().item())
    return max_diff


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen2", "mistral"])
def test_tiny_model_matches_transformers(kind: str, tmp_path: Path) -> None:
    hf_model = _save_tiny(kind, tmp_path)
    prompts = [
        [1, 5, 9, 2, 40, 41, 3],
        [1, 60],
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    ]
    _compare_with_transformers(hf_model, str(tmp_path), prompts, block_size=4)


def test_tiny_spec_from_config(tmp_path: Path) -> None:
    _save_tiny("qwen2", tmp_path)
    spec = read_model_spec(str(tmp_path))
    assert spec == ModelSpec(
        architecture="Qwen2ForCausalLM",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_bias=True,
        bos_token_id=spec.bos_token_id,
        eos_token_ids=spec.eos_token_ids,
        checkpoint_dtype="float32",
    )


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf_model = _save_tiny("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _compare_with_transformers(hf_model, str(tmp_path), [[1, 2, 3]], block_size=2)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    _save_tiny("llama", tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{tmp_path}.*missing tensors: model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), show_progress=False)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    _save_tiny("llama", tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    os.remove(shard)
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), show_progress=False)


def test_bfloat16_load(tmp_path: Path) -> None:
    _save_tiny("llama", tmp_path)
    model, _ = load_model(str(tmp_path), torch.bfloat16, torch.device("cpu"), show_progress=False)
    assert isinstance(model, LlamaForCausalLM)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_hf_dir_tokenizer(tmp_path: Path, tokenizer: Any) -> None:
    tokenizer.save_pretrained(tmp_path)
    _write_config(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.encode("Hello world") == tokenizer.encode("Hello world")
    shutil.rmtree(tmp_path)


def test_unknown_gguf_architecture_is_named(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mamba.gguf: unsupported GGUF architecture 'mamba'; supported: llama"):
        read_model_spec(str(path))


def test_config_variants(tmp_path: Path) -> None:
    """Old-style rope keys (top-level rope_theta, rope_scaling with "type"), bf16 dtype, EOS ids merged from
    generation_config.json, Qwen2's implied q/k/v bias, Mistral's sliding window capping the context."""
    rope = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip
    _write_config(tmp_path, rope_theta=500000.0, rope_scaling=rope, torch_dtype="bfloat16", eos_token_id=[2, 3])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    spec = read_model_spec(str(tmp_path))
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "llama3"
    assert spec.checkpoint_dtype == "bfloat16"
    assert spec.eos_token_ids == [2, 3, 9]
    assert spec.attention_bias is False

    _write_config(tmp_path, architectures=["Qwen2ForCausalLM"])
    assert read_model_spec(str(tmp_path)).attention_bias is True
    _write_config(tmp_path, architectures=["MistralForCausalLM"], max_position_embeddings=32768, sliding_window=4096)
    assert read_model_spec(str(tmp_path)).max_position_embeddings == 4096
    _write_config(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        read_model_spec(str(tmp_path))
