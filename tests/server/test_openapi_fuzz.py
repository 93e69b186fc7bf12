"""/openapi.json tells the truth: its shape, what the small routes really send, and a bounded Schemathesis run
against a live `folio serve` in which every check passes (no 5xx, only documented statuses, content types and
response bodies, SSE events included)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess, metric, start_server

# Small context and queue: every generated request is short, and a huge n or prompt list is refused (400).
FUZZ_SERVER_ARGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-queued-reqs", "4"]
EXAMPLES_PER_OPERATION = 50
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
]
TIME_CAP_S = 150.0  # the whole Schemathesis run; a hang guard (it takes ~5-10 s here)
VOCAB_SIZE = 49152  # the default model's (SmolLM2)
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(Path(tmp_path_factory.mktemp("fuzz")), "fuzz", FUZZ_SERVER_ARGS)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def spec(fuzz_server: ServerProcess) -> dict[str, Any]:
    response = httpx.get(fuzz_server.url("/openapi.json"), timeout=30)
    assert response.status_code == 200
    return dict(response.json())


def _operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            yield path, method, operation


def test_errors_are_documented_as_the_envelope(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}
    for path, method, operation in _operations(spec):
        responses = operation["responses"]
        assert "422" not in responses, (method, path)
        if method == "post" and path != "/ping":
            assert "400" in responses, (method, path)
        for status, response in responses.items():
            if status != "200":
                assert response["content"] == {"application/json": {"schema": ERROR_REF}}, (method, path, status)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "415", "500", "503"}
        assert "Retry-After" in responses["503"]["headers"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}


def test_small_routes_send_what_the_spec_says(fuzz_server: ServerProcess, spec: dict[str, Any]) -> None:
    paths = spec["paths"]
    for path in ("/health", "/ping"):
        assert "content" not in paths[path]["get"]["responses"]["200"]
        response = httpx.get(fuzz_server.url(path))
        assert (response.status_code, response.content, response.headers.get("content-type")) == (200, b"", None)
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    response = httpx.get(fuzz_server.url("/metrics"))
    assert response.headers["content-type"].startswith("text/plain")
    assert metric(fuzz_server.metrics(), "folio:num_requests_in_flight") == 0
    version_ref = paths["/version"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    version_schema = spec["components"]["schemas"][version_ref.rsplit("/", 1)[1]]
    version = httpx.get(fuzz_server.url("/version")).json()
    assert set(version) == set(version_schema["properties"]) == {"version", "engine_core_pid", "engine_core_pids"}


def bounded(spec: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The spec with the size of generated work capped: max_tokens 1-8 and always sent (absent or null, it fills
    the context: 27 requests then generated 1247 tokens, and the server spent 50-65 CPU-s on them), n and best_of
    1-2, token ids inside the vocabulary, and the served model or none (negative cases still send others).
    Everything else is generated as the server documents it."""
    spec = copy.deepcopy(spec)
    schemas = spec["components"]["schemas"]
    for name, required in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens")):
        props = schemas[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field] = {"type": "integer", "minimum": 1, "maximum": 8}
        schemas[name]["required"] = sorted({*schemas[name].get("required", []), required})
        props["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
    schemas["CompletionRequest"]["properties"]["best_of"] = {
        "anyOf": [{"type": "integer", "minimum": 1, "maximum": 2}, {"type": "null"}]
    }
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        schemas[name]["properties"]["model"] = {"anyOf": [{"const": MODEL_NAME}, {"type": "null"}]}
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    schemas["DetokenizeRequest"]["properties"]["tokens"] = {"type": "array", "items": token_id}
    return spec


def _schemathesis_script() -> str:
    script = Path(sys.executable).parent / "schemathesis"
    if not script.exists():
        pytest.fail("schemathesis is not installed in the venv (a dev dependency)")
    return str(script)


def test_schemathesis_every_check_passes(fuzz_server: ServerProcess, spec: dict[str, Any], tmp_path: Path) -> None:
    spec_path = tmp_path / "bounded_openapi.json"
    spec_path.write_text(json.dumps(bounded(spec, VOCAB_SIZE)))
    command = [_schemathesis_script(), "run", str(spec_path), "--url", fuzz_server.base_url]
    command += ["--checks", ",".join(CHECKS), "--phases", "examples,fuzzing"]
    command += ["--max-examples", str(EXAMPLES_PER_OPERATION), "--generation-deterministic", "--workers", "1"]
    # Hypothesis' health checks judge the data generator, not the server; a slow CI machine must not fail them.
    command += ["--suppress-health-check", "all", "--request-timeout", "30", "--no-color"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIME_CAP_S, cwd=tmp_path)
    summary = result.stdout[result.stdout.rfind("SUMMARY") :]
    print(summary)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", summary)
    assert counts is not None and counts.group(1) == counts.group(2) and int(counts.group(1)) > 0, summary
    assert "Tested: 10" in summary
    assert httpx.get(fuzz_server.url("/health")).status_code == 200
