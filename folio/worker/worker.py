"""Worker: device setup, model load (its CPU kernels: cpu_kernel_setup.py), KV-cache sizing (CUDA profiling; budget in
blocks: kv_budget.py), execute_model."""

from __future__ import annotations

import logging
import time

import torch

from folio.attention.builder import assign_contiguous_blocks, build_attn_metadata, compute_positions
from folio.config import EngineConfig
from folio.core.sched_output import ModelRunnerOutput, SchedulerOutput
from folio.kernels.cpu_kernels import CpuKernels
from folio.model.llama import LlamaForCausalLM
from folio.model.loader import ModelSpec, load_model
from folio.model.noop import NoopCausalLM
from folio.parallel.group import RankGroup
from folio.parallel.pipeline_parallel import PipelineStage, apply_pipeline_parallel
from folio.parallel.tensor_parallel import ShardPlan, apply_tensor_parallel
from folio.spec_decode.ngram_proposer import NgramProposer
from folio.worker.cpu_kernel_setup import engine_cpu_kernels
from folio.worker.cpu_threads import CpuThreadGovernor
from folio.worker.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from folio.worker.draft_runner import DraftModelRunner, load_draft_model
from folio.worker.kv_budget import blocks_in_budget, check_budget_before_loading, report_capacity
from folio.worker.kv_cache_shape import KVCacheShape, default_cpu_kv_bytes
from folio.worker.kv_connector import RemoteKVLoader, WorkerKVConnector, kv_layout_fingerprint
from folio.worker.kv_disk import DiskKVTransfer, open_disk_tier
from folio.worker.kv_offload import HostKVCache, KVTransfer, mem_available_bytes, resolve_num_host_blocks
from folio.worker.model_runner import ModelRunner

logger = logging.getLogger("folio")

# The last governor's (quiet thread count, count it set). torch's thread count is process-wide: an engine dropped
# while its governor had taken threads away leaves torch there, and the next engine in the process (a benchmark's
# fresh engine per run) would take that as its quiet count and never probe above it.
_last_governed_threads: tuple[int, int] | None = None


def quiet_thread_count() -> int:
    """torch's thread count, unless it is the count a governor set: then that governor's quiet count."""
    current = torch.get_num_threads()
    if _last_governed_threads is not None and _last_governed_threads[1] == current:
        return _last_governed_threads[0]
    return current


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        group: RankGroup | None = None,
        stage: PipelineStage | None = None,
        gpu_index: int | None = None,
    ) -> None:
        """``group``: this worker's rank among the tensor-parallel ranks (None: the only rank); ``stage``: its
        pipeline stage (None: no pipeline parallelism); ``gpu_index``: the CUDA device of this rank where it is not
        its rank (a Ray actor sees only its own GPU: 0)."""
        self.config = config
        self.group = group if group is not None else RankGroup(0, 1)
        self.stage = stage
        self.world = stage.world if stage is not None else self.group  # every rank of the engine
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and (self.world.world_size > 1 or gpu_index is not None):
            self.device = torch.device("cuda", self.world.rank if gpu_index is None else gpu_index)  # one GPU per rank
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches and graph capture use the current device
        torch.manual_seed(config.model_config.seed)
        self.cpu_kernels: CpuKernels | None = None
        # One governor from the start: loading (dequantize, pack, zero the KV cache) is OpenMP regions too, and on
        # cores another process takes, every one of them waits for a descheduled thread (a 1 s load took minutes).
        adaptive = self.device.type == "cpu" and config.cpu_config.adaptive_threads
        self._threads = CpuThreadGovernor(quiet_thread_count()) if adaptive else None
        self._threads_logged: int | None = None
        self._govern_threads()  # from the quiet count, whatever an earlier engine in the process left
        self.model, self.spec = self._load()
        self.kv_shape = self._kv_shape(self.model, self.spec)
        # The draft model (speculative_config method "draft_model") before sizing: its K/V share each block.
        self.draft_model = self._load_draft()
        self.draft_kv_shape = (
            None if self.draft_model is None else self._kv_shape(self.draft_model, self.draft_model.spec)
        )
        num_blocks = self.world.min_int(self.determine_num_blocks())  # every rank holds every block
        config.cache_config.num_blocks = num_blocks
        report_capacity(config, num_blocks, self.bytes_per_block, self.kv_dtype)
        # The no-op model never touches K/V, so its KV cache is accounted (blocks) but not allocated.
        noop = isinstance(self.model, NoopCausalLM)
        # One block past the scheduler's num_blocks is scratch: padded rows of a CUDA-graph step write there.
        self.model_runner = ModelRunner(
            self.model,
            [] if noop else self.kv_shape.allocate(num_blocks + 1, self.device),
            config.cache_config.block_size,
            self.spec.vocab_size,
            self.device,
        )
        self.model_runner.is_last_stage = stage is None or stage.is_last  # the stages before it do not sample
        if self.cpu_kernels is not None:
            self.model_runner.block_copy = self.cpu_kernels.block_copy
        speculative = config.speculative_config
        if self.draft_model is not None and self.draft_kv_shape is not None and speculative is not None:
            assert speculative.num_speculative_tokens is not None
            self.model_runner.draft_runner = DraftModelRunner(
                self.draft_model,
                self.draft_kv_shape.allocate(num_blocks + 1, self.device),
                config.cache_config.block_size,
                speculative.num_speculative_tokens,
                config.scheduler_config.max_model_len,
                self.device,
            )
        if speculative is not None and speculative.method == "ngram":
            assert speculative.num_speculative_tokens is not None
            assert speculative.prompt_lookup_min is not None and speculative.prompt_lookup_max is not None
            self.model_runner.proposer = NgramProposer(
                speculative.num_speculative_tokens, speculative.prompt_lookup_min, speculative.prompt_lookup_max
            )
        # After the device cache, so that on the CPU the RAM check sees what the device cache already took.
        self.host_kv_cache = self._allocate_host_tier(noop)
        if self.host_kv_cache is not None:
            self.model_runner.kv_transfer = KVTransfer(
                self.model_runner.kv_caches, self.host_kv_cache, self.device, self.model_runner.block_copy
            )
            self.model_runner.kv_disk = self._open_disk_tier(self.model_runner.kv_transfer)
        self.kv_connector = self._kv_connector()
        if self._wants_decode_graphs():
            self._capture_decode_graphs(num_blocks * config.cache_config.block_size)

    def _kv_shape(self, model: LlamaForCausalLM | NoopCausalLM, spec: ModelSpec) -> KVCacheShape:
        return KVCacheShape(
            # a pipeline stage's model holds (and caches) only its own layers
            num_layers=len(model.model.layers) if isinstance(model, LlamaForCausalLM) else spec.num_hidden_layers,
            block_size=self.config.cache_config.block_size,
            num_kv_heads=self._kv_heads_held(model, spec),
            head_dim=spec.head_dim,
            dtype=self.kv_dtype,
            head_major=isinstance(model, LlamaForCausalLM) and model.attn_backend.kv_cache_head_major,
            huge_pages=self.config.cpu_config.huge_pages,
        )

    def _kv_heads_held(self, model: LlamaForCausalLM | NoopCausalLM, spec: ModelSpec) -> int:
        """The KV heads this rank's cache holds for ``model``: what its attention layers kept (the tensor-parallel
        share of the target and of a self-draft, which is the target; all of a separate draft model, which every
        rank runs whole); for the no-op model, the share its shard plan would give."""
        if isinstance(model, LlamaForCausalLM):
            return int(model.model.layers[0].self_attn.num_kv_heads)
        uneven = self.config.parallel_config.tensor_parallel_uneven_heads
        return ShardPlan.make(spec, self.group.rank, self.group.world_size, uneven).num_kv_heads

    def _load_draft(self) -> LlamaForCausalLM | None:
        speculative = self.config.speculative_config
        if speculative is None or speculative.method != "draft_model" or not isinstance(self.model, LlamaForCausalLM):
            return None
        assert speculative.model is not None
        model, _ = load_draft_model(
            speculative.model,
            self.model,
            self.config.model_config.model,
            self.dtype,
            self.device,
            self.config.model_config.enforce_eager,
            self.cpu_kernels,
            self.config.cpu_config.kv_prefetch_bytes,
        )
        return model

    @property
    def bytes_per_block(self) -> int:
        """One KV block of the target's cache, plus the draft model's block of the same id (if any)."""
        draft = 0 if self.draft_kv_shape is None else self.draft_kv_shape.bytes_per_block
        return self.kv_shape.bytes_per_block + draft

    def _allocate_host_tier(self, noop: bool) -> HostKVCache | None:
        """The host KV tier of --kv-offloading-size GiB: resolves cache_config.num_host_blocks (read by the engine
        core's KV manager, built after the worker) and allocates it (pinned on CUDA). None when the tier is off.
        With several ranks the size is their total, as vLLM's is: every rank holds every host block id for its own
        KV heads and layers, so a host block costs the bytes of one device block summed over the ranks."""
        cache = self.config.cache_config
        shape = self.kv_shape
        if cache.kv_offloading_size == 0:
            cache.num_host_blocks = 0
            return None
        num_host_blocks = resolve_num_host_blocks(
            cache.kv_offloading_size, self.world.sum_int(shape.bytes_per_block), mem_available_bytes()
        )
        # the same count on every rank already; agreed so that no rank allocates before every rank's RAM check
        num_host_blocks = cache.num_host_blocks = self.world.min_int(num_host_blocks)
        host = HostKVCache(
            shape.num_layers,
            0 if noop else num_host_blocks,  # the no-op model keeps no K/V: the tier is accounted, not allocated
            shape.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            shape.dtype,
            shape.head_major,
            pin_memory=self.device.type == "cuda",
        )
        logger.info(
            "KV host tier: %d blocks of %d tokens (%d tokens, %.2f GiB%s)",
            num_host_blocks,
            shape.block_size,
            num_host_blocks * shape.block_size,
            num_host_blocks * shape.bytes_per_block / 2**30,
            ", pinned" if self.device.type == "cuda" else "",
        )
        return host

    def _open_disk_tier(self, host_transfer: KVTransfer) -> DiskKVTransfer | None:
        """The disk tier under the host tier (--kv-offloading-disk-path): resolves cache_config.num_disk_blocks and
        the hashes found warm (read by the engine core's KV manager). None when the tier is off."""
        cache = self.config.cache_config
        if cache.kv_offloading_disk_path is None:
            return None
        shape = self.kv_shape
        layout = {
            "num_layers": shape.num_layers,
            "block_size": shape.block_size,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "dtype": str(shape.dtype),
            "head_major": shape.head_major,
            "device_type": self.device.type,
        }
        files, cache.num_disk_blocks, cache.disk_block_hashes = open_disk_tier(
            cache.kv_offloading_disk_path,
            cache.kv_offloading_disk_size,
            self.config.model_config.model,
            layout,
            shape.bytes_per_block,
            shape.block_size,
        )
        return DiskKVTransfer(files, host_transfer.host.caches, host_transfer.device_caches)

    def _kv_connector(self) -> WorkerKVConnector | None:
        """Disaggregated prefill (kv_transfer_config): a consumer's loader of received blocks (run by the model runner
        before the forward), a producer's sends (after it)."""
        kv_transfer = self.config.kv_transfer_config
        if kv_transfer is None:
            return None
        fingerprint = kv_layout_fingerprint(self.config.model_config.model, self.kv_shape)
        caches = self.model_runner.kv_caches
        if kv_transfer.is_consumer:
            self.model_runner.kv_remote = RemoteKVLoader(caches, fingerprint, self.kv_shape.bytes_per_block)
        return WorkerKVConnector(caches, fingerprint, self.model_runner.kv_remote)

    def _wants_decode_graphs(self) -> bool:
        """CUDA, not enforce_eager, a real model whose attention backend can be captured (TritonPagedBackend)."""
        return (
            self.device.type == "cuda"
            and not self.config.model_config.enforce_eager
            and self.world.world_size == 1  # collectives and stage messages inside captured graphs: not yet
            and isinstance(self.model, LlamaForCausalLM)
            and getattr(self.model.attn_backend, "supports_cuda_graphs", False)
        )

    def _capture_decode_graphs(self, scratch_slot: int) -> None:
        sched = self.config.scheduler_config
        start = time.perf_counter()
        graphs = self.model_runner.enable_decode_graphs(
            sched.max_num_seqs, sched.max_model_len, scratch_slot, capture=True
        )
        logger.info(
            "Captured CUDA graphs for decode batches of %s in %.1f s", graphs.sizes, time.perf_counter() - start
        )

    def _load(self) -> tuple[LlamaForCausalLM | NoopCausalLM, ModelSpec]:
        from folio.model.loader import read_model_spec

        spec = read_model_spec(self.config.model_config.model)
        self.dtype = resolve_dtype(self.config.model_config.dtype, spec.checkpoint_dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(self.config.cache_config.cache_dtype, self.dtype, self.device)
        check_budget_before_loading(self.config, spec, self.world.world_size, self.kv_dtype)
        if self.config.model_config.model_impl == "noop":
            logger.info("No-op model with the shapes of %s (engine-overhead benchmarks only)", spec.architecture)
            return NoopCausalLM(spec, self.dtype, self.device), spec
        logger.info("Loading %s as %s on %s", self.config.model_config.model, self.dtype, self.device)
        model_config = self.config.model_config
        self.cpu_kernels = engine_cpu_kernels(  # the draft model's too
            self.config.cpu_config,
            self.device,
            self.dtype,
            self.config.model_config.enforce_eager,
            pipelined=self.stage is not None,
        )
        model, spec = load_model(
            model_config.model,
            self.dtype,
            self.device,
            # the fused CPU decoder runs every layer in one C call (under TP with the all-reduces called back from
            # it), with no stage messages between: PP runs layer by layer
            enforce_eager=model_config.enforce_eager or self.stage is not None,
            cpu_kernels=self.cpu_kernels,
            cpu_kv_prefetch_bytes=self.config.cpu_config.kv_prefetch_bytes,
            shard_model=self._shard if self.world.world_size > 1 else None,
            show_progress=self.world.rank == 0,
            before_each_tensor=self._govern_threads if self._threads is not None else None,
        )
        return model, spec

    def _shard(self, model: LlamaForCausalLM) -> None:
        """This rank's part of the loaded model: its tensor-parallel slice, then its pipeline stage's layers."""
        if self.group.world_size > 1:
            apply_tensor_parallel(model, self.group, self.config.parallel_config.tensor_parallel_uneven_heads)
        if self.stage is not None:
            apply_pipeline_parallel(model, self.stage)

    def determine_num_blocks(self) -> int:
        """Blocks that fit the KV budget: an override, kv_cache_memory_bytes, or the device's default."""
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:  # the ranks share the machine's RAM: each takes its share of the default
            budget = default_cpu_kv_bytes() // self.world.world_size
        return blocks_in_budget(budget, self.bytes_per_block)

    def _profile_cuda_budget(self) -> int:
        """vLLM's rule: run the largest batch once, then give the KV cache what is left under the utilization cap."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        _free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.cache_config.gpu_memory_utilization) - peak
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization {self.config.cache_config.gpu_memory_utilization} leaves no room for the KV "
                f"cache: the model's peak use is {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB"
            )
        return budget

    @torch.inference_mode()
    def _profile_run(self) -> torch.Tensor:
        """One forward of max_num_batched_tokens tokens as prefills of up to max_model_len, on a scratch cache.

        Returns the logits of its last min(max_num_seqs, max_num_batched_tokens) tokens [rows, vocab] (float32),
        so that tests can check it ran the forward it claims; the caller measures the peak memory and drops them.
        """
        sched = self.config.scheduler_config
        block_size = self.config.cache_config.block_size
        num_tokens = sched.max_num_batched_tokens
        lens = profile_prefill_lens(num_tokens, sched.max_model_len)
        tables = assign_contiguous_blocks(lens, block_size)
        caches = self.kv_shape.allocate(sum(len(t) for t in tables), self.device)
        attn = build_attn_metadata(lens, lens, tables, block_size, self.device)
        positions = torch.tensor(compute_positions(lens, lens), device=self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden: torch.Tensor = self.model(input_ids, positions, caches, attn)
        if self.stage is not None and not self.stage.is_last:  # pipeline stages run it together; the last has logits
            return hidden
        logits = self.model.compute_logits(hidden[-min(sched.max_num_seqs, num_tokens) :])
        del caches, hidden
        return logits

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._govern_threads()
        output = self.model_runner.execute_model(scheduler_output)
        if self.kv_connector is not None:  # the producer's sends, once this step's K/V are written
            self.kv_connector.finish_step(scheduler_output, output)
        if self.group.world_size > 1:
            output.collective_seconds = self.group.collective_seconds
        return output

    def _govern_threads(self) -> None:
        """Before each step (and each tensor loaded): the governor's thread count for the CPU kernels."""
        if self._threads is not None and (threads := self._threads.threads_for_step()) != torch.get_num_threads():
            # a probe every few seconds under a lasting neighbour: only the first drop is worth a line at INFO
            first = threads < self._threads.max_threads and self._threads_logged != threads
            (logger.info if first else logger.debug)(
                "CPU kernels on %d of %d threads (fewer: others take cores)", threads, self._threads.max_threads
            )
            self._threads_logged = threads if first else self._threads_logged
            torch.set_num_threads(threads)
            global _last_governed_threads
            _last_governed_threads = (self._threads.max_threads, threads)


def profile_prefill_lens(num_tokens: int, max_model_len: int) -> list[int]:
    """The profiling run's prefills: ``num_tokens`` split into sequences of max_model_len, the rest last.

    Example: 300 tokens, max_model_len 128 -> [128, 128, 44]; 100 tokens -> [100].
    """
    seq_len = min(num_tokens, max_model_len)
    return [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
