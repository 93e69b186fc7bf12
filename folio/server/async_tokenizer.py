"""AsyncTokenizer: the server's tokenizer work (prompts, chat templates, /tokenize, /detokenize) off the event loop.

A 10 MB prompt takes seconds to tokenize; on the event loop that stalled every other client, /health included.
Here it runs on one worker thread, as vLLM's server does: the Hugging Face fast tokenizer releases the GIL while
it works. The thread has its own copy of the tokenizer, and only that thread calls it: a Rust tokenizer shared
between threads may refuse with "Already borrowed". The incremental detokenization of each step's new tokens
stays on the loop with the original (a few tokens per request).

Errors raised by the tokenizer or the chat template on a client's input become TokenizerInputError, which the
serving code answers with a 400 naming the field: the client's input failed, not the server.
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from folio.server.input_hygiene import encodable

T = TypeVar("T")


class TokenizerInputError(ValueError):
    """The tokenizer or the chat template raised on a client's input; ``param`` names the input."""

    def __init__(self, param: str, what: str, error: BaseException) -> None:
        super().__init__(encodable(f"{what}: {type(error).__name__}: {error}"))
        self.param = param


class AsyncTokenizer:
    """A tokenizer whose calls run on one worker thread and are awaited on the loop."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)  # this thread's own (70 ms for SmolLM2's)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="folio-tokenizer")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = False) -> list[int]:
        return await self._run(self._encode, text, param, add_special_tokens)

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as e:
            raise TokenizerInputError(param, f"{param} could not be tokenized", e) from e

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """The tokenizer's chat template, as ``LLM.chat`` applies it, tokenized."""
        return await self._run(self._apply_chat_template, messages, add_generation_prompt)

    def _apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        try:
            token_ids = self.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja raises TemplateError for conversations the template refuses
            raise TokenizerInputError("messages", "the chat template rejected the messages", e) from e
        if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):
            token_ids = token_ids["input_ids"]
        return list(token_ids)

    async def decode(self, token_ids: list[int], param: str = "tokens") -> str:
        return await self._run(self._decode, token_ids, param)

    def _decode(self, token_ids: list[int], param: str) -> str:
        try:
            return str(self.tokenizer.decode(token_ids))
        except Exception as e:
            raise TokenizerInputError(param, f"{param} could not be detokenized", e) from e

    def shutdown(self) -> None:
        """Drops queued work; a call already running finishes on its thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)
