"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) in plain torch, over a flattened batch and a paged KV cache.

One step's tokens from all requests are flattened into T rows; the model never sees request boundaries
except through AttnMetadata, which only the attention backend reads. Per layer:

    h = h + o_proj(attention(rope(q), rope(k), v))   with q|k|v = qkv_proj(rms_norm(h))
    h = h + down_proj(silu(gate) * up)               with gate|up = gate_up_proj(rms_norm(h))

Qwen2 differs only by a bias on q/k/v (spec.attention_bias). Checkpoint tensors use Hugging Face names;
``load_weights`` routes q/k/v and gate/up into the fused projections.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from folio.attention.backends.base import AttentionBackend
from folio.attention.metadata import AttnMetadata
from folio.kernels.cpu_gemm import ArgmaxScreen, Codes8Head, PackedWeight
from folio.kernels.cpu_kernels import CpuKernels
from folio.kernels.isa import IsaTier
from folio.model.cpu_fused import FusedCpuDecoder
from folio.model.layers.activation import silu_and_mul
from folio.model.layers.cpu_gemm import pack_weights, packed_linear
from folio.model.layers.embedding import VocabEmbedding, compute_lm_logits
from folio.model.layers.linear import Linear, MergedLinear
from folio.model.layers.norm import RMSNorm
from folio.model.layers.rotary import RotaryEmbedding, apply_rotary_
from folio.model.spec import ModelSpec

# (fused param, checkpoint part, shard id): "...self_attn.q_proj.weight" -> "...self_attn.qkv_proj.weight" shard "q".
_FUSED_PARTS = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
]
# Tensors some checkpoints carry that the model derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    cpu_kernels: CpuKernels | None = None  # the fused rotary, where the CPU plan chose it (cpu_binding.py)

    def __init__(self, spec: ModelSpec, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = spec.num_attention_heads
        self.num_kv_heads = spec.num_key_value_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = MergedLinear(
            spec.hidden_size, {"q": spec.q_size, "k": spec.kv_size, "v": spec.kv_size}, bias=spec.attention_bias
        )
        self.o_proj = Linear(spec.q_size, spec.hidden_size)
        self.attn_backend = attn_backend

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttnMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        # q, k, v are views of the fused projection's output, rotated in place
        q = apply_rotary_(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin, self.cpu_kernels)
        k = apply_rotary_(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin, self.cpu_kernels)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn_backend.forward(q, k, v, kv_cache, attn, self.scale)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    cpu_kernels: CpuKernels | None = None  # the fused SiLU-and-mul, where the CPU plan chose it (cpu_binding.py)

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = MergedLinear(spec.hidden_size, {"gate": size, "up": size})
        self.down_proj = Linear(size, spec.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden), self.cpu_kernels))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = LlamaAttention(spec, attn_backend)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = LlamaMLP(spec)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the previous layer's output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before that output, None for layer 0
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttnMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it): the residual add is left to the
        next norm, which fuses it (vLLM's layout; one pass over the activations instead of two). With
        ``output_rows`` (the last layer) every row's K/V is written, and both come back for those rows only."""
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(normed, cos, sin, kv_cache, attn)
        if output_rows is not None:
            hidden, residual = hidden[output_rows], residual[output_rows]
        normed, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, attn_backend) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.fused_cpu: FusedCpuDecoder | None = None  # set by enable_fused_cpu

    def enable_fused_cpu(self, kernels: CpuKernels, kv_prefetch_bytes: int | None = None) -> bool:
        """Runs the decoder layers through the fused CPU decoder from now on, where it applies (CPU, float32 or
        bfloat16, weights packed by Folio's GEMM); returns whether it does. Call after pack_for_cpu."""
        self.fused_cpu = FusedCpuDecoder.create(self, kernels, kv_prefetch_bytes)
        return self.fused_cpu is not None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn: AttnMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states of ``output_rows`` (all rows when None), in that order. Only those rows
        run past the last layer's attention: a prefill chunk's other tokens need that layer's K/V, not its MLP."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # shared by every layer
        if self.fused_cpu is not None:  # the same layers in one C call (folio/model/cpu_fused.py)
            return self.fused_cpu.forward(hidden, cos, sin, kv_caches, attn, output_rows)
        hidden, residual = self.run_layers(hidden, None, cos, sin, kv_caches, attn, output_rows)
        return self.norm.add_and_norm(hidden, residual)[0]

    def run_layers(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn: AttnMetadata,
        output_rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers held here, layer by layer (LlamaDecoderLayer.forward's pair); the last one with
        ``output_rows``."""
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn, output_rows if i == last else None)
        assert residual is not None, "a model has at least one layer"
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.attn_backend = attn_backend  # shared by every layer; the worker asks it for the KV cache layout
        self.model = LlamaModel(spec, attn_backend)
        # Tied embeddings: compute_logits reads the embedding matrix; there is no separate lm_head.
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size)
        self.tied_lm_head_packed: Any = None  # set by pack_for_cpu when embeddings are tied
        self.lm_head_screen: ArgmaxScreen | None = None  # set by pack_for_cpu where the plan screens the arg-max
        self.lm_head_codes8: Codes8Head | None = None  # set by pack_for_cpu where the head is exactly 8-bit codes
        self.lm_head_codes8_screened = False  # set by pack_for_cpu where the plan screens those codes (int16, int8)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttnMetadata,
        output_rows: torch.Tensor | None = None,  # [R] int64: the rows the caller reads (LlamaModel.forward)
    ) -> torch.Tensor:  # [R, hidden] ([T, hidden] without output_rows), final norm applied
        return self.model(input_ids, positions, kv_caches, attn, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] float32
        if self.lm_head is not None and self.lm_head.packed_weight is not None:
            return packed_linear(hidden, self.lm_head.packed_weight, self.lm_head.bias, out_dtype=torch.float32)
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.tied_lm_head_packed is not None:
            return packed_linear(hidden, self.tied_lm_head_packed, None, out_dtype=torch.float32)
        return compute_lm_logits(hidden, self.model.embed_tokens.weight)

    def compute_greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, hidden] -> [S] int64 argmax of the logits, without materializing them (the CPU GEMM's arg-max over
        the packed LM head); None where that path is not available (the caller then computes the logits)."""
        head = self.tied_lm_head_packed if self.lm_head is None else self.lm_head.packed_weight
        if not isinstance(head, PackedWeight) or (self.lm_head is not None and self.lm_head.bias is not None):
            return None
        if (codes8 := self.lm_head_codes8) is not None:
            screened = (
                head.gemm.argmax_codes8_screened(hidden, codes8, head)[0] if self.lm_head_codes8_screened else None
            )
            if screened is not None:
                return screened
            # beyond one row tile the bfloat16 screen, where the plan has it, beats any float32 arg-max
            if (ids := head.gemm.argmax_codes8(hidden, codes8, self.lm_head_screen is None)) is not None:
                return ids
        return head.gemm.argmax(hidden, head, self.lm_head_screen)

    def pack_for_cpu(self, kernels: CpuKernels) -> None:
        """Packs every projection and the LM head (folio.model.layers.cpu_gemm), all in one arena; call after
        loading. A tied LM head gets a packed copy: the embedding lookup still needs the plain matrix."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        weights = [m.weight.data for m in linears]
        head_weight = self.model.embed_tokens.weight.data if self.lm_head is None else self.lm_head.weight.data
        plan = kernels.plan.lm_head_argmax
        if plan != "off" and kernels.gemm is not None and kernels.compact_weights:
            self.lm_head_codes8 = kernels.gemm.pack_codes8(head_weight, with_quads=plan == "folio_int8_screen")
            self.lm_head_codes8_screened = plan in ("folio_int16_screen", "folio_int8_screen")
        # the bfloat16 screen where the plan has it, or in place of an int8 screen that found no codes to run on
        bf16_in_place = (
            plan == "folio_int8_screen" and self.lm_head_codes8 is None and kernels.tier >= IsaTier.AVX512_BF16
        )
        if (plan == "folio_bf16_screen" or bf16_in_place) and kernels.gemm is not None:
            self.lm_head_screen = kernels.gemm.build_screen(head_weight, kernels.huge_pages)
        compact = [True] * len(weights)  # the projections may stay 4-bit codes; the LM head's arg-max reads float32
        if self.lm_head is None:
            weights.append(head_weight)
            compact.append(False)
        else:
            compact[linears.index(self.lm_head)] = False
        packed = pack_weights(weights, kernels, compact)
        for module, packed_weight in zip(linears, packed, strict=False):
            module.adopt_packed(packed_weight)
        if self.lm_head is None:
            self.tied_lm_head_packed = packed[-1]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (Hugging Face names) into the params, converting dtype and device.

        Raises ValueError for a tensor with no place in the model, a shape mismatch, or tensors left missing.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            self._load_one(params, name, tensor)
            loaded.add(name)
        missing = sorted(self.expected_weight_names() - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing tensors: {shown}")

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        for fused, part, shard_id in _FUSED_PARTS:
            if f".{part}." in name:
                fused_name = name.replace(f".{part}.", f".{fused}.")
                if fused_name not in params:
                    break
                module = self.get_submodule(fused_name.rsplit(".", 1)[0])  # "...self_attn.qkv_proj"
                assert isinstance(module, MergedLinear)
                module.load_shard(params[fused_name], tensor, shard_id)
                return
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(tensor)

    def expected_weight_names(self) -> set[str]:
        """The checkpoint tensor names (Hugging Face style) that together fill every parameter."""
        names: set[str] = set()
        for param_name, _ in self.named_parameters():
            parts = [(part, fused) for fused, part, _ in _FUSED_PARTS if f".{fused}." in param_name]
            if parts:
                names.update(param_name.replace(f".{fused}.", f".{part}.") for part, fused in parts)
            else:
                names.add(param_name)
        return names
