"""The fast backends (TorchBatchedBackend, the CPU C kernel, the Triton kernel) against the reference oracle on
random paged batches. The Triton kernel runs on CUDA where there is a GPU, else on CPU tensors through Triton's
interpreter (skipped where triton is not installed). The CPU kernel runs at this CPU's best tier here, and on
every tier it can run (generic, avx2, avx512, avx512_bf16: the cpu_tier fixture) in test_kernel_on_every_tier."""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass

import pytest
import torch

from folio.attention.backends.base import AttentionBackend
from folio.attention.backends.cpu_paged import CpuPagedBackend, load_paged_attention_kernel
from folio.attention.backends.torch_batched import TorchBatchedBackend
from folio.attention.backends.torch_ref import TorchReferenceBackend
from folio.attention.backends.triton_paged import TritonPagedBackend, triton_available
from folio.attention.builder import build_attn_metadata
from folio.attention.selector import get_attention_backend
from folio.kernels.cpu_build import native_tier
from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.isa import IsaTier

# The device-agnostic backends run on the GPU where there is one.
ACCEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _make_backend(name: str) -> AttentionBackend:
    if name == "torch_batched":
        return TorchBatchedBackend()
    if name == "triton_paged":
        if not triton_available():
            pytest.skip("triton is not installed")
        assert ACCEL_DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1", "set in tests/conftest.py"
        return TritonPagedBackend()
    kernel = load_paged_attention_kernel()
    assert kernel is not None, "the CPU kernel must build here (gcc is part of this machine and of CI)"
    return CpuPagedBackend(kernel)


def _skip_where_interpreted(backend_name: str, case: str) -> None:
    """Without a GPU the Triton kernel runs through Triton's interpreter, seconds per case: there the largest cases
    that repeat a covered shape run on the other backends only (CI time; on CUDA every case runs)."""
    if backend_name == "triton_paged" and ACCEL_DEVICE.type != "cuda":
        pytest.skip(f"{case}: too slow for Triton's interpreter; the same shapes run at other sizes")


def _device_of(backend_name: str) -> torch.device:
    return torch.device("cpu") if backend_name == "cpu_paged" else ACCEL_DEVICE


@pytest.fixture(params=["torch_batched", "cpu_paged", "triton_paged"])
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _compare(
    backend_name: str,
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    seed: int,
    heads: tuple[int, int],
    head_dim: int = 16,
    spare_table_columns: int = 0,
    fused_qkv: bool = False,
    head_major: bool = False,
) -> None:
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)  # non-contiguous block tables
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(pool[:n] + [0] * spare_table_columns)  # unused tail columns, as the runner leaves them
        pool = pool[n:]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)  # cached context
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    ref_cache = kv_cache.clone()
    expected = TorchReferenceBackend().forward(
        query, key, value, ref_cache, build_attn_metadata(query_lens, seq_lens, tables, block_size), scale
    )
    device = _device_of(backend_name)
    query, key, value, kv_cache = (t.to(device) for t in (query, key, value, kv_cache))
    if fused_qkv:
        query, key, value = _as_fused_views(query, key, value)
    fast_cache = kv_cache.clone()
    if head_major:  # the same values in head-major storage, as the worker allocates for the CPU kernel
        fast_cache = torch.empty(2, num_blocks, num_kv_heads, block_size, head_dim, device=device).transpose(2, 3)
        fast_cache.copy_(kv_cache)
    attn = build_attn_metadata(query_lens, seq_lens, tables, block_size, device)
    backend = _make_backend(backend_name)
    # The second call reuses the step plan, as the model's next layer does. Triton's kernel has no plan, and through
    # the interpreter each call takes seconds (half of this file's CPU): there it runs once.
    interpreted = backend_name == "triton_paged" and ACCEL_DEVICE.type != "cuda"
    for _ in range(1 if interpreted else 2):
        out = backend.forward(query, key, value, fast_cache, attn, scale)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_cache.cpu(), ref_cache, rtol=0, atol=0)


def _as_fused_views(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same values as views of one [T, (H + 2 KV) * D] buffer, strided rows: what the model passes."""
    num_tokens, head_dim = query.shape[0], query.shape[2]
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    q, k, v = fused.split([query[0].numel(), key[0].numel(), value[0].numel()], dim=1)
    return tuple(t.view(num_tokens, -1, head_dim) for t in (q, k, v))  # type: ignore[return-value]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (9, 3)])
def test_mixed_prefill_and_decode(backend_name: str, block_size: int, heads: tuple[int, int]) -> None:
    # fresh prefill, a chunk over a cached prefix, decodes of different lengths, a 3-token query, an empty one
    _compare(backend_name, [7, 5, 1, 1, 3, 0, 1], [7, 23, 1, 40, 18, 9, 17], block_size, seed=block_size, heads=heads)


@pytest.mark.parametrize("seed", range(12))
def test_random_batches(backend_name: str, seed: int) -> None:
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, 70) for _ in range(rng.randint(1, 10))]
    query_lens = [rng.choice([1, 1, s, rng.randint(0, s)]) for s in seq_lens]
    _compare(
        backend_name,
        query_lens,
        seq_lens,
        rng.choice([1, 2, 8, 16]),
        seed,
        heads=rng.choice([(6, 2), (9, 3), (8, 1)]),
        head_dim=rng.choice([16, 64, 40]),
        spare_table_columns=rng.choice([0, 3]),
    )


@pytest.mark.parametrize("seed", range(3))
def test_views_of_a_fused_qkv_output(backend_name: str, seed: int) -> None:
    # q/k/v as the model hands them over: strided views of the fused projection (the kernel reads q in place)
    _compare(backend_name, [6, 1, 1, 4, 1], [6, 30, 9, 20, 64], 4, seed=seed, heads=(9, 3), head_dim=64, fused_qkv=True)


@pytest.mark.parametrize("block_size", [5, 16, 32])
def test_long_prefills_and_chunks(backend_name: str, block_size: int) -> None:
    # several 16-row tiles per prompt, chunks starting mid-block after cached tokens, block sizes that are not 16
    if block_size == 16:
        _skip_where_interpreted(backend_name, "block size 16 (5 and 32 run)")
    _compare(backend_name, [150, 40, 17, 1], [150, 140, 33, 90], block_size, seed=block_size, heads=(9, 3), head_dim=64)


@pytest.mark.parametrize("seed", range(4))
def test_head_major_cache(seed: int) -> None:
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, 90) for _ in range(rng.randint(1, 9))]
    query_lens = [rng.choice([1, 1, s, rng.randint(0, s)]) for s in seq_lens]
    block_size = rng.choice([1, 4, 16])
    _compare("cpu_paged", query_lens, seq_lens, block_size, seed, heads=(9, 3), head_dim=64, head_major=True)
    _compare("torch_batched", query_lens, seq_lens, block_size, seed, heads=(6, 2), head_major=True)
    _compare("triton_paged", query_lens, seq_lens, block_size, seed, heads=(9, 3), head_dim=64, head_major=True)


def test_decode_only_batch(backend_name: str) -> None:
    _compare(backend_name, [1] * 16, [random.Random(i).randint(1, 100) for i in range(16)], 16, seed=5, heads=(9, 3))


def test_long_contexts_model_shapes(backend_name: str) -> None:
    # SmolLM2's heads (9 query / 3 KV of 64) at contexts past 1000 positions, some sharing a block size of 16
    rng = random.Random(7)
    seq_lens = [rng.randint(900, 1300) for _ in range(6)]
    _compare(backend_name, [1, 1, 1, 5, 1, 1], seq_lens, 16, seed=7, heads=(9, 3), head_dim=64)


def test_selector_picks_the_kernel_for_cpu_float32() -> None:
    # this CPU's best tier: the kernel from AVX2 up; torch's on the generic tier (aarch64, seen under qemu-aarch64)
    expected = CpuPagedBackend if native_tier() >= IsaTier.AVX2 else TorchBatchedBackend
    assert isinstance(get_attention_backend(torch.device("cpu"), torch.float32), expected)
    assert isinstance(get_attention_backend(torch.device("cpu"), torch.bfloat16), expected)
    assert isinstance(get_attention_backend(torch.device("cpu"), torch.float16), TorchBatchedBackend)


def test_selector_picks_the_kernel_from_the_avx2_tier(cpu_tier: IsaTier) -> None:
    # the C kernel has vectorised bodies from AVX2 up; the generic build's plain loops lose to torch's prefill
    backend = get_attention_backend(torch.device("cpu"), torch.float32, load_cpu_kernels(cpu_tier, torch.float32))
    assert isinstance(backend, CpuPagedBackend if cpu_tier >= IsaTier.AVX2 else TorchBatchedBackend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_selector_picks_triton_on_cuda() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert isinstance(get_attention_backend(torch.device("cuda"), dtype), TritonPagedBackend)


def test_kernel_backend_rejects_other_dtypes() -> None:
    backend = _make_backend("cpu_paged")
    attn = build_attn_metadata([1], [1], [[0]], 4)
    q = torch.zeros(1, 2, 8, dtype=torch.float16)
    kv = torch.zeros(1, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        backend.forward(q, kv, kv, torch.zeros(2, 1, 4, 2, 8, dtype=torch.float16), attn, 1.0)


def test_kernel_backend_writes_a_head_major_cache_in_place() -> None:
    """Without the fused K/V write (a plan whose element-wise ops are torch's, as on the avx2 tier), the step's K/V
    still go into the head-major cache in place: a copy of the cache per layer and step made 12 greedy requests
    on the avx2 tier take 65 s instead of 1 s."""
    cache = torch.zeros(2, 512, 3, 16, 64).transpose(2, 3)  # 6 MiB per half, head-major as the worker allocates
    attn = build_attn_metadata([1, 1], [5, 40], [[3], [7, 9, 11]], 16)
    query, kv = torch.randn(2, 9, 64), torch.randn(2, 3, 64)
    backend = _make_backend("cpu_paged")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        backend.forward(query, kv, kv, cache, attn, 0.125)
    assert max(event.cpu_memory_usage for event in prof.events()) < cache[0].numel()  # bytes: under a quarter
    torch.testing.assert_close(cache[1, 11, 7], kv[1], rtol=0, atol=0)  # position 39: block 11, offset 7


@pytest.mark.parametrize("kernel", ["cpu_paged", "triton_paged"])
@pytest.mark.parametrize("seed", range(12))
def test_kernel_with_bfloat16_cache(kernel: str, seed: int) -> None:
    """A bfloat16 model: bf16 queries and cache; the oracle runs in float32 on the same (bf16-rounded) values. The
    kernel's sums are float32; what differs is the output's final rounding to bf16 and, in multi-token queries
    (the AVX512-BF16 dot-product tile), the softmax weights rounded to bf16 before they multiply V. Seeds 6-11
    reach past the tile's 128-position context blocks (prompts and chunks of up to 400), with group sizes 1-7 so
    that every remainder of its pair blocks runs, in both cache layouts."""
    if seed in (9, 11):
        _skip_where_interpreted(kernel, f"seed {seed} (long contexts: seeds 6-8 and 10 run)")
    rng = random.Random(seed)
    long = seed >= 6
    seq_lens = [rng.randint(100, 400) if long else rng.randint(1, 90) for _ in range(rng.randint(1, 8))]
    query_lens = [rng.choice([1, 1, s, rng.randint(0, s)]) for s in seq_lens]
    block_size = rng.choice([4, 16])
    num_heads, num_kv_heads = rng.choice([(9, 3), (6, 2), (8, 2), (7, 7), (14, 2)] if long else [(9, 3), (6, 2)])
    head_dim = 128 if seed % 6 >= 4 else 64
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    tables, next_block = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(list(range(next_block, next_block + n))[::-1])  # reversed: non-contiguous order
        next_block += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).bfloat16()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).bfloat16()
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).bfloat16()
    attn = build_attn_metadata(query_lens, seq_lens, tables, block_size)
    scale = head_dim**-0.5
    ref_cache = kv_cache.float()
    expected = TorchReferenceBackend().forward(query.float(), key.float(), value.float(), ref_cache, attn, scale)
    device = _device_of(kernel)
    query, key, value, kv_cache = (t.to(device) for t in (query, key, value, kv_cache))
    if seed % 2:
        query, key, value = _as_fused_views(query, key, value)
    fast_cache = kv_cache.clone()
    if seed % 3 == 0:  # head-major storage, as the worker allocates it
        fast_cache = torch.empty(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=torch.bfloat16, device=device)
        fast_cache = fast_cache.transpose(2, 3)
        fast_cache.copy_(kv_cache)
    attn = build_attn_metadata(query_lens, seq_lens, tables, block_size, device)
    out = _make_backend(kernel).forward(query, key, value, fast_cache, attn, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fast_cache.float().cpu(), ref_cache, rtol=0, atol=0)


# ---- The C kernel on every ISA tier this CPU can run ----------------------------------------------------------
# Each case runs once per tier (test ids: test_kernel_on_every_tier[avx2-gqa3_f32_d64], ...) against the oracle,
# which runs once per case. The shapes reach every body: the vectorised decode and prefill bodies of each tier
# (head_dim 64 and 128, GQA groups 1-8), the plain loops (head_dim 40 and 16), context tails that are not
# multiples of the block size, of 8 (AVX2 chunks) or of 16 (AVX-512 chunks), contexts past the prefill tile's
# 128-position blocks, single-position contexts and zero-length queries.


@dataclass(frozen=True)
class KernelCase:
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_size: int
    heads: tuple[int, int]  # (query heads, KV heads)
    head_dim: int
    bf16: bool = False  # bfloat16 queries and cache (the oracle runs in float32 on the same rounded values)
    kv_bf16: bool = False  # float32 queries over a bfloat16 cache (kv_cache_dtype="bfloat16" under a float32 model)
    head_major: bool = False  # the cache layout the worker allocates for the kernel
    fused_qkv: bool = False  # q/k/v as strided views of one buffer, as the model passes them
    query_gain: float = 1.0  # 100: scores of hundreds, so the softmax saturates (one weight near 1, most 0)


# decodes at contexts 1, 9, 37, 130; a fresh 13-token prefill; a zero-length query; a 19-token chunk after 22
# cached positions (a chunk starting mid-block)
_MIXED = {"query_lens": (1, 1, 1, 13, 0, 1, 19), "seq_lens": (1, 9, 37, 13, 5, 130, 41)}


def _kernel_cases() -> dict[str, KernelCase]:
    cases: dict[str, KernelCase] = {}
    for group in range(1, 9):  # every GQA group size the decode bodies unroll, both dtypes and head dims
        for bf16 in (False, True):
            head_dim = 64 if (group + bf16) % 2 else 128
            name = f"gqa{group}_{'bf16' if bf16 else 'f32'}_d{head_dim}"
            cases[name] = KernelCase(**_MIXED, block_size=16, heads=(2 * group, 2), head_dim=head_dim, bf16=bf16,
                                     head_major=group % 2 == 0, fused_qkv=group % 3 == 0)  # fmt: skip
    for bf16 in (False, True):
        kind = "bf16" if bf16 else "f32"
        # block size 5: every chunk of 8 or 16 positions spans blocks, the blocks' ends are tails
        cases[f"block5_tails_{kind}"] = KernelCase(
            (1, 1, 1, 1, 1, 1, 7, 3), (2, 7, 8, 9, 16, 17, 33, 63), 5, (9, 3), 64, bf16=bf16, head_major=True
        )
        # head_dim 40 and 16: the plain loops on every tier
        cases[f"head_dim40_{kind}"] = KernelCase(**_MIXED, block_size=16, heads=(6, 2), head_dim=40, bf16=bf16)
        cases[f"head_dim16_{kind}"] = KernelCase(**_MIXED, block_size=4, heads=(8, 1), head_dim=16, bf16=bf16)
        # several 16-row tiles and 128-position context blocks per prompt, chunks after cached tokens
        cases[f"long_prefills_{kind}"] = KernelCase(
            (150, 40, 17, 1), (150, 140, 33, 90), 16, (9, 3), 64, bf16=bf16, head_major=True, fused_qkv=True
        )
        cases[f"saturated_softmax_{kind}"] = KernelCase(**_MIXED, block_size=16, heads=(9, 3), head_dim=64,
                                                        bf16=bf16, query_gain=100.0)  # fmt: skip
    cases["single_positions"] = KernelCase((1, 1, 0, 1), (1, 1, 1, 2), 16, (9, 3), 64)
    # float32 queries, keys and values over a bfloat16 cache: the step's K/V rounded as they are written
    for group in (1, 3, 8):
        cases[f"gqa{group}_f32_over_bf16_cache"] = KernelCase(**_MIXED, block_size=16, heads=(2 * group, 2),
                                                              head_dim=64, kv_bf16=True, head_major=group == 3,
                                                              fused_qkv=group == 8)  # fmt: skip
    cases["block5_tails_f32_over_bf16_cache"] = KernelCase(
        (1, 1, 1, 1, 1, 1, 7, 3), (2, 7, 8, 9, 16, 17, 33, 63), 5, (9, 3), 64, kv_bf16=True, head_major=True
    )
    cases["long_prefills_f32_over_bf16_cache"] = KernelCase(
        (150, 40, 17, 1), (150, 140, 33, 90), 16, (9, 3), 64, kv_bf16=True, head_major=True, fused_qkv=True
    )
    cases["saturated_softmax_f32_over_bf16_cache"] = KernelCase(**_MIXED, block_size=16, heads=(9, 3), head_dim=64,
                                                               kv_bf16=True, query_gain=100.0)  # fmt: skip
    return cases


KERNEL_CASES = _kernel_cases()


@dataclass(frozen=True)
class _Expected:
    """One case's inputs (float32, or bf16-rounded) and the oracle's output and cache."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor  # before the step's K/V are written
    tables: list[list[int]]
    out: torch.Tensor
    cache_after: torch.Tensor


@functools.cache
def _oracle(case: KernelCase) -> _Expected:
    num_heads, num_kv_heads = case.heads
    gen = torch.Generator().manual_seed(len(case.seq_lens) * 1000 + case.head_dim + num_heads)
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    cache_dtype = torch.bfloat16 if case.bf16 or case.kv_bf16 else torch.float32
    num_blocks = sum(-(-s // case.block_size) for s in case.seq_lens) + 2
    pool = list(range(num_blocks))
    random.Random(num_heads).shuffle(pool)  # non-contiguous block tables
    tables = []
    for s in case.seq_lens:
        n = -(-s // case.block_size)
        tables.append(pool[:n])
        pool = pool[n:]
    shape = (num_blocks, case.block_size, num_kv_heads, case.head_dim)
    kv_cache = torch.randn(2, *shape, generator=gen).to(cache_dtype)
    num_tokens = sum(case.query_lens)
    query = (torch.randn(num_tokens, num_heads, case.head_dim, generator=gen) * case.query_gain).to(dtype)
    key, value = (torch.randn(num_tokens, num_kv_heads, case.head_dim, generator=gen).to(dtype) for _ in range(2))
    attn = build_attn_metadata(list(case.query_lens), list(case.seq_lens), tables, case.block_size)
    cache_after = kv_cache.float()
    # the cache holds the step's K/V as its type rounds them; attention reads them from there
    stored_key, stored_value = (t.to(cache_dtype).float() for t in (key, value))
    args = (query.float(), stored_key, stored_value, cache_after, attn, case.head_dim**-0.5)
    out = TorchReferenceBackend().forward(*args)
    return _Expected(query, key, value, kv_cache, tables, out, cache_after)


@pytest.mark.parametrize("case", list(KERNEL_CASES.values()), ids=list(KERNEL_CASES))
def test_kernel_on_every_tier(cpu_tier: IsaTier, case: KernelCase) -> None:
    kernel = load_paged_attention_kernel(cpu_tier)
    assert kernel is not None, "the CPU kernel must build here (gcc is part of this machine and of CI)"
    expected = _oracle(case)
    query, key, value = expected.query, expected.key, expected.value
    if case.fused_qkv:
        query, key, value = _as_fused_views(query, key, value)
    cache = expected.kv_cache.clone()
    if case.head_major:  # the same values in head-major storage
        num_blocks, block_size, num_kv_heads, head_dim = cache.shape[1:]
        cache = torch.empty(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=cache.dtype).transpose(2, 3)
        cache.copy_(expected.kv_cache)
    attn = build_attn_metadata(list(case.query_lens), list(case.seq_lens), expected.tables, case.block_size)
    out = CpuPagedBackend(kernel).forward(query, key, value, cache, attn, case.head_dim**-0.5)
    assert out.dtype == query.dtype
    # bf16: the output's final rounding, and on avx512_bf16 the softmax weights rounded to bf16 before they
    # multiply V; a saturated softmax: float32 rounding of scores in the hundreds moves the weights of near-ties
    # (a bfloat16 cache under float32 queries: the decode body's V pass rounds the weights to bf16 on avx512_bf16)
    rounded_weights = case.bf16 or (case.kv_bf16 and cpu_tier >= IsaTier.AVX512_BF16)
    tolerance = 1e-2 if rounded_weights else 1e-3 if case.query_gain > 1 else 1e-5
    torch.testing.assert_close(out.float(), expected.out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(cache.float(), expected.cache_after, rtol=0, atol=0)
