"""StopStringMatcher against a character-at-a-time reference, for every way to split text."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.coordinator.stream.stop_strings import StopStringMatcher


def _reference(text: str, stop: list[str]) -> tuple[str, bool]:
    """Stop at the first character that completes a stop string (the longest, on a tie)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def _stream(deltas: list[str], stop: list[str]) -> tuple[str, bool]:
    """Feed deltas, checking the invariants after each; return everything emitted."""
    matcher = StopStringMatcher(stop)
    emitted, received = "", ""
    for delta in deltas:
        received += delta
        out, stopped = matcher.feed(delta)
        emitted += out
        if stopped:
            assert matcher.flush() == ""
            assert matcher.feed("more") == ("", True)
            return emitted, True
        # Nothing is lost, and only text that may still begin a stop string is held.
        assert emitted + matcher.held == received
        assert any(s.startswith(matcher.held) and s != matcher.held for s in stop) or (
            matcher.held == ""
        )
    return emitted + matcher.flush(), False


def _splits(text: str, cuts: int):
    for points in itertools.combinations(range(1, len(text)), cuts):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


CASES = [
    ("Hello there</s> and more", ["</s>"], "Hello there"),
    ("answer: 42\n\nUser: hi", ["\nUser:", "\n\n\n"], "answer: 42\n"),
    ("xabcd", ["abc", "bcd"], "x"),  # overlapping: "abc" completes first
    ("xabcd", ["abcd", "bc"], "xa"),  # a shorter one inside a longer one completes first
    ("xabc", ["bc", "abc"], "x"),  # both complete together: the longer wins
    ("aaab", ["aab"], "a"),  # a failed partial match restarts one character later
    ("<|im_end|>", ["<|im_end|>", "<|im"], ""),
    ("ab<|im_e", ["<|im_end|>"], "ab<|im_e"),  # never completed: released at flush
    ("naïve ☃ stop ☃☃ end", ["☃☃"], "naïve ☃ stop "),
]


@pytest.mark.parametrize(("text", "stop", "expected"), CASES)
def test_every_single_and_double_split_point(text, stop, expected):
    assert _reference(text, stop)[0] == expected
    should_stop = expected != text
    for cuts in (0, 1, 2):
        for deltas in _splits(text, cuts):
            assert _stream(deltas, stop) == (expected, should_stop), deltas


@pytest.mark.parametrize(("text", "stop", "expected"), CASES)
def test_one_character_at_a_time(text, stop, expected):
    assert _stream(list(text), stop) == (expected, expected != text)


def test_partial_match_is_held_then_released_when_it_diverges():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.held == "ST"
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("RM") == ("STORM", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_match_returns_text_before_it_and_drops_the_rest():
    matcher = StopStringMatcher(["###", "END"])
    assert matcher.feed("one #") == ("one ", False)
    assert matcher.feed("# two") == ("## two", False)
    assert matcher.feed(" E") == (" ", False)
    assert matcher.feed("ND tail") == ("", True)
    assert matcher.stopped
    assert matcher.flush() == ""


def test_no_stop_strings_passes_text_straight_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.feed("") == ("", False)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=14),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=14), max_size=5),
)
def test_any_split_matches_the_reference(text, stop, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert _stream(deltas, stop) == _reference(text, stop)
