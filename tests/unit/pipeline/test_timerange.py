"""`--since` / `--until`: epoch milliseconds, ISO-8601 or a length before now."""

from __future__ import annotations

import pytest

from layer.pipeline.timerange import TimeRangeError, parse_instant, parse_range

NOW = 1_767_225_600_000  # 2026-01-01T00:00:00Z


@pytest.mark.parametrize(("text", "ms"), [
    ("1767225600000", NOW),
    ("2026-01-01T00:00:00", NOW),  # no zone: UTC
    ("2026-01-01T01:00:00+01:00", NOW),
    ("1h", NOW - 3_600_000),
    ("30m", NOW - 1_800_000),
    ("90s", NOW - 90_000),
    ("2d", NOW - 2 * 86_400_000),
    ("1w", NOW - 7 * 86_400_000),
    ("1.5h", NOW - 5_400_000),
    (" 15M ", NOW - 900_000),
])
def test_an_instant_in_each_form(text: str, ms: int) -> None:
    assert parse_instant(text, NOW) == ms


@pytest.mark.parametrize("text", ["yesterday", "1y", "h1", "", "2026-13-01"])
def test_what_is_no_instant_is_refused_with_the_forms_it_takes(text: str) -> None:
    with pytest.raises(TimeRangeError, match="neither epoch milliseconds, an ISO-8601 time"):
        parse_instant(text, NOW)


def test_a_range_is_open_on_either_side_and_never_empty() -> None:
    assert parse_range("2h", "1h", NOW) == (NOW - 7_200_000, NOW - 3_600_000)
    assert parse_range(None, "1h", NOW) == (None, NOW - 3_600_000)
    assert parse_range("1h", None, NOW) == (NOW - 3_600_000, None)
    with pytest.raises(TimeRangeError, match="must be after --since"):
        parse_range("1h", "2h", NOW)
