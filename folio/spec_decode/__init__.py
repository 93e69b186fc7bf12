"""Speculative decoding: the config and the proposers (docs/speculative_decoding.md)."""
