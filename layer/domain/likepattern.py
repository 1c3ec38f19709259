"""LIKE patterns, matched in linear time with RE2 (docs/expressions.md, "LIKE").

Filters come from consumers, so a pattern is hostile input: with a backtracking engine
``^(a+)+$`` against ``'a' * 27 + 'b'`` takes seconds per message and stalls the coordinator.
RE2 (PyPI ``google-re2``) matches in time linear in the text for every pattern it accepts; the
price is that constructs only a backtracking engine can run (backreferences, lookaround,
recursion, possessive quantifiers, atomic groups) are refused when the expression is compiled,
with the reason.

Three readings differ between Python's ``re`` (the engine LIKE used before) and RE2 for
patterns RE2 accepts; they are made to agree or refused here, so no pattern silently changes
meaning:

- ``$`` (outside ``(?m)``) matches at the end of the text *or before a final newline* in PCRE
  (the AMPS engine) and in ``re``, but only at the very end in RE2. A text ending in a newline
  is also searched without it, which gives the PCRE answer for every pattern whose ``$`` is not
  followed by more of the pattern (``a$\\n`` is the odd case out).
- ``\\z`` / ``\\Z``: RE2 has ``\\z`` (the very end), ``re`` has ``\\Z`` with that meaning, PCRE has
  both and its ``\\Z`` also matches before a final newline. Refused: write ``$``.
- ``{,n}`` / ``{,}``: ``re`` reads a repetition ``{0,n}``, RE2 (and PCRE) literal text. Refused:
  write ``{0,n}`` or ``\\{``.

``\\d \\w \\s \\b`` are ASCII in RE2, as in PCRE without UCP (AMPS); ``re`` made them Unicode.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, Final

import re2
from re2 import _re2

__all__ = ["LikePatternError", "NamePatternError", "compile_like", "name_matcher"]


class LikePatternError(ValueError):
    """A LIKE pattern that cannot be run; the message says why, for a person."""


class NamePatternError(re.error):
    """A regex over queue names (a consumer's regex subscription) that cannot be run. A
    ``re.error``, so every place that refused an invalid regex refuses this one too."""


# RE2's own per-pattern memory budget (its default): a pattern whose compiled program does not
# fit is refused ("pattern too large"); the DFA's cache gets the rest and, when full, RE2 falls
# back to its NFA, which is slower but still linear.
MAX_MEM: Final = 8 << 20

_LINEAR: Final = "LIKE uses a linear-time regular expression engine (RE2), which cannot run it"


def _options() -> Any:
    options = re2.Options()
    options.max_mem = MAX_MEM
    options.log_errors = False  # a refused pattern is the caller's error, not a line on stderr
    options.never_capture = True  # LIKE only asks whether there is a match
    return options


_OPTIONS: Final = _options()
_UNANCHORED: Final = _re2.RE2.Anchor.UNANCHORED
_OCTAL: Final = frozenset("01234567")


def compile_like(pattern: str) -> Callable[[str], bool]:
    """Compile ``pattern``; the result tells whether it matches anywhere in a text.

    Raises :class:`LikePatternError` for a pattern RE2 cannot run or that it would read
    differently from PCRE / Python's ``re``.
    """
    reason = _refusal(pattern)
    if reason is not None:
        raise LikePatternError(reason)
    try:
        encoded = pattern.encode("utf-8")
    except UnicodeEncodeError:
        raise LikePatternError("the pattern is not valid Unicode text") from None
    regexp = _re2.RE2(encoded, _OPTIONS)
    if not regexp.ok():
        raise LikePatternError(f"{_decode(regexp.error())} (LIKE patterns are RE2 syntax)")
    match = regexp.Match
    dollar = "$" in pattern

    def search(text: str) -> bool:
        # surrogatepass: a JSON string may hold a lone surrogate; RE2 then sees bytes that are
        # not UTF-8 and no character class matches them, but matching never raises.
        data = text.encode("utf-8", "surrogatepass")
        if match(_UNANCHORED, data, 0, len(data))[0][0] != -1:  # the whole match's span
            return True
        if dollar and data.endswith(b"\n"):
            head = data[:-1]
            return bool(match(_UNANCHORED, head, 0, len(head))[0][0] != -1)
        return False

    return search


@functools.lru_cache(maxsize=1024)
def name_matcher(pattern: str) -> Callable[[str], bool]:
    """A regex subscription's pattern as a test of a whole queue name, in linear time.

    Consumers choose the pattern, so a backtracking engine would let one stall the
    coordinator (``^(a+)+$`` against a long queue name). Raises `NamePatternError` (a
    ``re.error``) for a pattern RE2 cannot run or would read differently from ``re``. The
    compiled patterns are cached: the catalog tests every queue name at each refresh.
    """
    reason = _refusal(pattern)
    if reason is not None:
        raise NamePatternError(reason.replace("LIKE", "a queue regex"))
    try:
        encoded = pattern.encode("utf-8")
    except UnicodeEncodeError:
        raise NamePatternError("the pattern is not valid Unicode text") from None
    regexp = _re2.RE2(encoded, _OPTIONS)
    if not regexp.ok():
        raise NamePatternError(f"{_decode(regexp.error())} (queue regexes are RE2 syntax)")
    match, both = regexp.Match, _re2.RE2.Anchor.ANCHOR_BOTH

    def fullmatch(name: str) -> bool:
        data = name.encode("utf-8", "surrogatepass")
        return bool(match(both, data, 0, len(data))[0][0] != -1)

    return fullmatch


def _decode(message: object) -> str:
    return message.decode("utf-8", "replace") if isinstance(message, bytes) else str(message)


def _refusal(pattern: str) -> str | None:
    """Why ``pattern`` is refused before RE2 sees it, or ``None``.

    Walks the pattern once, skipping character classes and ``\\Q...\\E``, and names the first
    construct RE2 cannot run (so the message says "backreference", not "invalid escape") or
    would read differently from ``re``.
    """
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":
            escape = pattern[i + 1 : i + 2]
            if escape == "Q":
                end = pattern.find("\\E", i + 2)
                i = n if end < 0 else end + 2
                continue
            if escape in ("z", "Z"):
                return (
                    f"\\{escape} is not supported (PCRE, Python and RE2 read \\Z and \\z "
                    "differently): write $, which matches at the end or before a final newline"
                )
            if escape.isdigit() and escape != "0" and not _is_octal_escape(pattern, i):
                return f"backreferences such as \\{escape} are not supported: {_LINEAR}"
            if escape in ("g", "k"):
                return f"backreferences such as \\{escape}<name> are not supported: {_LINEAR}"
            i += 2
            continue
        if char == "[":
            i = _skip_class(pattern, i)
            continue
        if char == "(" and pattern.startswith("(?", i):
            construct = _group_refusal(pattern[i + 2 : i + 5])
            if construct is not None:
                return f"{construct} is not supported: {_LINEAR}"
        if char == "{":
            close = pattern.find("}", i)
            inside = pattern[i + 1 : close] if close > 0 else ""
            if inside.startswith(",") and (inside[1:] == "" or inside[1:].isdigit()):
                written = pattern[i : close + 1]
                return (
                    f"{written!r} is read as a repetition by some engines and as text by "
                    f"others: write {{0{inside}}} for a repetition or \\{{ for the text"
                )
        i += 1
    return None


def _is_octal_escape(pattern: str, at: int) -> bool:
    # \123 is an octal character code in PCRE, re and RE2 alike; \1 and \12 are backreferences
    # in re (and in PCRE when there are that many groups).
    digits = pattern[at + 1 : at + 4]
    return len(digits) == 3 and all(d in _OCTAL for d in digits)


def _group_refusal(after: str) -> str | None:
    """What the group opening ``(?`` + ``after`` is, if RE2 cannot run it."""
    if after.startswith(("=", "!")):
        return f"lookahead (?{after[0]}...)"
    if after.startswith(("<=", "<!")):
        return f"lookbehind (?{after[:2]}...)"
    if after.startswith("P="):
        return "a backreference (?P=name)"
    if (
        after.startswith(("R", "P>", "&"))
        or after[:1].isdigit()
        or (after[:1] in ("+", "-") and after[1:2].isdigit())
    ):
        return f"recursion (?{after[:1]}...)"
    if after.startswith(">"):
        return "an atomic group (?>...)"
    if after.startswith("#"):
        return "a comment (?#...)"
    return None


def _skip_class(pattern: str, at: int) -> int:
    """The index just after the character class opening at ``at`` (or the end)."""
    i, n = at + 1, len(pattern)
    if i < n and pattern[i] == "^":
        i += 1
    if i < n and pattern[i] == "]":  # a leading ] is a member
        i += 1
    while i < n:
        char = pattern[i]
        if char == "\\":
            i += 2
        elif char == "[" and pattern.startswith("[:", i):
            end = pattern.find(":]", i + 2)
            i = i + 1 if end < 0 else end + 2
        elif char == "]":
            return i + 1
        else:
            i += 1
    return n
