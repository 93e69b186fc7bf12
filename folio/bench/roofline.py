"""The FLOP ceiling of a workload on this machine: the model's matmul FLOPs over a measured matmul rate.

A decoder's work is almost all matmuls (projections, MLP, LM head), so "tokens per second if every FLOP ran at
the machine's measured float32 GEMM rate" bounds any engine. Attention's own FLOPs (about 4% at W1's lengths)
are left out, as in the issue's estimate, so the ceiling is slightly generous.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from folio.kernels.cpu_kernels import CPU_KERNEL_DTYPES, load_cpu_kernels
from folio.kernels.isa import IsaTier
from folio.model.spec import ModelSpec


@dataclass
class ModelFlops:
    per_token_layers: int  # FLOPs of all decoder layers' matmuls for one token
    lm_head: int  # FLOPs of the LM head for one token whose logits are needed

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelFlops:
        """2 FLOPs per weight per token: q|k|v, o, gate|up, down in each layer; hidden x vocab for the head."""
        hidden, inter = spec.hidden_size, spec.intermediate_size
        per_layer = hidden * (spec.q_size + 2 * spec.kv_size) + spec.q_size * hidden + 3 * hidden * inter
        return cls(per_token_layers=2 * per_layer * spec.num_hidden_layers, lm_head=2 * hidden * spec.vocab_size)

    def request_flops(self, prompt_len: int, output_len: int) -> int:
        """A request runs prompt_len + output_len - 1 tokens through the layers and needs output_len logits rows."""
        return (prompt_len + output_len - 1) * self.per_token_layers + output_len * self.lm_head


def measure_matmul_flops(
    size: int = 2048,
    repeats: int = 8,
    dtype: torch.dtype = torch.float32,
    tier: IsaTier | None = None,
    device: torch.device | str = "cpu",
) -> float:
    """Best FLOP/s of a size x size x size GEMM with torch's current thread count, over every CPU GEMM at hand
    (MKL's ``torch.mm``, oneDNN with a packed weight, and the engine's own packed GEMM of ``tier``, default this
    CPU's best) so the ceiling is the machine's, not one library's. On other devices ``torch.mm`` alone (cuBLAS),
    timed to the device's completion. Under ``--cpu-isa`` the CLI holds MKL and oneDNN to the same tier
    (folio.kernels.isa.library_isa_env)."""
    device = torch.device(device)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    candidates = [lambda: torch.mm(a, b)]
    if device.type == "cpu":
        folio_gemm = load_cpu_kernels(tier, dtype).gemm if dtype in CPU_KERNEL_DTYPES else None
        if folio_gemm is not None:
            packed = folio_gemm.pack_all([b])[0]
            candidates.append(lambda: folio_gemm.linear(a, packed, None))
        if torch.backends.mkldnn.is_available():
            onednn = torch.ops.mkldnn._reorder_linear_weight(b, size)
            candidates.append(lambda: torch.ops.mkldnn._linear_pointwise(a, onednn, None, "none", [], ""))
    best = float("inf")
    for gemm in candidates:
        gemm()  # warm-up
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            gemm()
            _synchronize(device)
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Ceiling:
    matmul_flops: float  # FLOP/s measured
    workload_flops: int
    output_tokens: int

    @property
    def seconds(self) -> float:
        return self.workload_flops / self.matmul_flops

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def workload_ceiling(spec: ModelSpec, lengths: list[tuple[int, int]], matmul_flops: float) -> Ceiling:
    """Ceiling for requests given as (prompt_len, output_len) pairs."""
    flops = ModelFlops.from_spec(spec)
    total = sum(flops.request_flops(p, o) for p, o in lengths)
    return Ceiling(matmul_flops=matmul_flops, workload_flops=total, output_tokens=sum(o for _, o in lengths))
