"""Stat loggers: Prometheus metrics under ``folio:`` (vLLM's names and buckets) and vLLM's periodic log line.

Both implement ``StatLogger``: the AsyncLLM calls ``record`` after each engine-core step with the core's
scheduler snapshot and what the frontend measured for that step's outputs. Each server owns its own
CollectorRegistry, so two apps in one process (tests) never share counters.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from folio.engine.stats import IterationStats, SchedulerStats
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
    """Every metric carries the ``model_name`` label, as vLLM's do. ``num_speculative_tokens``: speculation is on,
    and its counters exist (folio/server/spec_decode_metrics.py)."""

    def __init__(self, model_name: str, num_speculative_tokens: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
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
            self.counter_offload_blocks.labels(model_name, direction)
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
            self.counter_request_success.labels(model_name, reason)
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
            metric.labels(model_name)  # every series is exposed (at 0) before the first request
        self.spec_decode = (
            SpecDecodePrometheus(reg, model_name, num_speculative_tokens) if num_speculative_tokens else None
        )
        # The core reports cumulative prefix-cache and preemption counts; counters advance by the difference.
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._last_preemptions = 0
        self._last_offload_to_cpu = 0
        self._last_offload_to_device = 0
        self._last_external_queries = 0
        self._last_external_hits = 0
        self._last_swapped_preemptions = 0
        self._last_offload_to_disk = 0
        self._last_offload_from_disk = 0
        self._last_disk_failed_loads = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        name = self.model_name
        self.gauge_running.labels(name).set(scheduler_stats.num_running)
        self.gauge_waiting.labels(name).set(scheduler_stats.num_waiting)
        self.gauge_kv_usage.labels(name).set(scheduler_stats.kv_cache_usage)
        self._advance(self.counter_prefix_queries, scheduler_stats.prefix_cache_queries, "_last_prefix_queries")
        self._advance(self.counter_prefix_hits, scheduler_stats.prefix_cache_hits, "_last_prefix_hits")
        self._advance(self.counter_preemptions, scheduler_stats.num_preemptions_total, "_last_preemptions")
        self._record_offload(scheduler_stats)
        if self.spec_decode is not None:
            self.spec_decode.record(scheduler_stats.spec_decoding)
        self.counter_prompt_tokens.labels(name).inc(iteration_stats.num_prompt_tokens)
        self.counter_generation_tokens.labels(name).inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.hist_ttft.labels(name).observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.hist_itl.labels(name).observe(itl)
        for finished in iteration_stats.finished_requests:
            self.counter_request_success.labels(name, finished.finish_reason).inc()
            self.hist_e2e.labels(name).observe(finished.e2e_latency)
            self.hist_queue.labels(name).observe(finished.queue_time)

    def _record_offload(self, stats: SchedulerStats) -> None:
        """The host tier's counters (0 where the snapshot has none: no tier, or a core without one)."""
        self.gauge_offload_usage.labels(self.model_name).set(getattr(stats, "kv_offload_cpu_usage", 0.0))
        to_cpu, to_device = (getattr(stats, f"kv_offload_blocks_to_{d}_total", 0) for d in ("cpu", "device"))
        self._advance(self.counter_offload_blocks, to_cpu, "_last_offload_to_cpu", "to_cpu")
        self._advance(self.counter_offload_blocks, to_device, "_last_offload_to_device", "to_device")
        queries = getattr(stats, "external_prefix_cache_queries", 0)
        self._advance(self.counter_external_queries, queries, "_last_external_queries")
        self._advance(
            self.counter_external_hits, getattr(stats, "external_prefix_cache_hits", 0), "_last_external_hits"
        )
        swapped = getattr(stats, "num_swapped_preemptions_total", 0)
        self._advance(self.counter_swapped_preemptions, swapped, "_last_swapped_preemptions")
        self.gauge_offload_disk_usage.labels(self.model_name).set(getattr(stats, "kv_offload_disk_usage", 0.0))
        to_disk, from_disk = (getattr(stats, f"kv_offload_blocks_{d}_disk_total", 0) for d in ("to", "from"))
        self._advance(self.counter_offload_blocks, to_disk, "_last_offload_to_disk", "to_disk")
        self._advance(self.counter_offload_blocks, from_disk, "_last_offload_from_disk", "from_disk")
        failed = getattr(stats, "kv_offload_disk_failed_loads_total", 0)
        self._advance(self.counter_disk_failed_loads, failed, "_last_disk_failed_loads")

    def _advance(self, counter: Counter, cumulative: int, last_attr: str, *labels: str) -> None:
        delta = cumulative - getattr(self, last_attr)
        if delta > 0:
            counter.labels(self.model_name, *labels).inc(delta)
        setattr(self, last_attr, max(cumulative, getattr(self, last_attr)))

    def render(self) -> bytes:
        """The Prometheus text exposition of this server's registry."""
        return generate_latest(self.registry)


class LoggingStatLogger:
    """vLLM's periodic line: throughput over the interval, queue sizes, KV usage and prefix hit rate."""

    def __init__(self, interval_s: float = 10.0, host_tier: bool = False, spec_decode: bool = False) -> None:
        self.interval_s = interval_s
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

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
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
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%%s%s",
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
