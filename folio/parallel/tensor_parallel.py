"""Tensor parallelism as a pass over a loaded Llama-family model (gpt-fast's way): every rank loads the whole
checkpoint, then keeps its slice of each weight and swaps in the layers that communicate.

Per decoder layer (rank r of tp):
    qkv_proj, gate_up_proj  column-parallel: rank r keeps the rows of its query heads, its KV heads, its slice of
                            the intermediate size; no communication.
    o_proj, down_proj       row-parallel: the matching input columns; the partial outputs are summed (all-reduce).
KV heads are split like the query heads; where tp > num_kv_heads each KV head is replicated on tp / num_kv_heads
ranks (vLLM's rule), so that every rank's query heads find their KV head locally. Where tp does not divide the
heads, vLLM refuses; with ``uneven_heads`` (--tensor-parallel-uneven-heads) the whole KV heads (with their query
heads) are dealt out as evenly as they go instead, as llama.cpp's row split takes uneven shares: the ranks then
differ in attention work and KV bytes per block (the ranks agree on the smallest block count). The embedding and
the LM head are vocab-parallel: rank r holds a slice of the vocabulary rows; a lookup outside the slice gives zeros
and the all-reduce fills them in; greedy decoding takes each rank's local (max logit, token) and all-gathers those
pairs, never the logits (only sampling with logits needs them gathered). The model code (llama.py) knows none of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from folio.model.layers.cpu_gemm import packed_linear
from folio.model.layers.embedding import VocabEmbedding
from folio.model.layers.linear import Linear, MergedLinear
from folio.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from folio.model.spec import ModelSpec
from folio.parallel.group import RankGroup


def check_tensor_parallel(spec: ModelSpec, tp: int, uneven_heads: bool = False) -> None:
    """Raises ValueError naming --tensor-parallel-size and the model's limit where tp cannot split the model.
    uneven_heads (--tensor-parallel-uneven-heads) also accepts a tp that splits the KV heads (each with its query
    heads) unevenly: any tp up to the KV heads, or a multiple of them up to the attention heads."""
    heads, kv_heads = spec.num_attention_heads, spec.num_key_value_heads
    splits_unevenly = tp <= kv_heads or (tp % kv_heads == 0 and tp <= heads)
    if uneven_heads and not splits_unevenly:
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size) {tp} with --tensor-parallel-uneven-heads must be at most "
            f"the model's number of KV heads {kv_heads}, or a multiple of it up to its number of attention heads "
            f"{heads}"
        )
    hint = " (or set --tensor-parallel-uneven-heads to split them unevenly)" if splits_unevenly else ""
    if not uneven_heads and heads % tp:
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size) {tp} must divide the model's number of attention heads "
            f"{heads}{hint}"
        )
    if not uneven_heads and (kv_heads % tp if tp <= kv_heads else tp % kv_heads) != 0:
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size) {tp} must divide the model's number of KV heads "
            f"{kv_heads} or be a multiple of it{hint}"
        )
    if spec.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size) {tp} must divide the model's intermediate size "
            f"{spec.intermediate_size}"
        )
    if spec.vocab_size < tp:
        raise ValueError(f"tensor_parallel_size (--tensor-parallel-size) {tp} exceeds the vocabulary {spec.vocab_size}")


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``tp`` keeps. Example, SmolLM2 (9 heads, 3 KV heads, intermediate 1536, vocab 49152)
    at tp=3, rank 1: query heads [3, 6), KV head [1, 2), intermediate [512, 1024), vocabulary [16384, 32768)."""

    q_heads: tuple[int, int]  # [start, end)
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @staticmethod
    def make(spec: ModelSpec, rank: int, tp: int, uneven_heads: bool = False) -> ShardPlan:
        """Whole KV heads go to ranks with their query heads (grouped-query attention: query head h reads KV head
        h // (heads / kv_heads)). tp <= kv_heads: rank r gets KV heads [r * kv / tp, (r + 1) * kv / tp), rounded
        down (uneven where tp does not divide them: SmolLM2's 3 at tp=2 give rank 0 one, rank 1 two). tp >
        kv_heads: tp / kv_heads ranks share each KV head (replicated, vLLM's rule) and split its query heads the
        same way. Where tp divides everything this is the even split."""
        check_tensor_parallel(spec, tp, uneven_heads)
        kv_heads = spec.num_key_value_heads
        group = spec.num_attention_heads // kv_heads
        if tp <= kv_heads:
            kv = _split(kv_heads, rank, tp)
            q = (kv[0] * group, kv[1] * group)
        else:
            ranks_per_kv_head = tp // kv_heads
            kv_head = rank // ranks_per_kv_head
            kv = (kv_head, kv_head + 1)
            first, last = _split(group, rank % ranks_per_kv_head, ranks_per_kv_head)
            q = (kv_head * group + first, kv_head * group + last)
        vocab_per_rank = -(-spec.vocab_size // tp)  # the last rank's slice is shorter where tp does not divide it
        vocab = (rank * vocab_per_rank, min(spec.vocab_size, (rank + 1) * vocab_per_rank))
        return ShardPlan(q, kv, _split(spec.intermediate_size, rank, tp), vocab)

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank holds (what its KV cache is sized by)."""
        return self.kv_heads[1] - self.kv_heads[0]


def _split(size: int, rank: int, parts: int) -> tuple[int, int]:
    """Rank's part of range(size) cut into ``parts`` contiguous pieces, sizes differing by at most one."""
    return rank * size // parts, (rank + 1) * size // parts


class RowParallelLinear(Linear):
    """y = all_reduce(x_r @ weight_r.T) + bias: this rank's input columns; the partial sums are added up."""

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None, group: RankGroup) -> None:
        nn.Module.__init__(self)  # Linear's own __init__ would allocate a full-size weight
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.packed_weight = None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight
        y = F.linear(x, self.weight) if packed is None else packed_linear(x, packed, None)
        self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(VocabEmbedding):
    """This rank's vocabulary rows [start, end); a token outside them looks up zeros, summed in by the all-reduce."""

    def __init__(self, weight: torch.Tensor, vocab: tuple[int, int], group: RankGroup) -> None:
        nn.Module.__init__(self)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start, self.vocab_end = vocab
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        hidden = F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(hidden)


class TensorParallelLlamaForCausalLM(LlamaForCausalLM):
    """A LlamaForCausalLM after the pass: its LM head holds this rank's vocabulary rows. Never constructed: the
    pass re-classes the loaded model (so every ``isinstance(model, LlamaForCausalLM)`` still holds)."""

    tp_group: RankGroup
    tp_vocab: tuple[int, int]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, end - start] float32
        return super().compute_logits(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab] float32: every rank's slice gathered (only for sampling that needs them)."""
        local = self._local_logits(hidden)
        slice_size = -(-self.spec.vocab_size // self.tp_group.world_size)
        if local.shape[1] < slice_size:  # the last rank's shorter slice, padded to gather equal shapes
            local = F.pad(local, (0, slice_size - local.shape[1]), value=float("-inf"))
        gathered = self.tp_group.all_gather(local)  # [tp, S, slice]
        return gathered.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, : self.spec.vocab_size]

    def compute_greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """Distributed arg-max: each rank's (max logit, token id) [2, S], all-gathered -> [tp, 2, S]; the winner is
        the highest value, the lowest rank on a tie (the first maximum, as torch.argmax over the full row)."""
        local = self._local_logits(hidden)
        values, indices = local.max(dim=-1)
        # token ids < 2**24 are exact in float32: one gather carries both
        pairs = torch.stack([values, (indices + self.tp_vocab[0]).to(values.dtype)])
        gathered = self.tp_group.all_gather(pairs)  # [tp, 2, S]
        winner = gathered[:, 0].argmax(dim=0)  # [S]
        return gathered[:, 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()


def apply_tensor_parallel(model: LlamaForCausalLM, group: RankGroup, uneven_heads: bool = False) -> None:
    """Keeps rank ``group.rank``'s slice of every weight and swaps in the communicating layers. Call after the
    weights are loaded and before the CPU packing (which packs whatever slices the layers hold)."""
    spec = model.spec
    plan = ShardPlan.make(spec, group.rank, group.world_size, uneven_heads)
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        head_dim = spec.head_dim
        q_rows = _rows(plan.q_heads, head_dim, 0)
        kv_rows = _rows(plan.kv_heads, head_dim, 0)
        _keep_rows(
            attn.qkv_proj,
            {"q": q_rows, "k": _shift(kv_rows, spec.q_size), "v": _shift(kv_rows, spec.q_size + spec.kv_size)},
        )
        attn.num_heads = plan.q_heads[1] - plan.q_heads[0]
        attn.num_kv_heads = plan.kv_heads[1] - plan.kv_heads[0]
        attn.o_proj = _row_parallel(attn.o_proj, q_rows, group)
        inter = plan.intermediate
        _keep_rows(mlp.gate_up_proj, {"gate": inter, "up": _shift(inter, spec.intermediate_size)})
        mlp.down_proj = _row_parallel(mlp.down_proj, inter, group)
    start, end = plan.vocab
    embed = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight.data[start:end].clone(), plan.vocab, group)
    if model.lm_head is not None:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.data[start:end].clone(), requires_grad=False)
        if model.lm_head.bias is not None:
            model.lm_head.bias = nn.Parameter(model.lm_head.bias.data[start:end].clone(), requires_grad=False)
    model.__class__ = TensorParallelLlamaForCausalLM
    assert isinstance(model, TensorParallelLlamaForCausalLM)
    model.tp_group, model.tp_vocab = group, plan.vocab


def _rows(heads: tuple[int, int], head_dim: int, offset: int) -> tuple[int, int]:
    return offset + heads[0] * head_dim, offset + heads[1] * head_dim


def _shift(span: tuple[int, int], offset: int) -> tuple[int, int]:
    return span[0] + offset, span[1] + offset


def _keep_rows(linear: MergedLinear, parts: dict[str, tuple[int, int]]) -> None:
    """Column-parallel: a fused projection keeps, per part, the given output rows of the full weight (and bias).
    Example: q|k|v at tp=3 of SmolLM2 rank 0 -> q rows [0, 192), k [576, 640), v [640, 704): weight [320, 576]."""
    spans = [parts[shard_id] for shard_id in linear.shard_offsets]
    linear.weight = nn.Parameter(torch.cat([linear.weight.data[a:b] for a, b in spans]), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.cat([linear.bias.data[a:b] for a, b in spans]), requires_grad=False)
    start = 0
    for shard_id, (a, b) in zip(list(linear.shard_offsets), spans, strict=True):
        linear.shard_offsets[shard_id] = (start, b - a)
        start += b - a


def _row_parallel(linear: Linear, columns: tuple[int, int], group: RankGroup) -> RowParallelLinear:
    weight = linear.weight.data[:, columns[0] : columns[1]].contiguous()
    return RowParallelLinear(weight, linear.bias, group)
