"""Stat loggers: Prometheus metrics under ``folio:`` (vLLM's names and buckets) and vLLM's periodic log line.

Both implement ``StatLogger``: the AsyncLLM calls ``record`` after each engine-core step with the core's
scheduler snapshot, what the frontend measured for that step's outputs and the core's index. Every Prometheus
series carries an ``engine`` label ("0".."N-1" with data parallelism, "0" otherwise), as vLLM's do; one /metrics
shows every engine's series. Each server owns its own CollectorRegistry, so two apps in one process (tests) never
share counters.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from folio.engine.stats import IterationStats, SchedulerStats
from folio.server.kv_transfer_metrics import KVTransferPrometheus
from folio.server.spec_decode_metrics import SpecDecodeLogPart, SpecDecodePrometheus

logger = logging.getLogger("folio")

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TTFT_BUCKETS += [20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
REQUEST_LATENCY_BUCKETS += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")
OFFLOAD_DIRECTIONS = ("to_cpu", "to_device", "to_disk", "from_disk")  # host tier, then the disk tier under it


class PrometheusStatLogger:
    """Every metric carries the ``model_name`` and ``engine`` labels, as vLLM's do. ``num_speculative_tokens``:
    speculation is on, and its counters exist (folio/server/spec_decode_metrics.py). ``num_engines``: the engine
    cores (data parallelism); each one's series exist from the start."""

    def __init__(
        self,
        model_name: str,
        num_speculative_tokens: int | None = None,
        num_engines: int = 1,
        kv_transfer: bool = False,
    ) -> None:
        """``kv_transfer``: the server runs with a kv_transfer_config, and its series exist."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.engines = [str(i) for i in range(num_engines)]
        labels = ["model_name", "engine"]
        reg = self.registry
        self.gauge_running = Gauge("folio:num_requests_running", "Requests in the running batch.", labels, registry=reg)
        self.gauge_waiting = Gauge("folio:num_requests_waiting", "Requests waiting to run.", labels, registry=reg)
        self.gauge_kv_usage = Gauge(
            "folio:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.", labels, registry=reg
        )
        self.counter_prefix_queries = Counter(
            "folio:prefix_cache_queries", "Prefix-cache queries, in tokens.", labels, registry=reg
        )
        self.counter_prefix_hits = Counter(
            "folio:prefix_cache_hits", "Prefix-cache hits, in tokens.", labels, registry=reg
        )
        self.counter_preemptions = Counter("folio:num_preemptions", "Cumulative preemptions.", labels, registry=reg)
        # The host KV tier (issue 18), vLLM's names. The core's SchedulerStats carries them once the tier is built;
        # read with getattr so that a snapshot without them counts 0.
        self.counter_offload_blocks = Counter(
            "folio:kv_offload_blocks",
            "KV blocks copied by the host tier (to_cpu, to_device) and the disk tier (to_disk, from_disk).",
            [*labels, "direction"],
            registry=reg,
        )
        for direction in OFFLOAD_DIRECTIONS:
            for engine in self.engines:
                self.counter_offload_blocks.labels(model_name, engine, direction)
        self.gauge_offload_usage = Gauge(
            "folio:kv_offload_cpu_usage_perc",
            "Host KV tier usage: 1 means every host block is in use.",
            labels,
            registry=reg,
        )
        self.gauge_offload_disk_usage = Gauge(
            "folio:kv_offload_disk_usage_perc",
            "Disk KV tier usage: 1 means every block file of its size is written.",
            labels,
            registry=reg,
        )
        self.counter_disk_failed_loads = Counter(
            "folio:kv_offload_disk_failed_loads",
            "Disk KV tier loads that failed (file missing or damaged): those tokens were recomputed.",
            labels,
            registry=reg,
        )
        self.counter_external_queries = Counter(
            "folio:external_prefix_cache_queries",
            "Prefix queries past the device pool, in tokens.",
            labels,
            registry=reg,
        )
        self.counter_external_hits = Counter(
            "folio:external_prefix_cache_hits",
            "Prefix hits in the host and disk tiers, in tokens.",
            labels,
            registry=reg,
        )
        self.counter_swapped_preemptions = Counter(
            "folio:num_swapped_preemptions",
            "Cumulative preemptions done by swapping to the host tier.",
            labels,
            registry=reg,
        )
        self.counter_prompt_tokens = Counter("folio:prompt_tokens", "Prefill tokens processed.", labels, registry=reg)
        self.counter_generation_tokens = Counter(
            "folio:generation_tokens", "Generation tokens processed.", labels, registry=reg
        )
        self.counter_request_success = Counter(
            "folio:request_success", "Finished requests, by finish reason.", [*labels, "finished_reason"], registry=reg
        )
        for reason in FINISH_REASONS:
            for engine in self.engines:
                self.counter_request_success.labels(model_name, engine, reason)
        self.hist_ttft = Histogram(
            "folio:time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=reg
        )
        self.hist_itl = Histogram(
            "folio:inter_token_latency_seconds", "Time between tokens.", labels, buckets=ITL_BUCKETS, registry=reg
        )
        self.hist_e2e = Histogram(
            "folio:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        )
        self.hist_queue = Histogram(
            "folio:request_queue_time_seconds",
            "Time spent waiting before first scheduled.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        )
        for metric in (
            self.gauge_running,
            self.gauge_waiting,
            self.gauge_kv_usage,
            self.counter_prefix_queries,
            self.counter_prefix_hits,
            self.counter_preemptions,
            self.gauge_offload_usage,
            self.gauge_offload_disk_usage,
            self.counter_disk_failed_loads,
            self.counter_external_queries,
            self.counter_external_hits,
            self.counter_swapped_preemptions,
            self.counter_prompt_tokens,
            self.counter_generation_tokens,
            self.hist_ttft,
            self.hist_itl,
            self.hist_e2e,
            self.hist_queue,
        ):
            for engine in self.engines:
                metric.labels(model_name, engine)  # every series is exposed (at 0) before the first request
        self.spec_decode = (
            SpecDecodePrometheus(reg, model_name, num_speculative_tokens, self.engines)
            if num_speculative_tokens
            else None
        )
        self.kv_transfer = KVTransferPrometheus(reg, model_name, self.engines) if kv_transfer else None
        # Each core reports cumulative prefix-cache, preemption and tier counts; counters advance by the
        # difference from that core's last snapshot (a key per count, 0 before the first).
        self._last: list[defaultdict[str, int]] = [defaultdict(int) for _ in self.engines]

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats, engine_index: int = 0) -> None:
        labels = (self.model_name, self.engines[engine_index])
        self.gauge_running.labels(*labels).set(scheduler_stats.num_running)
        self.gauge_waiting.labels(*labels).set(scheduler_stats.num_waiting)
        self.gauge_kv_usage.labels(*labels).set(scheduler_stats.kv_cache_usage)
        self._advance(self.counter_prefix_queries, scheduler_stats.prefix_cache_queries, engine_index, "prefix_queries")
        self._advance(self.counter_prefix_hits, scheduler_stats.prefix_cache_hits, engine_index, "prefix_hits")
        self._advance(self.counter_preemptions, scheduler_stats.num_preemptions_total, engine_index, "preemptions")
        self._record_offload(scheduler_stats, engine_index)
        if self.spec_decode is not None:
            self.spec_decode.record(scheduler_stats.spec_decoding, engine_index)
        if self.kv_transfer is not None and getattr(scheduler_stats, "kv_transfer", None) is not None:
            self.kv_transfer.record(scheduler_stats.kv_transfer, engine_index)
        self.counter_prompt_tokens.labels(*labels).inc(iteration_stats.num_prompt_tokens)
        self.counter_generation_tokens.labels(*labels).inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.hist_ttft.labels(*labels).observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.hist_itl.labels(*labels).observe(itl)
        for finished in iteration_stats.finished_requests:
            self.counter_request_success.labels(*labels, finished.finish_reason).inc()
            self.hist_e2e.labels(*labels).observe(finished.e2e_latency)
            self.hist_queue.labels(*labels).observe(finished.queue_time)

    def _record_offload(self, stats: SchedulerStats, engine_index: int) -> None:
        """The host tier's counters (0 where the snapshot has none: no tier, or a core without one)."""
        labels = (self.model_name, self.engines[engine_index])
        self.gauge_offload_usage.labels(*labels).set(getattr(stats, "kv_offload_cpu_usage", 0.0))
        for direction, field in [
            ("to_cpu", "kv_offload_blocks_to_cpu_total"),
            ("to_device", "kv_offload_blocks_to_device_total"),
            ("to_disk", "kv_offload_blocks_to_disk_total"),
            ("from_disk", "kv_offload_blocks_from_disk_total"),
        ]:
            self._advance(self.counter_offload_blocks, getattr(stats, field, 0), engine_index, field, direction)
        queries = getattr(stats, "external_prefix_cache_queries", 0)
        self._advance(self.counter_external_queries, queries, engine_index, "external_queries")
        hits = getattr(stats, "external_prefix_cache_hits", 0)
        self._advance(self.counter_external_hits, hits, engine_index, "external_hits")
        swapped = getattr(stats, "num_swapped_preemptions_total", 0)
        self._advance(self.counter_swapped_preemptions, swapped, engine_index, "swapped_preemptions")
        self.gauge_offload_disk_usage.labels(*labels).set(getattr(stats, "kv_offload_disk_usage", 0.0))
        failed = getattr(stats, "kv_offload_disk_failed_loads_total", 0)
        self._advance(self.counter_disk_failed_loads, failed, engine_index, "disk_failed_loads")

    def _advance(self, counter: Counter, cumulative: int, engine_index: int, key: str, *labels: str) -> None:
        """Advances ``counter`` by what core ``engine_index``'s cumulative count ``key`` grew since its last
        snapshot (never back)."""
        last = self._last[engine_index]
        delta = cumulative - last[key]
        if delta > 0:
            counter.labels(self.model_name, self.engines[engine_index], *labels).inc(delta)
        last[key] = max(cumulative, last[key])

    def render(self) -> bytes:
        """The Prometheus text exposition of this server's registry."""
        return generate_latest(self.registry)


class LoggingStatLogger:
    """vLLM's periodic line: throughput over the interval, queue sizes, KV usage and prefix hit rate. ``prefix``
    starts the line ("Engine 001: " with data parallelism, as vLLM's per-engine lines)."""

    def __init__(
        self, interval_s: float = 10.0, host_tier: bool = False, spec_decode: bool = False, prefix: str = ""
    ) -> None:
        self.interval_s = interval_s
        self.prefix = prefix
        self.host_tier = host_tier  # a host KV tier exists: the line adds its usage and hit rate
        self.spec_decode = SpecDecodeLogPart() if spec_decode else None  # adds the acceptance over the interval
        self._last_log_time = time.monotonic()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._prefix_queries = 0  # cumulative, from the last snapshot
        self._prefix_hits = 0
        self._external_queries = 0  # cumulative, host tier
        self._external_hits = 0
        self._last: SchedulerStats | None = None
        self._logged_idle = True  # nothing to report until the first step

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats, engine_index: int = 0) -> None:
        self._num_prompt_tokens += iteration_stats.num_prompt_tokens
        self._num_generation_tokens += iteration_stats.num_generation_tokens
        self._last = scheduler_stats
        self._logged_idle = False
        if time.monotonic() - self._last_log_time >= self.interval_s:
            self.log()

    def log_if_due(self) -> None:
        """Called by the server every interval, so the line also appears (once) after the engine goes idle."""
        if not self._logged_idle and time.monotonic() - self._last_log_time >= self.interval_s:
            self.log()

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_log_time, 1e-9)
        stats = self._last
        running = stats.num_running if stats else 0
        waiting = stats.num_waiting if stats else 0
        usage = stats.kv_cache_usage if stats else 0.0
        queries = (stats.prefix_cache_queries if stats else 0) - self._prefix_queries
        hits = (stats.prefix_cache_hits if stats else 0) - self._prefix_hits
        hit_rate = hits / queries if queries > 0 else 0.0
        logger.info(
            "%sAvg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%%s%s",
            self.prefix,
            self._num_prompt_tokens / elapsed,
            self._num_generation_tokens / elapsed,
            running,
            waiting,
            usage * 100,
            hit_rate * 100,
            self._host_tier_part(stats),
            self.spec_decode.text(stats.spec_decoding if stats else None) if self.spec_decode else "",
        )
        if stats is not None:
            self._prefix_queries, self._prefix_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._last_log_time = now
        self._logged_idle = running == 0 and waiting == 0

    def _host_tier_part(self, stats: SchedulerStats | None) -> str:
        """', CPU KV cache usage: U%, CPU prefix cache hit rate: H%' over the interval; '' without a host tier.
        Advances the interval's starting point of the host tier's counters."""
        if not self.host_tier:
            return ""
        usage = getattr(stats, "kv_offload_cpu_usage", 0.0)
        queries_total = getattr(stats, "external_prefix_cache_queries", 0)
        hits_total = getattr(stats, "external_prefix_cache_hits", 0)
        queries, hits = queries_total - self._external_queries, hits_total - self._external_hits
        if stats is not None:
            self._external_queries, self._external_hits = queries_total, hits_total
        rate = hits / queries if queries > 0 else 0.0
        return f", CPU KV cache usage: {usage * 100:.1f}%, CPU prefix cache hit rate: {rate * 100:.1f}%"


class EngineLogLines:
    """One periodic line per engine core (data parallelism), behind the one-logger interface the server uses."""

    def __init__(self, num_engines: int, host_tier: bool = False, spec_decode: bool = False) -> None:
        self.lines = [
            LoggingStatLogger(host_tier=host_tier, spec_decode=spec_decode, prefix=f"Engine {i:03d}: ")
            for i in range(num_engines)
        ]
        self.interval_s = self.lines[0].interval_s

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats, engine_index: int = 0) -> None:
        self.lines[engine_index].record(scheduler_stats, iteration_stats)

    def log_if_due(self) -> None:
        for line in self.lines:
            line.log_if_due()
