"""Linear layers whose weights are filled from checkpoints, including fused projections.

Fusing q/k/v into one matmul and gate/up into another saves kernel launches and reads the activation once.
A checkpoint stores the parts separately, so a fused layer loads each part ("shard") into its own row range.
Weights are created with ``torch.empty`` (no random init): the loader overwrites every one.
Tensor parallelism, when it comes, splits these rows/columns here, not in the model code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from folio.kernels.cpu_kernels import CpuKernels
from folio.model.layers.cpu_gemm import pack_weight, packed_linear


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed_weight: Any = None  # set by pack_for_cpu / adopt_packed (folio.model.layers.cpu_gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self, kernels: CpuKernels) -> None:
        """Packs the loaded weight (folio.model.layers.cpu_gemm) and releases the plain copy, so the model's
        memory does not double. Call once, after the weights are loaded; the layer can't be reloaded afterwards."""
        self.adopt_packed(pack_weight(self.weight.data, kernels))

    def adopt_packed(self, packed: Any) -> None:
        """Takes this layer's weight in packed form (made by the model, which packs all its layers at once)."""
        self.packed_weight = packed
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim, e.g. gate|up or q|k|v.

    shard_sizes {"q": 576, "k": 192, "v": 192} -> rows q [0, 576), k [576, 768), v [768, 960).
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (start, size)
            start += size

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """Copies one part (weight [size, in] or bias [size]) into its row range of the fused param."""
        start, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, start, size)
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Splits the fused output [T, sum(sizes)] back into its parts (views, in shard order)."""
        return list(y.split([size for _, size in self.shard_offsets.values()], dim=-1))
