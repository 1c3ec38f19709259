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

Linear is not cheap. RE2 compiles a pattern into a program (``\\pL`` alone is ~1,200
instructions, ``\\pL{140}`` ~167,000) and matches with a DFA built lazily in a memory budget,
falling back to its NFA, which costs time per byte proportional to the program, when the DFA
outgrows it. Each pattern therefore gets a small memory budget here (`PATTERN_MAX_MEM`,
`NAME_MAX_MEM`), and callers bound the instructions (`MAX_INSTRUCTIONS`); the limits and
their measurements are in docs/expressions.md, "Limits".
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import re2
from re2 import _re2

from layer.domain.boundedcache import BoundedCache

__all__ = [
    "MAX_INSTRUCTIONS",
    "NAME_MAX_MEM",
    "PATTERN_MAX_MEM",
    "LikePatternError",
    "LikePatternTooLargeError",
    "LikeProgram",
    "NamePatternError",
    "compile_like",
    "name_matcher",
]


class LikePatternError(ValueError):
    """A LIKE pattern that cannot be run; the message says why, for a person."""


class LikePatternTooLargeError(LikePatternError):
    """A LIKE pattern whose RE2 program does not fit the memory budget it was compiled with."""


class NamePatternError(re.error):
    """A regex over queue names (a consumer's regex subscription) that cannot be run. A
    ``re.error``, so every place that refused an invalid regex refuses this one too."""


# RE2's memory budget for one LIKE pattern: its program must fit in about two thirds of it (a
# larger one is refused, "pattern too large"), and its DFA caches and the reverse program (built
# on the first match, to find where a match starts) live in the rest; a DFA that outgrows its
# share makes RE2 run its NFA, slower but still linear. RE2's default, 8 MiB, let one pattern
# take 70-100 ms to compile and ~1.4 MiB of program (\pL{140}), and 200 of them froze a
# coordinator for 11-29 s. At 1 MiB a refused pattern costs ~7.5 ms, and ordinary patterns
# (prefixes, alternations, \pL+ over kilobytes) match as fast as with 8 MiB; at 256 KiB,
# \pL+$ over 1 KB text took 70 times longer (docs/expressions.md, "Limits").
PATTERN_MAX_MEM: Final = 1 << 20

# A regex subscription is matched against queue names, which are short, so its DFA stays small
# and a smaller budget suffices; it also keeps more of them in `name_matcher`'s cache.
NAME_MAX_MEM: Final = 256 << 10

# The most instructions the LIKE patterns of one expression (or one queue regex) may compile to
# together. When a pattern's DFA outgrows its memory, RE2's NFA costs about one nanosecond per
# instruction per byte of text, so this bounds what one evaluation can cost (~10 µs per byte of
# the field at worst). Ordinary patterns are 5-50 instructions; a Unicode class such as \pL
# is ~1,200, so this allows eight of them.
MAX_INSTRUCTIONS: Final = 10_000

# Bytes a cached name matcher is charged besides its RE2 budget (the closure, the text).
_NAME_OVERHEAD: Final = 1024

# Regex subscriptions' matchers, by pattern: the catalog tests every queue name at each
# refresh, so compiling once matters. Bounded in bytes, each charged its RE2 budget (which its
# program and DFA stay within): about 60 patterns.
NAME_CACHE_BYTES: Final = 16 << 20

_LINEAR: Final = "LIKE uses a linear-time regular expression engine (RE2), which cannot run it"


@functools.lru_cache(maxsize=32)
def _options(max_mem: int) -> Any:
    # Few distinct budgets occur (the per-pattern ones, and the shares of a filter's budget).
    options = re2.Options()
    options.max_mem = max_mem
    options.log_errors = False  # a refused pattern is the caller's error, not a line on stderr
    options.never_capture = True  # LIKE only asks whether there is a match
    return options

_UNANCHORED: Final = _re2.RE2.Anchor.UNANCHORED
_OCTAL: Final = frozenset("01234567")


@dataclass(frozen=True, slots=True)
class LikeProgram:
    """A compiled LIKE pattern: ``search`` tells whether it matches anywhere in a text."""

    search: Callable[[str], bool]
    #: The size of RE2's (forward) program: what an evaluation costs per byte at worst.
    instructions: int
    #: The RE2 memory budget it was compiled with: its programs and DFA caches stay within it.
    max_mem: int


def compile_like(pattern: str, max_mem: int = PATTERN_MAX_MEM) -> LikeProgram:
    """Compile ``pattern`` within ``max_mem`` bytes of RE2 memory.

    Raises :class:`LikePatternError` for a pattern RE2 cannot run, one whose program does not
    fit the budget, or one RE2 would read differently from PCRE / Python's ``re``.
    """
    regexp = _compile(pattern, max_mem, LikePatternError, "LIKE patterns")
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

    return LikeProgram(search, regexp.ProgramSize(), max_mem)


def _compile(
    pattern: str, max_mem: int, error: type[ValueError] | type[re.error], what: str
) -> Any:
    """RE2's compiled ``pattern``, or ``error`` saying why not (``what``: "LIKE patterns")."""
    reason = _refusal(pattern)
    if reason is not None:
        raise error(reason if what.startswith("LIKE") else reason.replace("LIKE", "a queue regex"))
    try:
        encoded = pattern.encode("utf-8")
    except UnicodeEncodeError:
        raise error("the pattern is not valid Unicode text") from None
    regexp = _re2.RE2(encoded, _options(max_mem))
    if not regexp.ok():
        message = _decode(regexp.error())
        if message.startswith("pattern too large"):
            too_large = LikePatternTooLargeError if error is LikePatternError else error
            raise too_large(
                f"pattern too large: its RE2 program does not fit in the {_describe_bytes(max_mem)}"
                f" of memory one pattern may use here (counted repetitions multiply a pattern's "
                f"size: \\pL is ~1,200 instructions, \\pL{{20}} twenty times that)"
            )
        raise error(f"{message} ({what} are RE2 syntax)")
    return regexp


def _describe_bytes(count: int) -> str:
    """``1 MiB``, ``256 KiB``, ``1,500 bytes``: a budget as a person reads it."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size and count % size == 0:
            return f"{count // size:,} {unit}"
    if count >= 1 << 20:
        return f"{count / (1 << 20):.1f} MiB"
    return f"{count:,} bytes"


_NAME_MATCHERS: Final[BoundedCache[str, Callable[[str], bool]]] = BoundedCache(NAME_CACHE_BYTES)


def name_matcher(pattern: str) -> Callable[[str], bool]:
    """A regex subscription's pattern as a test of a whole queue name, in linear time.

    Consumers choose the pattern, so a backtracking engine would let one stall the
    coordinator (``^(a+)+$`` against a long queue name). Raises `NamePatternError` (a
    ``re.error``) for a pattern RE2 cannot run or would read differently from ``re``, or one
    larger than `NAME_MAX_MEM` / `MAX_INSTRUCTIONS`. The compiled patterns are cached: the
    catalog tests every queue name at each refresh.
    """
    found = _NAME_MATCHERS.get(pattern)
    if found is not None:
        return found
    regexp = _compile(pattern, NAME_MAX_MEM, NamePatternError, "queue regexes")
    size = regexp.ProgramSize()
    if size > MAX_INSTRUCTIONS:
        raise NamePatternError(
            f"the queue regex compiles to {size:,} RE2 instructions; the limit is "
            f"{MAX_INSTRUCTIONS:,} (matching costs time in proportion to it)"
        )
    match, both = regexp.Match, _re2.RE2.Anchor.ANCHOR_BOTH

    def fullmatch(name: str) -> bool:
        data = name.encode("utf-8", "surrogatepass")
        return bool(match(both, data, 0, len(data))[0][0] != -1)

    _NAME_MATCHERS.put(pattern, fullmatch, NAME_MAX_MEM + _NAME_OVERHEAD + len(pattern))
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
