"""``use_beam_search`` through the openai client (vLLM's extra field, ``n`` the beam width) on the shared real
server: the choices are the offline ``LLM.beam_search`` sequences, best first; bad input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from folio import LLM, BeamSearchParams
from folio.beam_search import BeamSearchSequence, get_beam_search_score
from tests.server.conftest import (
    MODEL_NAME,
    ServerProcess,
    metric,
    parse_metrics,
    server_is_idle,
    wait_until,
)
from tests.small_engine import SMALL_ENGINE

PROMPT = "The three primary colors are"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WIDTH = 3
MAX_TOKENS = 12
HANG_GUARD_S = 120.0


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(dtype="float32", **SMALL_ENGINE)


def expected_texts(llm: LLM, prompt: Any, length_penalty: float = 1.0) -> list[str]:
    """The offline search's sequences as the server shows them: the output text, without an ending EOS."""
    [result] = llm.beam_search(prompt, BeamSearchParams(WIDTH, MAX_TOKENS, length_penalty=length_penalty))
    scores = [score(seq, length_penalty) for seq in result.sequences]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == WIDTH  # best first, no ties
    tokenizer = llm.get_tokenizer()
    texts = []
    for seq in result.sequences:
        output = seq.output_token_ids[:-1] if seq.finish_reason == "stop" else seq.output_token_ids
        texts.append(tokenizer.decode(output))
    return texts


def score(seq: BeamSearchSequence, length_penalty: float) -> float:
    return get_beam_search_score(len(seq.output_token_ids), seq.cum_logprob, length_penalty)


def test_completion_choices_are_the_offline_beams(client: Any, llm: LLM) -> None:
    expected = expected_texts(llm, PROMPT)
    body = {"use_beam_search": True}
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=WIDTH, max_tokens=MAX_TOKENS, extra_body=body
    )
    assert [c.index for c in completion.choices] == list(range(WIDTH))
    assert [c.text for c in completion.choices] == expected
    assert {c.finish_reason for c in completion.choices} <= {"stop", "length"}
    # Streamed, the same choices arrive whole, each in one chunk, as vLLM sends them.
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, n=WIDTH, max_tokens=MAX_TOKENS, stream=True, extra_body=body
    )
    texts = [""] * WIDTH
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected


def test_chat_choices_are_the_offline_beams(client: Any, llm: LLM) -> None:
    prompt_ids = llm.get_tokenizer().apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids["input_ids"]
    expected = expected_texts(llm, {"prompt_token_ids": list(prompt_ids)})
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, n=WIDTH, max_tokens=MAX_TOKENS, extra_body={"use_beam_search": True}
    )
    assert [c.message.content for c in chat.choices] == expected
    assert "stop" in {c.finish_reason for c in chat.choices}  # a chat answer ends in EOS, which the text omits
    # length_penalty 2 favours longer answers: here the top two swap.
    expected_2 = expected_texts(llm, {"prompt_token_ids": list(prompt_ids)}, length_penalty=2.0)
    assert expected_2[:2] == expected[1::-1]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        n=WIDTH,
        max_tokens=MAX_TOKENS,
        extra_body={"use_beam_search": True, "length_penalty": 2.0},
    )
    assert [c.message.content for c in chat.choices] == expected_2


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"n": 0}, "n", "n (the beam width with use_beam_search) must be in [1, 10], got 0"),
        ({"n": 11}, "n", "n (the beam width with use_beam_search) must be in [1, 10], got 11"),
        ({"top_p": 0.5}, "top_p", "top_p is not supported with use_beam_search"),
        ({"stop": ["."]}, "stop", "stop is not supported with use_beam_search"),
        ({"seed": 1}, "seed", "seed is not supported with use_beam_search"),
        ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5"),
        (
            {"structured_outputs": {"choice": ["a", "b"]}},
            "structured_outputs",
            "structured_outputs is not supported with use_beam_search",
        ),
        (
            {"response_format": {"type": "json_object"}},
            "response_format",
            "response_format is not supported with use_beam_search",
        ),
    ],
)
def test_bad_beam_input_is_a_400_naming_the_field(
    client: Any, server: ServerProcess, extra: dict[str, Any], param: str, message: str
) -> None:
    body = {"use_beam_search": True, "n": 2, **extra}
    for create in (
        lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body=body),
        lambda: client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=4, extra_body=body),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        error = info.value.body
        assert (error["param"], error["message"]) == (param, message)
    assert wait_until(lambda: server_is_idle(server), timeout_s=30)  # nothing was queued, nothing leaked


def test_disconnect_aborts_the_search(server: ServerProcess) -> None:
    """A client gone mid-search: the step requests in flight are aborted and no step follows (the search would
    otherwise run 400 more steps); every KV block comes back."""
    assert wait_until(lambda: server_is_idle(server), HANG_GUARD_S), "the server was busy before the test"

    def counts() -> tuple[float, float]:
        values = server.metrics()
        return tuple(metric(values, "folio:request_success_total", finished_reason=r) for r in ("length", "abort"))

    steps_before, aborted_before = counts()
    log_offset = len(server.log_path.read_bytes())
    body = {"prompt": PROMPT, "n": 4, "max_tokens": 400, "ignore_eos": True, "use_beam_search": True}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as aclient:
            task = asyncio.create_task(aclient.post(server.url("/v1/completions"), json=body))
            deadline = time.monotonic() + HANG_GUARD_S
            while True:  # each step request ends with "length" (one token): wait for step 3
                values = parse_metrics((await aclient.get(server.url("/metrics"))).text)
                if metric(values, "folio:request_success_total", finished_reason="length") >= steps_before + 9:
                    break
                assert time.monotonic() < deadline, "the search never got to its third step"
                await asyncio.sleep(0.05)
            task.cancel()  # closes the connection mid-search
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert wait_until(lambda: counts()[1] > aborted_before and server_is_idle(server), HANG_GUARD_S), counts()
    steps_after, _ = counts()
    assert steps_after - steps_before < 1 + 4 * 399  # the search ended early

    def log() -> str:
        return server.log_path.read_bytes()[log_offset:].decode(errors="replace")

    assert wait_until(lambda: "aborted: client disconnected" in log(), HANG_GUARD_S), log()
    assert "Traceback" not in log() and "ERROR" not in log(), log()
