"""``--since`` / ``--until``: the instants that bound what a batch job reads (docs/pipeline.md).

Pure: the caller passes ``now_ms``, so a relative time (``1h``: an hour before now) is the
same instant for both ends of one command and testable without a clock.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Final

from layer.domain.errors import QlayerError

__all__ = ["TimeRangeError", "parse_instant", "parse_range"]

#: A relative time: a number and a unit, before now (``90s``, ``15m``, ``1h``, ``2d``, ``1w``).
_RELATIVE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$", re.IGNORECASE)
_UNIT_MS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000,
                   "w": 604_800_000}


class TimeRangeError(QlayerError, ValueError):
    """A ``--since`` / ``--until`` that is no instant, or a range that ends before it starts."""


def parse_instant(text: str, now_ms: int) -> int:
    """Epoch milliseconds of ``text``: epoch milliseconds, an ISO-8601 time (UTC when it has
    no zone) or a length before ``now_ms`` (``30s``, ``15m``, ``1h``, ``2d``, ``1w``)."""
    value = text.strip()
    if value.lstrip("-").isdigit():
        return int(value)
    relative = _RELATIVE.match(value)
    if relative is not None:
        amount, unit = float(relative.group(1)), relative.group(2).lower()
        return now_ms - round(amount * _UNIT_MS[unit])
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise TimeRangeError(
            f"{text!r} is neither epoch milliseconds, an ISO-8601 time nor a length before "
            "now such as 1h, 30m, 2d") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def parse_range(since: str | None, until: str | None, now_ms: int
                ) -> tuple[int | None, int | None]:
    """``[since, until)`` in epoch milliseconds (either may be open); raises
    `TimeRangeError` when it is empty."""
    start = None if since is None else parse_instant(since, now_ms)
    end = None if until is None else parse_instant(until, now_ms)
    if start is not None and end is not None and end <= start:
        raise TimeRangeError(f"--until ({until}) must be after --since ({since})")
    return start, end
