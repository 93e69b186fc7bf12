"""One streamed ``/v1/completions`` request against any OpenAI-compatible server, timed as vLLM times it."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from folio.bench.datasets import SampleRequest
from folio.bench.metrics import RequestResult


def completion_payload(model: str, request: SampleRequest) -> dict[str, Any]:
    """Token-id prompt (byte-identical for every peer), greedy, EOS ignored (unless the dataset ends at EOS),
    usage in the stream."""
    return {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": request.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line; None for blank lines, comments and other fields."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


async def send_completion(
    client: httpx.AsyncClient, base_url: str, model: str, request: SampleRequest
) -> RequestResult:
    """Sends one streaming request; times are taken when each choice-bearing message arrives.

    Output tokens come from ``usage.completion_tokens``; a server that sends no usage is counted by its number of
    choice-bearing messages (one token per message), which is a guess the result notes in ``error``-free runs only.
    """
    result = RequestResult(prompt_len=request.prompt_len)
    num_choice_messages = 0
    usage_tokens: int | None = None
    start = time.perf_counter()
    last = start
    try:
        async with client.stream(
            "POST", f"{base_url}/v1/completions", json=completion_payload(model, request)
        ) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
                data = _sse_data(line)
                if not data or data == "[DONE]":
                    continue
                message = json.loads(data)
                if "error" in message and not message.get("choices"):
                    result.error = json.dumps(message["error"])[:500]
                    return result
                if message.get("choices"):
                    now = time.perf_counter()
                    if num_choice_messages == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_choice_messages += 1
                usage = message.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if num_choice_messages == 0:
        result.error = "the stream carried no choices, so no TTFT"
        return result
    result.success = True
    result.e2el = last - start
    result.output_tokens = usage_tokens if usage_tokens is not None else num_choice_messages
    return result


async def fetch_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model ``GET /v1/models`` lists."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])
