"""The pure parts of publish, view and stats: option parsing, payload display, rates, order."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from layer.domain.errors import QlayerError
from layer.services.messages import (
    parse_deliver_at_option,
    parse_expiration_option,
    parse_header_options,
)
from layer.services.views import QueueStats, ViewEntry, rates, sort_for_delivery
from layer_cli.messages import payload_text

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def test_deliver_at_relative_or_iso_with_a_zone() -> None:
    assert parse_deliver_at_option("+30s", NOW) == NOW + timedelta(seconds=30)
    assert parse_deliver_at_option("+5m", NOW) == NOW + timedelta(minutes=5)
    assert parse_deliver_at_option("2030-01-02T09:00:00Z", NOW) == datetime(
        2030, 1, 2, 9, tzinfo=UTC)
    assert parse_deliver_at_option("2030-01-02T09:00:00+02:00", NOW) == datetime(
        2030, 1, 2, 9, tzinfo=timezone(timedelta(hours=2)))


@pytest.mark.parametrize("text", ["2030-01-02T09:00:00", "tomorrow", "+soon", "+"])
def test_deliver_at_refuses_what_cannot_be_placed_in_time(text: str) -> None:
    with pytest.raises(QlayerError, match="--deliver-at"):
        parse_deliver_at_option(text, NOW)


def test_expiration_is_a_duration_from_1ms_to_366_days() -> None:
    assert parse_expiration_option("30s") == timedelta(seconds=30)
    assert parse_expiration_option("1h30m") == timedelta(minutes=90)
    for text in ("0s", "400d", "soon", "-5s"):
        with pytest.raises(QlayerError, match="--expiration"):
            parse_expiration_option(text)


def test_headers_keep_order_and_repeats_and_values_may_hold_equals() -> None:
    assert parse_header_options(["a=1", "b=x=y", "a=2", "c="]) == [
        ("a", "1"), ("b", "x=y"), ("a", "2"), ("c", "")]
    with pytest.raises(QlayerError, match="name=value"):
        parse_header_options(["novalue"])
    with pytest.raises(QlayerError, match="name=value"):
        parse_header_options(["=v"])


def test_payloads_show_as_text_or_repr() -> None:
    assert payload_text(b'{"a": "\xc3\xa9"}') == '{"a": "é"}'
    assert payload_text(b"\xff\x00") == "b'\\xff\\x00'"
    assert payload_text(None) == "-"


def sample(at: float, **counters: int) -> QueueStats:
    return QueueStats(queue="Q", depth=0, leased=0, consumers=0, oldest_available_age=None,
                      counters=counters, partitions=[], sampled_at=at)


def test_rates_are_per_second_between_two_samples() -> None:
    before = sample(100.0, enqueued=10, acked=4, dead_lettered=0)
    after = sample(102.0, enqueued=30, acked=10, dead_lettered=1)
    got = rates(before, after)
    assert got["enqueued"] == 10.0
    assert got["acked"] == 3.0
    assert got["dead_lettered"] == 0.5
    assert got["redelivered"] == 0.0
    assert set(rates(after, after).values()) == {0.0}


def entry(offset: int, timestamp_ms: int, priority: float | None = None, partition: int = 0
          ) -> ViewEntry:
    return ViewEntry(bookmark=f"J/{partition}/{offset}", topic="J", partition=partition,
                     offset=offset,
                     key=None, value=None, timestamp_ms=timestamp_ms, delivery_count=0,
                     priority=priority, document=None)


def test_delivery_order_priority_highest_first_null_last_ties_by_age() -> None:
    entries = [entry(0, 10, 1), entry(1, 11, None), entry(2, 12, 5), entry(3, 13, 5),
               entry(4, 9, -2)]
    assert [e.offset for e in sort_for_delivery(entries, by_priority=True)] == [2, 3, 0, 4, 1]


def test_fifo_keeps_each_partitions_journal_order_and_interleaves_partitions_by_time() -> None:
    # Offset 4 has an earlier producer timestamp than offset 0: journal order still wins.
    one = [entry(0, 10), entry(1, 11), entry(4, 9)]
    two = [entry(0, 5, partition=1), entry(1, 10, partition=1), entry(2, 30, partition=1)]
    ordered = sort_for_delivery(reversed(one + two), by_priority=False)
    assert [(e.partition, e.offset) for e in ordered] == [
        (1, 0), (0, 0), (1, 1), (0, 1), (0, 4), (1, 2)]
