"""Stop strings: matches that straddle token boundaries, truncation offsets, and streaming holdback."""

from __future__ import annotations

from folio.engine.stop_checker import check_stop_strings, stop_string_holdback


def feed(chunks: list[str], stop: list[str], include: bool) -> tuple[str, str | None]:
    """Append chunks like tokens arriving; return the final text (truncated at a stop) and the stop hit."""
    text = ""
    for chunk in chunks:
        text += chunk
        hit = check_stop_strings(text, len(chunk), stop, include)
        if hit is not None:
            stop_str, offset = hit
            return text[:offset], stop_str
    return text, None


def test_match_across_token_boundaries() -> None:
    assert feed(["Hel", "lo ST", "OP there"], ["STOP"], False) == ("Hello ", "STOP")
    assert feed(["Hel", "lo ST", "OP there"], ["STOP"], True) == ("Hello STOP", "STOP")
    assert feed(["a", "b", "c"], ["xyz"], False) == ("abc", None)


def test_exact_offsets() -> None:
    assert check_stop_strings("Hello world", 3, ["wor"], False) == ("wor", 6)
    assert check_stop_strings("Hello world", 3, ["wor"], True) == ("wor", 9)
    assert check_stop_strings("Hello world", 0, ["wor"], False) is None
    assert check_stop_strings("Hello world", 3, [], False) is None


def test_only_new_region_is_searched() -> None:
    # "wor" ends before the 2 new chars "ld": it was old text already checked, so no match now.
    assert check_stop_strings("Hello world", 2, ["wor"], False) is None
    # the match may start in old text as long as it ends in the new text
    assert check_stop_strings("Hello world", 1, ["rld"], False) == ("rld", 8)


def test_earliest_stop_wins() -> None:
    assert check_stop_strings("xxab", 2, ["b", "a"], False) == ("a", 2)
    assert check_stop_strings("xxab", 2, ["ab", "a"], True) == ("ab", 4)


def test_holdback_partial_prefixes() -> None:
    assert stop_string_holdback("the end", ["end.", "dx"]) == 3
    assert stop_string_holdback("Hello S", ["STOP"]) == 1
    assert stop_string_holdback("Hello ST", ["STOP"]) == 2
    assert stop_string_holdback("Hello", ["STOP"]) == 0
    assert stop_string_holdback("abc", []) == 0
    assert stop_string_holdback("xSTOP", ["STOP"]) == 0  # a full stop string is a match, not a holdback
    assert stop_string_holdback("aa", ["aaa"]) == 2
    assert stop_string_holdback("a", ["aaaa"]) == 1


def test_streaming_never_shows_partial_stop() -> None:
    stop = ["<end>"]
    text, shown = "", ""
    for chunk in ["Hi <", "e", "nd", "> bye"]:
        text += chunk
        hit = check_stop_strings(text, len(chunk), stop, False)
        if hit is not None:
            text = text[: hit[1]]
            shown = text
            break
        shown = text[: len(text) - stop_string_holdback(text, stop)]
        assert "<" not in shown
    assert shown == "Hi "
