"""Input hygiene: every text a client sends is valid Unicode before the tokenizer, the grammar or an error message
sees it, and any text an error echoes is escaped, so that building an error can never fail.

JSON's ``"\\ud800"`` escape is valid JSON, and Python decodes it to a lone surrogate: a ``str`` that UTF-8 cannot
encode. The tokenizer raises TypeError on it and a response that echoes it fails to encode (both were 500s). One
walk over the decoded body (``find_invalid_text``, run by the request models before they validate) refuses such
text with a 400 that names the field as a client wrote it: ``prompt[1]``, ``messages[0].content``, ``stop[0]``.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

# JSON scalars that hold no text: a list of only these (token ids, logit values) needs no per-item walk.
_TEXTLESS_TYPES = frozenset({int, float, bool, type(None)})


def lone_surrogate_index(text: str) -> int | None:
    """The index of the first character of ``text`` that UTF-8 cannot encode (a lone surrogate), else None."""
    if text.isascii():  # O(1) in CPython: the flag is stored with the string
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def encodable(text: str) -> str:
    """``text`` with every character UTF-8 cannot encode written as its ``\\udXXX`` escape; safe in any response."""
    if lone_surrogate_index(text) is None:
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def quote_text(text: str, limit: int = 200) -> str:
    """``text`` quoted for an error message that echoes it: repr escapes (surrogates and control characters as
    escapes, printable non-ASCII kept), cut after ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + f"... ({len(text)} characters)"


# (value, parent node, key or index in the parent): the walk builds a field's path only when it reports it.
_Node = tuple[Any, Any, str | int]


def find_invalid_text(body: Any) -> tuple[str, int] | None:
    """(field path, character index) of the first string in a decoded JSON body that is not valid Unicode, keys
    included; None when all text is valid. Paths read as a client writes them: ``messages[0].content[1].text``.

    Iterative (an explicit stack), so that a deeply nested body cannot exhaust Python's recursion limit, and cheap
    on the big shapes (a long prompt, long lists of token ids or of ASCII strings): those are checked in C.
    """
    stack: list[_Node] = [(body, None, "")]
    while stack:
        node = stack.pop()
        value = node[0]
        if isinstance(value, str):
            index = lone_surrogate_index(value)
            if index is not None:
                return _path(node) or "body", index
        elif isinstance(value, dict):
            children: list[_Node] = []
            for key, item in value.items():
                index = lone_surrogate_index(str(key))
                if index is not None:
                    return _path((None, node, str(key))), index
                if type(item) not in _TEXTLESS_TYPES:
                    children.append((item, node, str(key)))
            stack.extend(reversed(children))  # the first field is reported first
        elif isinstance(value, list):
            types = set(map(type, value))
            if types <= _TEXTLESS_TYPES:
                continue  # token ids, numbers
            if types == {str}:
                found = _first_invalid_string(value)
                if found is not None:
                    return _path((None, node, found[0])), found[1]
                continue
            if types == {list} and set(map(type, itertools.chain.from_iterable(value))) <= _TEXTLESS_TYPES:
                continue  # lists of token ids
            stack.extend(
                (value[i], node, i) for i in reversed(range(len(value))) if type(value[i]) not in _TEXTLESS_TYPES
            )
    return None


def _first_invalid_string(strings: list[str]) -> tuple[int, int] | None:
    """(item, character index) of the first invalid character in a list of strings, found in C-speed passes."""
    index = lone_surrogate_index("".join(strings))
    if index is None:
        return None
    ends = list(itertools.accumulate(map(len, strings)))  # item i covers [ends[i-1], ends[i]) of the join
    item = bisect.bisect_right(ends, index)
    return item, index - (ends[item - 1] if item else 0)


def _path(node: _Node) -> str:
    """The path from the body to ``node``: keys joined with '.', indices as [i]; keys escaped (they are text)."""
    keys: list[str | int] = []
    while node[1] is not None:
        keys.append(node[2])
        node = node[1]
    parts: list[str] = []
    for key in reversed(keys):
        if isinstance(key, int):
            parts.append(f"[{key}]")
        else:
            parts.append(("." if parts else "") + encodable(key))
    return "".join(parts)


class InvalidTextError(ValueError):
    """A field holds text that is not valid Unicode; ``path`` names the field as the client wrote it."""

    def __init__(self, path: str, index: int) -> None:
        super().__init__(
            f"{path} is not valid Unicode: character {index} is a lone surrogate (half of a UTF-16 pair, such as "
            "\\ud800, without the other half). Send text as UTF-8, or write a character outside the Basic "
            "Multilingual Plane as a complete surrogate pair."
        )
        self.path = path
        self.index = index


def check_text(body: Any) -> None:
    """Raises InvalidTextError for the first string in ``body`` that is not valid Unicode."""
    found = find_invalid_text(body)
    if found is not None:
        raise InvalidTextError(*found)
