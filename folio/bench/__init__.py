"""`folio bench throughput | latency | serve`: vLLM-compatible benchmarks (datasets, metrics, plots)."""
