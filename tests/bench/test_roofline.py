"""The FLOP ceiling's arithmetic on the default model's real shapes, and the matmul probe."""

from __future__ import annotations

import pytest
import torch

from folio.bench.roofline import ModelFlops, measure_matmul_flops, workload_ceiling
from folio.model.loader import default_model_path, read_model_spec


def test_smollm2_flops_per_token() -> None:
    spec = read_model_spec(default_model_path())
    flops = ModelFlops.from_spec(spec)
    # per layer: q|k|v 576 x 960, o 576 x 576, gate|up 576 x 3072, down 1536 x 576 weights; 30 layers; 2 FLOPs each
    assert flops.per_token_layers == 2 * 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576) == 212_336_640
    assert flops.lm_head == 2 * 576 * 49152
    # 3 prompt tokens + 2 outputs: 4 tokens through the layers, 2 rows of logits
    assert flops.request_flops(3, 2) == 4 * flops.per_token_layers + 2 * flops.lm_head


def test_ceiling_scales_with_the_measured_rate() -> None:
    spec = read_model_spec(default_model_path())
    rate = measure_matmul_flops(size=256, repeats=2)
    assert rate > 1e8  # any CPU that runs the tests does more than 0.1 GFLOP/s
    ceiling = workload_ceiling(spec, [(10, 5), (20, 5)], matmul_flops=1e11)
    flops = ModelFlops.from_spec(spec)
    assert ceiling.workload_flops == flops.request_flops(10, 5) + flops.request_flops(20, 5)
    assert ceiling.output_tokens_per_second == 10 / (ceiling.workload_flops / 1e11)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpus_rate_is_timed_to_the_gemms_completion() -> None:
    # timed at the launch instead, a 4096^3 GEMM (137 GFLOP) would come out at some 1e16 FLOP/s
    rate = measure_matmul_flops(size=4096, repeats=3, dtype=torch.bfloat16, device="cuda")
    assert 1e12 < rate < 2e15, rate  # an H100's dense bfloat16 peak is about 1e15
