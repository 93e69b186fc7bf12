"""/metrics of the shared server: every metric is exposed at 0 before its first request (as it served them then),
and a known workload advances the counters by exactly its counts (waiting for an idle server first, nothing else
can move them: the tests send requests one module at a time)."""

from __future__ import annotations

import httpx

from tests.server.conftest import ServerProcess, metric, parse_metrics, server_is_idle, wait_until

GAUGES = ["folio:num_requests_running", "folio:num_requests_waiting", "folio:kv_cache_usage_perc"]
GAUGES += ["folio:kv_offload_cpu_usage_perc"]
COUNTERS = [
    "folio:prefix_cache_queries_total",
    "folio:prefix_cache_hits_total",
    "folio:num_preemptions_total",
    "folio:prompt_tokens_total",
    "folio:generation_tokens_total",
    "folio:external_prefix_cache_queries_total",
    "folio:external_prefix_cache_hits_total",
    "folio:num_swapped_preemptions_total",
]
HISTOGRAMS = [
    "folio:time_to_first_token_seconds",
    "folio:inter_token_latency_seconds",
    "folio:e2e_request_latency_seconds",
    "folio:request_queue_time_seconds",
]


def completion(server: ServerProcess, **body: object) -> dict[str, object]:
    response = httpx.post(server.url("/v1/completions"), json={"temperature": 0, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_every_metric_exposed_before_any_request(server: ServerProcess) -> None:
    text = server.metrics_at_start
    assert text is not None, "the shared server's fixture reads /metrics before any request"
    values = parse_metrics(text)
    for name in GAUGES + COUNTERS:
        assert metric(values, name) == 0.0, name
    for reason in ("stop", "length", "abort"):
        assert metric(values, "folio:request_success_total", finished_reason=reason) == 0.0
    for direction in ("to_cpu", "to_device"):
        assert metric(values, "folio:kv_offload_blocks_total", direction=direction) == 0.0
    for name in HISTOGRAMS:
        assert metric(values, f"{name}_count") == 0.0
        assert f"# TYPE {name} histogram" in text


def test_counters_equal_known_workload(server: ServerProcess) -> None:
    """Three requests: 4 and 6 tokens (length), then 1 token ended by a stop token id (stop)."""
    assert wait_until(lambda: server_is_idle(server), timeout_s=60), "requests of earlier tests still run"
    before = server.metrics()
    prompts = ["The capital of France is", "Once upon a time there was", "The capital of France is"]
    first = completion(server, prompt=prompts[0], max_tokens=4, ignore_eos=True, logprobs=0)
    completion(server, prompt=prompts[1], max_tokens=6, ignore_eos=True)
    first_token_text = first["choices"][0]["logprobs"]["tokens"][0]  # type: ignore[index]
    first_token_id = httpx.post(server.url("/tokenize"), json={"prompt": first_token_text}).json()["tokens"][0]
    stopped = completion(server, prompt=prompts[2], max_tokens=6, stop_token_ids=[first_token_id])
    assert stopped["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    assert stopped["usage"]["completion_tokens"] == 1  # type: ignore[index]

    num_prompt_tokens = sum(httpx.post(server.url("/tokenize"), json={"prompt": p}).json()["count"] for p in prompts)
    values = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric(values, name, **labels) - metric(before, name, **labels)

    assert delta("folio:prompt_tokens_total") == num_prompt_tokens
    assert delta("folio:generation_tokens_total") == 4 + 6 + 1
    assert delta("folio:request_success_total", finished_reason="length") == 2
    assert delta("folio:request_success_total", finished_reason="stop") == 1
    assert delta("folio:request_success_total", finished_reason="abort") == 0
    for name in ("folio:time_to_first_token_seconds", "folio:e2e_request_latency_seconds"):
        assert delta(f"{name}_count") == 3, name
    assert delta("folio:request_queue_time_seconds_count") == 3
    assert delta("folio:inter_token_latency_seconds_count") == (4 - 1) + (6 - 1) + (1 - 1)
    assert delta("folio:prefix_cache_queries_total") >= num_prompt_tokens
    assert metric(values, "folio:num_requests_running") == 0
    assert metric(values, "folio:kv_cache_usage_perc") == 0
