"""The tests' engine budget, one place for the engine and server tests: 128 MiB of KV (2912 tokens of SmolLM2 in
float32) and a 2048-token context. Several engines live in one session, also on a GPU, and every fresh engine process
faults its cache in (about 1 CPU-s for 512 MiB on these VMs); the default max_model_len (8192) needs about 360 MiB.
And on 4 KiB pages (cpu_huge_pages off): a huge page's first touch costs these VMs 5-10x a small page's, every
engine's and server's start pays it for its weights and cache, and a test's engine lives seconds, not long enough to
gain it back. The huge-page placement itself is tests/engine/test_huge_pages.py's."""

from __future__ import annotations

TEST_KV_BYTES = 128 * 2**20
TEST_MAX_MODEL_LEN = 2048
# Engine arguments (LLM, EngineArgs) for that budget; a test's own keywords come after it.
SMALL_ENGINE = {"kv_cache_memory_bytes": TEST_KV_BYTES, "max_model_len": TEST_MAX_MODEL_LEN, "cpu_huge_pages": False}
# The same as command-line flags (folio serve, generate, chat, bench); a test's own flags come after them.
SMALL_ENGINE_FLAGS = [
    "--kv-cache-memory-bytes",
    str(TEST_KV_BYTES),
    "--max-model-len",
    str(TEST_MAX_MODEL_LEN),
    "--no-cpu-huge-pages",
]
