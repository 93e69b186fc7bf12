"""The fused CPU decoder (folio/model/cpu_fused.py) against the layer-by-layer model it replaces on the CPU.

Both run the same kernels in the same order, so the hidden states and every layer's K/V cache must be equal bit
for bit, over steps that mix fresh prefills, a prefill chunk after cached tokens and decodes; and so must the rows
of a step asked for alone (output_rows: the last layer past its attention for those rows only). The model is a random
one of SmolLM2's layer shapes (hidden 576, 9 query and 3 KV heads of 64, MLP 1536, tied embeddings) with 2 layers
and a small vocabulary: the same kernel paths as the real model, at a tenth of its load (two loads per tier and
dtype took most of tests/model's CPU).
"""

from __future__ import annotations

import pytest
import torch

from folio.attention.builder import build_attn_metadata, compute_positions
from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.isa import IsaTier
from folio.model.loader import load_model
from folio.worker.kv_cache_shape import KVCacheShape
from tests.tiny_models import SMOLLM2_LAYOUT, save_tiny_llama

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(
        tmp_path_factory.mktemp("fused"),
        vocab_size=1024,
        num_hidden_layers=2,
        max_position_embeddings=256,
        **SMOLLM2_LAYOUT,
    )


# (the model's dtype, the K/V cache's): each over a cache of its own, and float32 over bfloat16 (kv_cache_dtype)
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("dtype", "cache_dtype"), DTYPE_PAIRS, ids=["float32", "bfloat16", "float32_over_bf16_cache"])
def test_fused_decoder_equals_layer_by_layer(
    model_path: str, cpu_tier: IsaTier, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """On each tier whose plan has the fused decoder; on the others the model must run layer by layer. Over a
    bfloat16 cache both round the step's K/V to bfloat16 as they write them."""
    cpu = torch.device("cpu")
    kernels = load_cpu_kernels(cpu_tier, dtype)
    fused, spec = load_model(model_path, dtype, cpu, show_progress=False, cpu_kernels=kernels)
    if kernels.plan.fused_decoder != "folio":
        assert fused.model.fused_cpu is None
        pytest.skip(f"{cpu_tier.flag_name} {dtype}: the plan runs {kernels.plan.describe()}")
    eager, _ = load_model(model_path, dtype, cpu, show_progress=False, enforce_eager=True, cpu_kernels=kernels)
    assert fused.model.fused_cpu is not None and eager.model.fused_cpu is None
    shape = KVCacheShape(spec.num_hidden_layers, BLOCK_SIZE, spec.num_key_value_heads, spec.head_dim, cache_dtype, True)
    caches = {"fused": shape.allocate(64, cpu), "eager": shape.allocate(64, cpu)}
    # request -> its blocks (not contiguous, not in order)
    tables = [[3, 9, 1, 12, 30], [0, 7, 22, 5, 14, 2, 31], [4, 17], [8, 6, 11, 25]]
    tables += [list(range(49, 39, -1)), [50, 63, 51, 62, 52, 61, 53, 60, 54, 59, 55, 58, 56]]
    gen = torch.Generator().manual_seed(0)
    # (query_lens, seq_lens) per step; requests absent from a step have query 0
    steps = [
        ([40, 70, 0, 0], [40, 70, 0, 0]),  # two fresh prefills
        ([1, 25, 17, 0], [41, 95, 17, 0]),  # a decode, a chunk after 70 cached tokens, a fresh prefill
        ([1, 1, 1, 50], [42, 96, 18, 50]),  # three decodes and a prefill
        # more rows than the MLP takes at a time (fused.model.fused_cpu.mlp_rows: 256), with a tail
        ([1, 1, 1, 1, 150, 200], [43, 97, 19, 51, 150, 200]),
    ]
    assert fused.model.fused_cpu.mlp_rows < sum(steps[-1][0]) < 2 * fused.model.fused_cpu.mlp_rows
    for query_lens, seq_lens in steps:
        live = [i for i, q in enumerate(query_lens) if q > 0]
        q_lens, s_lens = [query_lens[i] for i in live], [seq_lens[i] for i in live]
        attn = build_attn_metadata(q_lens, s_lens, [tables[i] for i in live], BLOCK_SIZE)
        ids = torch.randint(0, spec.vocab_size, (sum(q_lens),), generator=gen)
        positions = torch.tensor(compute_positions(q_lens, s_lens))
        with torch.inference_mode():
            out_fused = fused(ids, positions, caches["fused"], attn)
            out_eager = eager(ids, positions, caches["eager"], attn)
        assert out_fused.dtype == dtype and out_fused.shape == (sum(q_lens), spec.hidden_size)
        assert torch.equal(out_fused, out_eager)
        for cache_fused, cache_eager in zip(caches["fused"], caches["eager"], strict=True):
            assert cache_fused.dtype == cache_dtype and torch.equal(cache_fused, cache_eager)
        # The step again (the same K/V rewritten), asking for a few rows: the last layer then runs past its
        # attention for those only. Each sequence's last row, in reverse, one twice; then none.
        ends = torch.tensor(q_lens).cumsum(0) - 1
        for rows in (torch.cat([ends.flip(0), ends[:1]]), torch.zeros(0, dtype=torch.int64)):
            with torch.inference_mode():
                some_fused = fused(ids, positions, caches["fused"], attn, output_rows=rows)
                some_eager = eager(ids, positions, caches["eager"], attn, output_rows=rows)
            assert torch.equal(some_fused, out_fused[rows]) and torch.equal(some_eager, out_fused[rows])
        for cache_fused, cache_eager in zip(caches["fused"], caches["eager"], strict=True):
            assert torch.equal(cache_fused, cache_eager)  # every row's K/V still written in the last layer
    assert all(cache.any() for cache in caches["fused"])  # every layer wrote its K/V


def test_the_kv_side_prefetch_budget_is_the_plans_unless_set(model_path: str, cpu_tier: IsaTier) -> None:
    """Unset (None), the fused decoder's GEMMs prefetch the next layer's K/V as the plan says: half the L3 (a
    negative budget) from AVX-512 on, none (0) at avx2; cpu_kv_prefetch_bytes, where set, wins on every tier."""
    dtype, cpu = torch.float32, torch.device("cpu")
    kernels = load_cpu_kernels(cpu_tier, dtype)
    for asked in (None, 0, 1 << 20):
        model, _ = load_model(
            model_path, dtype, cpu, show_progress=False, cpu_kernels=kernels, cpu_kv_prefetch_bytes=asked
        )
        fused = model.model.fused_cpu
        if fused is None:
            assert kernels.plan.kv_side_prefetch == "off"
            pytest.skip(f"{cpu_tier.flag_name}: the plan runs {kernels.plan.describe()}")
        plans_budget = -1 if kernels.plan.kv_side_prefetch == "folio" else 0
        assert fused.kv_prefetch_bytes == (plans_budget if asked is None else asked), asked
        # the plan the start-up line shows (folio/worker/worker.py) says what the decoder runs
        logged = kernels.plan.with_kv_prefetch_bytes(asked).kv_side_prefetch
        assert logged == ("off" if fused.kv_prefetch_bytes == 0 else "folio"), (asked, logged)


class _CountingGroup:
    """A rank group of one: its all-reduce leaves the sum (this rank's proj) as it is and counts the calls; the
    call numbered ``fail_at`` raises, as the shared-memory all-reduce does when a peer has died."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls, self.fail_at = 0, fail_at

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError(f"peer gone at all-reduce {self.calls}")
        return x


def test_the_fused_decoder_calls_the_row_parallel_all_reduce_and_raises_its_failure(
    model_path: str, cpu_tier: IsaTier
) -> None:
    """Under tensor parallelism the o and down projections carry their rank group; the fused decoder then calls
    its all-reduce after each of them (2 per layer per step) with the step's proj buffer, and a failure there stops
    the forward and is raised as it was (a group of one rank here: the sums leave proj as it is, so the output
    equals the plain forward's bit for bit)."""
    from folio.model.cpu_fused import FusedCpuDecoder

    dtype, cpu = torch.float32, torch.device("cpu")
    kernels = load_cpu_kernels(cpu_tier, dtype)
    model, spec = load_model(model_path, dtype, cpu, show_progress=False, cpu_kernels=kernels)
    if model.model.fused_cpu is None:
        pytest.skip(f"{cpu_tier.flag_name}: the plan runs {kernels.plan.describe()}")
    shape = KVCacheShape(spec.num_hidden_layers, BLOCK_SIZE, spec.num_key_value_heads, spec.head_dim, dtype, True)
    attn = build_attn_metadata([20], [20], [[2, 0]], BLOCK_SIZE)
    ids, positions = torch.arange(100, 120), torch.arange(20)
    with torch.inference_mode():
        expected = model(ids, positions, shape.allocate(4, cpu), attn)
    for fail_at in (None, 3):
        group = _CountingGroup(fail_at)
        for layer in model.model.layers:
            layer.self_attn.o_proj.group = layer.mlp.down_proj.group = group
        model.model.fused_cpu = FusedCpuDecoder.create(model.model, kernels)
        with torch.inference_mode():
            if fail_at is None:
                assert torch.equal(model(ids, positions, shape.allocate(4, cpu), attn), expected)
                assert group.calls == 2 * spec.num_hidden_layers
            else:
                with pytest.raises(ConnectionError, match="peer gone at all-reduce 3"):
                    model(ids, positions, shape.allocate(4, cpu), attn)
                assert group.calls == 3  # the forward stopped there: the last MLP and its all-reduce never ran
