"""Disaggregated prefill and decode: KV blocks pushed by hash from a prefill instance to a decode instance over TCP
(docs/scale_out.md, "Disaggregated prefill and decode")."""
