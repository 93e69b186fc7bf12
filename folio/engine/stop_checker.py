"""Stop strings, checked on the detokenized text in the output processor (DESIGN.md convention 3).

Two questions per step, both answered in time proportional to the new text and the stop strings, not to the
whole output:
 - ``check_stop_strings``: did the text that just arrived complete a stop string? A match must end inside the new
   characters (earlier text was checked in earlier steps), so only the last ``new_char_count + len(stop) - 1``
   characters are searched.
 - ``stop_string_holdback``: how many trailing characters must a stream hold back because they might be the start
   of a stop string that the next token completes? Streaming them would show text that is then cut off.
"""

from __future__ import annotations


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Return (the stop string, the length to truncate ``output_text`` to) or None if no stop string completed.

    The truncation cuts before the stop string, or after it if ``include_stop_str_in_output``. When several stop
    strings complete in the same new text, the one that starts first wins (ties: the first in ``stop``).
    Example: text "Hello world" whose last 3 chars "rld" are new, stop ["wor"] -> "wor" at 6 ends inside the new
    chars -> ("wor", 6), i.e. "Hello "; with include_stop_str_in_output -> ("wor", 9), i.e. "Hello wor".
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        # The match must end after the old text: start at or after len(text) - new_char_count - len(stop) + 1.
        search_start = max(len(output_text) - new_char_count - len(stop_str) + 1, 0)
        index = output_text.find(stop_str, search_start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    return stop_str, index + len(stop_str) if include_stop_str_in_output else index


def stop_string_holdback(output_text: str, stop: list[str]) -> int:
    """The number of trailing characters of ``output_text`` that are a proper prefix of some stop string.

    Streaming ``output_text[: len(output_text) - holdback]`` never shows a partial stop string. Example: text
    "the end" and stop ["end.", "dx"] -> "end" is a prefix of "end." -> 3 (the "d" alone, a prefix of "dx", is
    shorter). Cost: O(sum of len(stop)^2), stop strings being short.
    """
    holdback = 0
    for stop_str in stop:
        # Longest k < len(stop_str) with output_text ending in stop_str[:k]; only k > holdback can improve.
        for k in range(min(len(stop_str) - 1, len(output_text)), holdback, -1):
            if output_text.endswith(stop_str[:k]):
                holdback = k
                break
    return holdback
