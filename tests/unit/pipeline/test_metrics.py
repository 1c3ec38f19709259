"""SLA metrics per queue and tumbling window, on hand-built events."""

from __future__ import annotations

from typing import Any

from pyspark.sql import SparkSession

from layer.pipeline.transforms import metrics
from tests.unit.pipeline.frames import acked, ev, frame, leased

MINUTE = 60_000


def test_counts_rates_latencies_and_consumer_shares_per_window(spark: SparkSession) -> None:
    events: list[dict[str, Any]] = []
    # Minute 0: ten entries, each leased after 100 ms * i and acked 50 ms later; a, a, a... b.
    for i in range(10):
        consumer = "a" if i < 7 else "b"
        events += [ev("ENQUEUED", 0, i), leased(100 * i, i, consumer, 1),
                   acked(100 * i + 50, i, consumer, 1)]
    # Offset 10: leased in minute 0, lease expired, redelivered and rejected into the dead
    # letters in minute 1. Offset 11: expired unprocessed in minute 1.
    events += [ev("ENQUEUED", 0, 10), leased(5, 10, "a", 1),
               ev("LEASE_EXPIRED", MINUTE + 1, 10, delivery_count=1, reason="deadline"),
               leased(MINUTE + 2, 10, "b", 2),
               ev("REJECTED", MINUTE + 3, 10, consumer_id="b", delivery_count=2),
               ev("DEAD_LETTERED", MINUTE + 3, 10, delivery_count=2, reason="rejected"),
               ev("EXPIRED", MINUTE + 3, 10, delivery_count=2, reason="rejected"),
               ev("ENQUEUED", 0, 11),
               ev("EXPIRED", MINUTE + 10, 11, reason="expiration")]
    result = sorted((r.asDict(recursive=True) for r in
                     metrics(frame(spark, events), "1 minute").collect()),
                    key=lambda r: r["window_start"])
    assert len(result) == 2
    first, second = result

    assert (first["enqueued"], first["delivered"], first["redelivered"], first["acked"]) == (
        12, 11, 0, 10)
    assert first["throughput_per_s"] == 10 / 60
    assert first["outcomes"] == 10 and first["dead_letter_rate"] == 0.0
    # Waits 0, 100, ..., 900 ms and offset 10's 5 ms; processing is always 50 ms.
    assert (first["wait_ms_p50"], first["wait_ms_p99"]) == (400.0, 900.0)
    assert first["processing_ms_p50"] == first["processing_ms_p999"] == 50.0
    assert first["time_in_queue_ms_p99"] == 950.0
    assert first["consumers"] == [{"consumer_id": "a", "acks": 7, "share": 0.7},
                                  {"consumer_id": "b", "acks": 3, "share": 0.3}]

    assert (second["delivered"], second["redelivered"], second["redelivery_rate"]) == (1, 1, 1.0)
    assert (second["acked"], second["dead_lettered"], second["expired"]) == (0, 1, 1)
    assert (second["outcomes"], second["dead_letter_rate"]) == (2, 0.5)
    assert second["throughput_per_s"] == 0.0
    assert second["time_in_queue_ms_p50"] == MINUTE + 3
    assert second["processing_ms_p50"] is None  # nothing acked in this window
    assert second["consumers"] == []


def test_an_at_most_once_delivery_refused_as_too_large_counts_as_dead_lettered(
        spark: SparkSession) -> None:
    events = [ev("ENQUEUED", 0, 0), ev("DELIVERED_AT_MOST_ONCE", 7, 0, consumer_id="a",
                                       reason="delivery"),
              ev("DEAD_LETTERED", 20, 0, delivery_count=1, reason="too_large"),
              ev("ENQUEUED", 0, 1), ev("DELIVERED_AT_MOST_ONCE", 8, 1, consumer_id="a",
                                       reason="delivery")]
    [window] = [r.asDict(recursive=True) for r in
                metrics(frame(spark, events), "1 minute").collect()]
    assert (window["outcomes"], window["dead_lettered"], window["expired"]) == (2, 1, 0)
    assert window["dead_letter_rate"] == 0.5
