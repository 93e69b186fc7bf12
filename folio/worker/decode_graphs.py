"""DecodeGraphs: decode-only steps replayed from captured CUDA graphs, padded to a captured batch size.

A small model on a GPU is bound by kernel launches, not by the GPU: on the H200, SmolLM2's eager forward of 64
decodes cost 32.5 ms of CPU per step while the GPU's work was done by the time sampling looked (0.2 ms), through
`folio bench latency --device cuda --batch-size 64 --profile real` (docs/performance.md). A graph replays the whole
forward's ~1000 launches as one. vLLM captures the same way (its full decode graphs).

A step qualifies when every request decodes one token. It is padded up to the next captured size B: padded
tokens belong to zero-length requests (query_start_loc repeats, so attention skips them) and write their K/V into
the scratch slot, a KV block the scheduler never hands out. The model reads only the static buffers below, so a
replay needs the step's values copied in first. Stale block-table columns past a request's seq_len are never read.

``capture=False`` runs the same padded forward eagerly: the CPU (and CI) checks the padding that way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.attention.metadata import AttnMetadata
from folio.worker.input_batch import ModelInput

_MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, every 32 up to 512; capped at max_num_seqs.
    max_num_seqs 40 -> [1, 2, 4, 8, 16, 24, 32, 40]. A step pads to the smallest size that holds it."""
    sizes = [1, 2, 4, *range(8, 64, 8), *range(64, _MAX_CAPTURE_SIZE + 1, 32)]
    cap = min(max_num_seqs, _MAX_CAPTURE_SIZE)
    return sorted({s for s in sizes if s < cap} | {cap})


@dataclass
class _Captured:
    """One captured size: its graph and the output rows every replay writes."""

    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [B, hidden]


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        scratch_slot: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.scratch_slot = scratch_slot
        self.capture = capture
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(n, dtype=torch.int64)
        self.positions = zeros(n, dtype=torch.int64)
        self.slot_mapping = torch.full((n,), scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = zeros(n, dtype=torch.int32)
        self.query_start_loc = zeros(n + 1, dtype=torch.int32)
        self.block_table = zeros(n, max_blocks, dtype=torch.int32)
        self._captured: dict[int, _Captured] = {}  # empty when capture is False
        self._pool = None
        self.num_runs = 0  # steps served (tests check the path was taken)

    def can_run(self, model_input: ModelInput) -> bool:
        """Whether the step is decode-only and fits the captured sizes and block-table width."""
        attn = model_input.attn
        return (
            attn.max_query_len == 1
            and attn.num_tokens == attn.num_reqs
            and attn.num_reqs <= self.sizes[-1]
            and attn.block_table.shape[1] <= self.block_table.shape[1]
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures every size, largest first (later captures reuse its memory pool). A no-op when not capturing."""
        if not self.capture:
            return
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            attn = self._attn(size, size, seq_lens_cpu=[1] * size)  # every row a one-token request at position 0
            self.query_start_loc[: size + 1] = torch.arange(size + 1, dtype=torch.int32)
            self.seq_lens[:size] = 1
            self.slot_mapping[:size] = self.scratch_slot
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
                self._forward(size, attn)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden = self._forward(size, attn)
            self._captured[size] = _Captured(graph, hidden)
        torch.cuda.synchronize()

    def run(self, model_input: ModelInput) -> torch.Tensor:
        """The step's hidden states [num_reqs, hidden], computed at the padded size. Call only if can_run."""
        attn = model_input.attn
        num_reqs = attn.num_reqs
        size = next(s for s in self.sizes if s >= num_reqs)
        self._load(model_input, size)
        self.num_runs += 1
        if not self.capture:
            seq_lens_cpu = attn.seq_lens_cpu + [0] * (size - num_reqs)
            return self._forward(size, self._attn(size, num_reqs, seq_lens_cpu))[:num_reqs]
        captured = self._captured[size]
        captured.graph.replay()
        return captured.hidden[:num_reqs]

    def _load(self, model_input: ModelInput, size: int) -> None:
        """Copies the step into the static buffers; rows num_reqs..size-1 become padding."""
        attn = model_input.attn
        num_reqs = attn.num_reqs
        self.input_ids[:num_reqs] = model_input.input_ids
        self.positions[:num_reqs] = model_input.positions
        self.slot_mapping[:num_reqs] = attn.slot_mapping
        self.slot_mapping[num_reqs:size] = self.scratch_slot
        self.seq_lens[:num_reqs] = attn.seq_lens
        self.query_start_loc[: num_reqs + 1] = attn.query_start_loc
        self.query_start_loc[num_reqs + 1 : size + 1] = num_reqs  # zero-length padding requests
        self.block_table[:num_reqs, : attn.block_table.shape[1]] = attn.block_table

    def _attn(self, size: int, num_real: int, seq_lens_cpu: list[int]) -> AttnMetadata:
        """Metadata over the static buffers for a padded step of ``size`` rows, ``num_real`` of them real."""
        return AttnMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=max(seq_lens_cpu),
            query_start_loc_cpu=list(range(num_real + 1)) + [num_real] * (size - num_real),
            seq_lens_cpu=seq_lens_cpu,
        )

    def _forward(self, size: int, attn: AttnMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, attn)
