"""Durations as operators write them in queue files: ``30s``, ``5m``, ``1h30m``, ``250ms``.

A plain number (or a string holding one) means seconds, like AMPS's unit-less intervals.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_duration", "parse_duration"]

_UNIT_SECONDS: dict[str, float] = {
    "ms": 0.001,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 604800.0,
}
# "ms" before "m" so the alternation does not read "250ms" as "250m" + junk.
_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)(ms|s|m|h|d|w)")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def parse_duration(value: object) -> float:
    """Return ``value`` in seconds.

    Accepts ints and floats (seconds), numeric strings, and unit strings made of one or more
    ``<number><unit>`` parts with units ``ms s m h d w`` (``"1h30m"``, ``"1.5s"``). Raises
    ``ValueError`` with a message that shows the accepted forms; the sign is not checked here
    (callers decide whether zero or negative values make sense).
    """
    if isinstance(value, bool):
        # bool is an int subclass; "lease_period: true" is a mistake, not one second.
        raise ValueError(f"expected a duration such as 30s, 5m or 250ms, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_duration_text(value)
    else:
        raise ValueError(
            f"expected a duration such as 30s, 5m or 250ms, got {type(value).__name__}"
        )
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration, got {value!r}")
    return seconds


def _parse_duration_text(text: str) -> float:
    compact = text.strip().lower().replace(" ", "")
    if _NUMBER.fullmatch(compact):
        return float(compact)
    sign = 1.0
    if compact.startswith("-"):
        sign, compact = -1.0, compact[1:]
    position = 0
    total = 0.0
    for match in _PART.finditer(compact):
        if match.start() != position:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        position = match.end()
    if position == 0 or position != len(compact):
        raise ValueError(
            f"cannot read duration {text!r}; write it like 30s, 5m, 1h30m or 250ms "
            "(a plain number means seconds)"
        )
    return sign * total


def format_duration(seconds: float) -> str:
    """Render seconds back in the queue-file style (``90`` → ``"1m30s"``), for describe/list."""
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    millis = round(seconds * 1000)
    if millis % 1000:
        if millis < 1000:
            return f"{millis}ms"
        return f"{seconds:g}s"
    whole = millis // 1000
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, whole = divmod(whole, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
