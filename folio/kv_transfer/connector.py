"""The engine core's side of the KV transfer: the receiver and its store (consumer), the send plans (producer).

Consumer: received blocks wait in the store (core/remote_kv.py), where the KV cache manager finds them by hash.
Producer: in the step whose chunk completes a prompt (its num_computed_tokens crosses the prompt's length), a request
whose ``kv_transfer_params`` ask for ``do_remote_decode`` gets a ``KVSend`` of its full prompt blocks in the
``SchedulerOutput``. The worker sends them after that step's forward and waits for the consumer's ack before it
returns the step's output, so by the time the prefill's response is out the blocks are on the consumer. The request
holds its blocks during the step: no pins, nothing to free afterwards. Every other request of that step waits for
the transfer too (docs/scale_out.md measures it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from folio.core.remote_kv import KVTransferStats, RemoteKVStore, RemoteKVTier
from folio.core.sched_output import KVSend, KVTransferResult, SchedulerOutput
from folio.kv_transfer.config import KVTransferConfig, send_destination
from folio.kv_transfer.receiver import KVReceiver
from folio.request import Request


def kv_transfer_params_of(request: Request) -> dict[str, Any] | None:
    extra_args = request.sampling_params.extra_args
    return extra_args.get("kv_transfer_params") if extra_args else None


class CoreKVConnector:
    """Built by the engine core from its kv_transfer_config; ``shutdown`` stops the receiver."""

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.store = RemoteKVStore(config.kv_buffer_size) if config.is_consumer else None
        self.receiver = None
        if self.store is not None:
            assert config.kv_port is not None  # checked by KVTransferConfig
            self.receiver = KVReceiver(config.kv_ip, config.kv_port, self.store)
        self._sent = KVTransferStats()  # the worker's results, summed

    def plan_sends(
        self, output: SchedulerOutput, requests: Mapping[str, Request], block_ids_of: Callable[[str], list[int]]
    ) -> None:
        """Add a ``KVSend`` to ``output`` for each scheduled request whose prompt this step completes and that asks
        for a remote decode (n > 1 siblings share the first sample's prompt blocks: only it sends)."""
        if not self.config.is_producer:
            return
        for req_id, num_scheduled in output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None or request.fork_of is not None:
                continue
            destination = send_destination(kv_transfer_params_of(request), self.config)
            end = request.num_computed_tokens  # schedule() advanced it past this step's tokens
            if destination is None or not end - num_scheduled < request.num_prompt_tokens <= end:
                continue
            num_blocks = min(request.num_prompt_tokens // self.block_size, len(request.block_hashes))
            if num_blocks > 0:
                block_ids = block_ids_of(req_id)[:num_blocks]
                output.kv_sends.append(KVSend(req_id, *destination, block_ids, request.block_hashes[:num_blocks]))

    def record(self, result: KVTransferResult | None) -> None:
        """One step's transfers, as the worker reports them."""
        if result is None:
            return
        self._sent.num_sent_blocks += result.num_sent_blocks
        self._sent.num_sent_bytes += result.num_sent_bytes
        self._sent.send_seconds += result.send_seconds
        self._sent.num_failed_sends += result.num_failed_sends
        self._sent.num_failed_loads += result.num_failed_loads

    def stats(self, remote_tier: RemoteKVTier | None) -> KVTransferStats:
        """A snapshot: the worker's counts, the store's, and the loads the KV cache manager planned."""
        stats = copy.copy(self._sent)
        if self.store is not None:
            stats.num_received_blocks = self.store.num_received_blocks_total
            stats.num_received_bytes = self.store.num_received_bytes_total
            stats.num_evicted_blocks = self.store.num_evicted_blocks_total
            stats.buffer_usage = self.store.usage
        if remote_tier is not None:
            stats.num_loaded_blocks = remote_tier.num_loaded_blocks_total
        return stats

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
