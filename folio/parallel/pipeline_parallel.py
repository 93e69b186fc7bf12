"""Pipeline parallelism as a pass over a loaded Llama-family model: each rank keeps one stage of contiguous
decoder layers (vLLM's even split, folio/parallel/stages.py) and its KV cache for those layers only; the stages
hand the activations on with torch.distributed point-to-point messages (gloo over TCP on the CPU, NCCL on CUDA).

Per step, every stage runs the same SchedulerOutput:
    stage 0        embed -> its layers -> send (hidden, residual) to stage 1
    stage k        recv from k - 1 -> its layers -> send to k + 1
    last stage     recv -> its layers -> final norm -> LM head and sampling (the ModelRunner, as with one rank)
The message is one [2, T, hidden] tensor (the layer output and the residual stream before it: the residual add is
left to the next layer's norm, llama.py's layout). Every stage knows T from its own copy of the step, so nothing
but the activations crosses. Sends are asynchronous (a gloo send waits until the peer posts its receive), so a
stage can start its next micro-batch while the next stage still works on this one (the engine core keeps up to
pp batches in flight: folio/engine/batch_queue.py). With tensor parallelism too (tp * pp ranks), each stage is tp
ranks that split its layers (folio/parallel/tensor_parallel.py, applied first), and tensor-parallel rank i of a
stage sends to rank i of the next (each holds the whole activations after its all-reduces). The model code
(llama.py) knows none of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from folio.attention.metadata import AttnMetadata
from folio.kernels.cpu_kernels import CpuKernels
from folio.model.layers.cpu_gemm import pack_weights
from folio.model.layers.linear import Linear
from folio.model.llama import LlamaForCausalLM, LlamaModel
from folio.parallel.group import RankGroup, init_rank_group, with_cpu_allreduce
from folio.parallel.stages import stage_layer_range
from folio.parallel.tensor_parallel import TensorParallelLlamaForCausalLM


@dataclass
class PipelineStage:
    """This rank's place in the pipeline and the channel to its neighbours: the ranks of the same tensor-parallel
    rank in the previous and next stages (rank -+ tp; every rank of a stage holds the whole activations)."""

    pp_rank: int
    pp_size: int
    tp_size: int
    world: RankGroup  # every rank of the engine (the KV block count is agreed over all of them)
    _pending_send: tuple[Any, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def send_activations(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Sends [2, T, hidden] to the next stage without waiting for it to arrive; the previous send is waited
        for first (one in flight: they reach the peer in order, and the buffer lives until sent)."""
        self.wait_sent()
        message = torch.stack([hidden, residual])
        work = dist.isend(message, self.world.rank + self.tp_size, group=self.world.group)
        self._pending_send = (work, message)

    def recv_activations(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual), each [T, hidden], from the previous stage (blocks until they arrive)."""
        message = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        dist.recv(message, self.world.rank - self.tp_size, group=self.world.group)
        return message[0], message[1]

    def wait_sent(self) -> None:
        if self._pending_send is not None:
            self._pending_send[0].wait()
            self._pending_send = None


def init_pipeline_ranks(
    rank: int,
    tp_size: int,
    pp_size: int,
    port: int,
    device_type: str,
    host: str = "127.0.0.1",
    cpu_allreduce: str = "gloo",
) -> tuple[RankGroup, PipelineStage]:
    """Joins the engine's group of tp * pp ranks, then its stage's tensor-parallel group (rank = pp_rank * tp +
    tp_rank: folio/parallel/stages.py). Every rank creates every stage's group, in order (torch.distributed's rule).
    ``cpu_allreduce`` applies to the tensor-parallel group (the world group carries no model collectives)."""
    world = init_rank_group(rank, tp_size * pp_size, port, device_type, host=host)
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = RankGroup(0, 1)
    if tp_size > 1:
        for stage in range(pp_size):
            group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == pp_rank:
                tp_group = RankGroup(tp_rank, tp_size, group)
        tp_group = with_cpu_allreduce(tp_group, device_type, cpu_allreduce)
    return tp_group, PipelineStage(pp_rank, pp_size, tp_size, world)


class PipelineStageLlamaModel(LlamaModel):
    """A LlamaModel after the pass: ``layers`` holds this stage's layers only. Never constructed (re-classed)."""

    pp_stage: PipelineStage
    pp_layer_range: tuple[int, int]
    pp_hidden_size: int
    pp_dtype: torch.dtype  # the activations' (the model's) dtype and device, for the buffers received
    pp_device: torch.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn: AttnMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states of ``output_rows`` on the last stage (LlamaModel.forward); elsewhere
        this stage's output [T, hidden] (already sent on: every row goes on)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for this stage's {len(self.layers)} layers")
        stage = self.pp_stage
        hidden: torch.Tensor
        residual: torch.Tensor | None
        if stage.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = stage.recv_activations(
                positions.shape[0], self.pp_hidden_size, self.pp_dtype, self.pp_device
            )
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        kept = output_rows if stage.is_last else None
        hidden, residual = self.run_layers(hidden, residual, cos, sin, kv_caches, attn, kept)
        if not stage.is_last:
            stage.send_activations(hidden, residual)
            return hidden
        normed: torch.Tensor = self.norm.add_and_norm(hidden, residual)[0]
        return normed


class PipelineStageLlamaForCausalLM(LlamaForCausalLM):
    """A LlamaForCausalLM after the pass. Never constructed: the pass re-classes the loaded model."""

    pp_stage: PipelineStage

    def pack_for_cpu(self, kernels: CpuKernels) -> None:
        """The last stage packs as one rank does (its layers and the LM head); the others only their layers."""
        if self.pp_stage.is_last:
            super().pack_for_cpu(kernels)
            return
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        packed = pack_weights([m.weight.data for m in linears], kernels)
        for module, packed_weight in zip(linears, packed, strict=True):
            module.adopt_packed(packed_weight)


class PipelineStageTensorParallelLlamaForCausalLM(PipelineStageLlamaForCausalLM, TensorParallelLlamaForCausalLM):
    """A stage of a tensor-parallel model (both passes applied). Never constructed."""


def apply_pipeline_parallel(model: LlamaForCausalLM, stage: PipelineStage) -> None:
    """Keeps stage ``stage.pp_rank``'s layers: the embedding on the first stage (and on the last where the LM head
    is the tied embedding), the final norm and the LM head on the last. Call after the weights are loaded (and
    after the tensor-parallel pass, if any) and before the CPU packing; the dropped layers' weights are freed with
    the modules."""
    inner = model.model
    start, end = stage_layer_range(len(inner.layers), stage.pp_rank, stage.pp_size)
    inner.layers = torch.nn.ModuleList(list(inner.layers)[start:end])
    tied = model.lm_head is None
    if not stage.is_first and not (stage.is_last and tied):
        inner.embed_tokens = None  # type: ignore[assignment]
    if not stage.is_last:
        inner.norm = None  # type: ignore[assignment]
        model.lm_head = None  # never read: only the last stage computes logits
    weight = next(inner.layers.parameters())  # the model's dtype and device
    inner.__class__ = PipelineStageLlamaModel
    # after the tensor-parallel pass the model keeps its vocab-parallel logits and arg-max
    model.__class__ = (
        PipelineStageTensorParallelLlamaForCausalLM
        if isinstance(model, TensorParallelLlamaForCausalLM)
        else PipelineStageLlamaForCausalLM
    )
    assert isinstance(inner, PipelineStageLlamaModel) and isinstance(model, PipelineStageLlamaForCausalLM)
    inner.pp_stage, inner.pp_layer_range, inner.pp_hidden_size = stage, (start, end), model.spec.hidden_size
    inner.pp_dtype, inner.pp_device = weight.dtype, weight.device
    model.pp_stage = stage
