"""The KV transfer's Prometheus series (disaggregated prefill, folio/kv_transfer/), under ``folio:kv_transfer_*``.

They read the engine core's cumulative ``KVTransferStats`` (in each scheduler snapshot): the counters advance by the
difference from that core's last snapshot. They exist only when the server runs with a ``kv_transfer_config``.
Consumer: blocks and bytes received, received blocks loaded as prefix-cache hits (their tokens also count in
``folio:external_prefix_cache_hits``), dropped unused from the full buffer, refused at load; the buffer's usage.
Producer: blocks and bytes sent, the seconds the sends took (the producer's steps wait for them), failed sends.
"""

from __future__ import annotations

from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge

from folio.core.remote_kv import KVTransferStats

# KVTransferStats field -> (series name, help)
_COUNTERS = {
    "num_received_blocks": ("folio:kv_transfer_received_blocks", "KV blocks received from prefill instances."),
    "num_received_bytes": ("folio:kv_transfer_received_bytes", "Bytes of KV blocks received."),
    "num_loaded_blocks": ("folio:kv_transfer_loaded_blocks", "Received KV blocks loaded as prefix-cache hits."),
    "num_evicted_blocks": ("folio:kv_transfer_evicted_blocks", "Received KV blocks dropped unused (buffer full)."),
    "num_failed_loads": ("folio:kv_transfer_failed_loads", "Received KV blocks refused at load (recomputed)."),
    "num_sent_blocks": ("folio:kv_transfer_sent_blocks", "KV blocks sent to decode instances."),
    "num_sent_bytes": ("folio:kv_transfer_sent_bytes", "Bytes of KV blocks sent."),
    "send_seconds": ("folio:kv_transfer_send_seconds", "Seconds spent sending KV blocks (steps wait for it)."),
    "num_failed_sends": ("folio:kv_transfer_failed_sends", "Requests whose KV blocks could not be sent."),
}


class KVTransferPrometheus:
    """Every series at 0 from the start, with the ``model_name`` and ``engine`` labels."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engines: list[str]) -> None:
        self.model_name = model_name
        self.engines = engines
        labels = ["model_name", "engine"]
        self.counters = {key: Counter(name, text, labels, registry=registry) for key, (name, text) in _COUNTERS.items()}
        self.buffer_usage = Gauge(
            "folio:kv_transfer_buffer_usage_perc",
            "Fraction of kv_buffer_size holding received KV blocks.",
            labels,
            registry=registry,
        )
        for engine in engines:
            for metric in [*self.counters.values(), self.buffer_usage]:
                metric.labels(model_name, engine)
        self._last = [KVTransferStats() for _ in engines]

    def record(self, stats: KVTransferStats, engine_index: int = 0) -> None:
        labels = (self.model_name, self.engines[engine_index])
        last = self._last[engine_index]
        for field in fields(KVTransferStats):
            if field.name in self.counters:
                delta = getattr(stats, field.name) - getattr(last, field.name)
                if delta > 0:
                    self.counters[field.name].labels(*labels).inc(delta)
        self.buffer_usage.labels(*labels).set(stats.buffer_usage)
        self._last[engine_index] = stats
