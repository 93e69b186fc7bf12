"""The defaults of the server's per-request limits, and why (imported by the CLI without loading the server).

- ``--max-n-sequences`` (vLLM's VLLM_MAX_N_SEQUENCES, default 16384 there): 128, the most OpenAI's API allows for
  ``n``. One request's n sequences are all scheduled together; vLLM's 16384 let one streaming ``n=1000`` hold a
  small server's engine for minutes while every other client waited.
- ``--max-request-body-bytes`` (vLLM has none): 8 MiB. A full 128k-token context is about 0.5 MB of text or 1 MB
  of token ids in JSON, so this leaves room for batched prompts, while it bounds what one request can make the
  server buffer, parse and tokenize (a 10 MB prompt took 12 s of tokenizer time, only to be refused).
- ``temperature`` at most 2: OpenAI's documented range for its API (``SamplingParams`` itself, as vLLM's, takes any
  finite temperature >= 0 for offline use).
"""

from __future__ import annotations

DEFAULT_MAX_N_SEQUENCES = 128
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20
MAX_TEMPERATURE = 2.0
