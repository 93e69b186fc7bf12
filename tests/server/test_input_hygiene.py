"""The pieces of input hygiene on their own: finding invalid text in a body, escaping echoed text, and error
envelopes that can always be sent, the last-resort 500 included."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.testclient import TestClient

from folio.server.errors import APIError, install_exception_handlers
from folio.server.input_hygiene import encodable, find_invalid_text, lone_surrogate_index, quote_text

LONE = "\ud800"


def test_lone_surrogate_index() -> None:
    assert lone_surrogate_index("plain ascii") is None
    assert lone_surrogate_index("naïve 😀 模型") is None
    assert lone_surrogate_index("ab" + LONE) == 2
    assert lone_surrogate_index("\udc00x") == 0


def test_find_invalid_text_names_the_field_as_a_client_writes_it() -> None:
    assert find_invalid_text({"prompt": "fine", "n": 2, "prompt_ids": [1, 2, 3]}) is None
    assert find_invalid_text({"prompt": ["ok", "x" + LONE]}) == ("prompt[1]", 1)
    body = {
        "messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": LONE}]}]
    }
    assert find_invalid_text(body) == ("messages[1].content[0].text", 0)
    assert find_invalid_text({"stop": ["a"], "bad_words": [LONE], "user": LONE}) == ("bad_words[0]", 0)
    assert find_invalid_text({LONE + "key": 1}) == ("\\ud800key", 0)  # the path itself is escaped
    assert find_invalid_text(LONE) == ("body", 0)


def test_find_invalid_text_survives_deep_nesting() -> None:
    deep: list[object] = [LONE]
    for _ in range(5000):  # far past Python's recursion limit
        deep = [deep]
    found = find_invalid_text({"prompt": deep})
    assert found is not None and found[0] == "prompt" + "[0]" * 5001


def test_echoed_text_is_escaped() -> None:
    assert encodable("ok " + LONE) == "ok \\ud800"
    assert encodable("模型") == "模型"
    assert quote_text("gpt\x00\n" + LONE) == "'gpt\\x00\\n\\ud800'"
    assert quote_text("x" * 500).endswith("... (500 characters)")


def test_api_error_with_a_surrogate_is_sendable() -> None:
    response = APIError(404, f"The model '{LONE}' does not exist", param=LONE).to_response()
    error = json.loads(response.body)["error"]
    assert error["message"] == "The model '\\ud800' does not exist" and error["param"] == "\\ud800"


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


def test_last_resort_handler_cannot_fail() -> None:
    """A bug that raises with unencodable text, or with an exception whose str() raises, is still a 500 envelope."""
    app = FastAPI()
    install_exception_handlers(app)

    @app.get("/surrogate")
    async def surrogate() -> None:
        raise TypeError("bad text " + LONE)

    @app.get("/unprintable")
    async def unprintable() -> None:
        raise UnprintableError()

    client = TestClient(app, raise_server_exceptions=False)
    response = client.get("/surrogate")
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal server error: TypeError: bad text \\ud800"
    response = client.get("/unprintable")
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal server error: UnprintableError"
