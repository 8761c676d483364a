"""``app.bodies.json_depth``, the nesting bound every JSON body passes before it is parsed:
checked against a plain character scanner on random bodies, and on the hostile bodies that
once made its string pattern quadratic (one unauthenticated 32 KB body held the event loop
for seconds)."""

from __future__ import annotations

import random

import pytest

from tests import hostile_http as hostile
from zoopick.app.bodies import JSON_MAX_DEPTH, json_depth


def scanned_depth(body: bytes) -> int:
    """The deepest nesting of brackets outside strings, one character at a time: a string runs
    from a quote to the next unescaped quote (or the end of the body); a backslash in a string
    escapes the next byte."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        char = chr(byte)
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def over_the_bound(depth: int) -> bool:
    return depth > JSON_MAX_DEPTH


@pytest.mark.parametrize("seed", range(4))
def test_depth_agrees_with_a_character_scanner_on_random_bodies(seed):
    rng = random.Random(seed)
    alphabet = ['"', "\\", "[", "]", "{", "}", "a", ",", ":", '\\"', "[[[[", "]]]]"]
    for _ in range(400):
        body = "".join(rng.choices(alphabet, k=rng.randrange(1, 120))).encode()
        expected = scanned_depth(body)
        got = json_depth(body)
        # at most JSON_MAX_DEPTH brackets opened in all, the count of them is returned (a
        # bound); past it, the exact depth
        assert over_the_bound(got) == over_the_bound(expected), body
        if over_the_bound(expected):
            assert got == expected, body


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}',
        b'["\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", 1]',
        b"[" * 40 + b'"]]]\\"]"' + b"]" * 40,
        b'"unterminated [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[',
    ],
)
def test_brackets_in_strings_do_not_count(body):
    assert json_depth(body) == scanned_depth(body) or not over_the_bound(scanned_depth(body))
    assert over_the_bound(json_depth(body)) == over_the_bound(scanned_depth(body))


@pytest.mark.timeout(60)  # a hang guard: the quadratic pattern took hours at this size
@pytest.mark.parametrize("trailing_backslash", [False, True])
def test_an_open_string_of_escaped_quotes_at_the_cap_is_scanned_at_once(trailing_backslash):
    body = hostile.open_string_of_escapes(1024 * 1024, trailing_backslash)
    assert json_depth(body) == 0 == scanned_depth(body)
    nested = b"[" * 40 + hostile.open_string_of_escapes(64 * 1024, trailing_backslash)
    assert json_depth(nested) == 40 == scanned_depth(nested)
