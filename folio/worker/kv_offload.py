"""The host KV tier's memory and the execution of a step's store / load plans (issue 18).

The scheduler (``folio/core/offload.py``) decides which blocks move; this module only owns the host tensors and
copies what ``SchedulerOutput.kv_stores`` / ``kv_loads`` say, batched: per layer one gather and one scatter per
direction, with index tensors built once per step.

Order (``SchedulerOutput``'s contract): every store (device -> host), then every load (host -> device), then the
copy-on-write plans and the forward. Within one direction, a destination named twice keeps its last source, as if
the copies ran one by one in list order.

CUDA: the copies run on a side stream. Stores: the side stream first waits for the compute stream (the blocks were
written by earlier forwards), gathers on the device, copies into pinned staging memory, and the host thread waits
for that event before scattering into the host tier, so a stored device block may be overwritten by anything that
follows. Loads: the host thread gathers into pinned staging memory, the side stream copies it to the device and
scatters it into the destination blocks, and the compute stream waits on the loads' event before the copy-on-write
plans and the forward: the host thread goes on preparing the step's inputs while the loads are in flight.
CPU: the copies run directly, by the ``BlockCopy`` the CPU plan chose (folio/kernels/kv_block_copy.py): one
parallel C call that copies each block's K and V runs, or ATen's gather-then-scatter.
"""

from __future__ import annotations

import logging
import math

import torch

from folio.kernels.kv_block_copy import BlockCopy, aten_copy_blocks

logger = logging.getLogger("folio")

_MEMINFO = "/proc/meminfo"


def mem_available_bytes(meminfo_path: str = _MEMINFO) -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where it cannot be read (no such file: not Linux)."""
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resolve_num_host_blocks(kv_offloading_size: float, bytes_per_block: int, available_bytes: int | None) -> int:
    """Host blocks in ``kv_offloading_size`` GiB; 0 when the tier is off.

    Raises ValueError naming --kv-offloading-size when the tier does not fit the available RAM (``available_bytes``,
    None: unknown, not checked) or holds no block at all.
    """
    if not kv_offloading_size >= 0:  # NaN fails too
        raise ValueError(f"kv_offloading_size must be >= 0 (GiB), got {kv_offloading_size}")
    if kv_offloading_size == 0:
        return 0
    asked = int(kv_offloading_size * 2**30)
    if available_bytes is not None and asked > available_bytes:
        raise ValueError(
            f"--kv-offloading-size {kv_offloading_size:g} GiB ({asked} bytes) is more than the RAM available: "
            f"{available_bytes / 2**30:.2f} GiB ({available_bytes} bytes, MemAvailable)"
        )
    num_blocks = asked // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"--kv-offloading-size {kv_offloading_size:g} GiB holds no KV block (one block needs {bytes_per_block} "
            "bytes)"
        )
    return num_blocks


def storage_view(cache: torch.Tensor, head_major: bool) -> torch.Tensor:
    """A layer cache in its storage order (head-major caches are handed out as transposed views): a block is then
    one contiguous run per K and V, and a device and a host cache of the same layout copy run for run."""
    return cache.transpose(2, 3) if head_major else cache


def _last_wins(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(sources, destinations) with each destination once, its last source kept: sequential semantics for one
    batched scatter (index_copy_ with a repeated index keeps an unspecified one)."""
    by_dst: dict[int, int] = {}
    for src, dst in pairs:
        by_dst.pop(dst, None)  # re-insert so the order stays that of the last occurrence
        by_dst[dst] = src
    return list(by_dst.values()), list(by_dst)


class HostKVCache:
    """Per layer a host tensor with the device cache's per-block layout; pinned on CUDA (async copies)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        head_major: bool,
        pin_memory: bool,
    ) -> None:
        self.num_blocks = num_blocks
        self.head_major = head_major
        inner = (num_kv_heads, block_size) if head_major else (block_size, num_kv_heads)
        shape = (2, num_blocks, *inner, head_dim)
        # Storage order, as the device's; zeroed so that a never-stored block reads as the device's fresh cache.
        self.caches = [torch.zeros(shape, dtype=dtype, pin_memory=pin_memory) for _ in range(num_layers)]
        self.bytes_per_block = 2 * num_layers * math.prod(inner) * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks


class KVTransfer:
    """Executes a step's stores and loads between the device caches and a HostKVCache. No policy here."""

    def __init__(
        self,
        device_caches: list[torch.Tensor],
        host: HostKVCache,
        device: torch.device,
        block_copy: BlockCopy = aten_copy_blocks,
    ) -> None:
        """``block_copy``: how the CPU copies blocks (the plan's choice); CUDA stages through pinned memory."""
        if device_caches and len(device_caches) != len(host.caches):
            raise ValueError(f"{len(device_caches)} device layer caches but {len(host.caches)} host ones")
        self.device = device
        self.host = host
        self.device_caches = [storage_view(c, host.head_major) for c in device_caches]  # storage order
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.block_copy = block_copy

    def execute(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Stores (device id, host id) then loads (host id, device id); returns once the stores are in the host
        tier. On CUDA the loads are then queued before anything the current stream runs next."""
        if not self.device_caches:  # the no-op model keeps no K/V: accounting only
            return
        if stores:
            self._store(*_last_wins(stores))
        if loads:
            self._load(*_last_wins(loads))

    def _store(self, src: list[int], dst: list[int]) -> None:
        if self.stream is None:
            self.block_copy(self.device_caches, src, self.host.caches, dst)
            return
        dst_idx = torch.tensor(dst, dtype=torch.long)
        compute = torch.cuda.current_stream(self.device)
        staged: list[torch.Tensor] = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)  # the blocks' K/V come from forwards queued on the compute stream
            src_idx = torch.tensor(src, dtype=torch.long, device=self.device)
            for device_cache in self.device_caches:
                gathered = device_cache.index_select(1, src_idx)
                pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                pinned.copy_(gathered, non_blocking=True)
                staged.append(pinned)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # the host thread scatters below, and the stored device blocks are free to reuse after
        for host_cache, pinned in zip(self.host.caches, staged, strict=True):
            host_cache.index_copy_(1, dst_idx, pinned)

    def _load(self, src: list[int], dst: list[int]) -> None:
        if self.stream is None:
            self.block_copy(self.host.caches, src, self.device_caches, dst)
            return
        src_idx = torch.tensor(src, dtype=torch.long)
        compute = torch.cuda.current_stream(self.device)
        staged = []
        for host_cache in self.host.caches:  # gather on the host into pinned memory, so the copy can be async
            pinned = torch.empty((2, len(src), *host_cache.shape[2:]), dtype=host_cache.dtype, pin_memory=True)
            torch.index_select(host_cache, 1, src_idx, out=pinned)
            staged.append(pinned)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)  # earlier forwards may still read the destination blocks
            dst_idx = torch.tensor(dst, dtype=torch.long, device=self.device)
            for device_cache, pinned in zip(self.device_caches, staged, strict=True):
                # pinned source: the caching host allocator keeps it until this copy is done
                device_cache.index_copy_(1, dst_idx, pinned.to(self.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)  # copy-on-write and the forward read the loaded blocks after this
