"""The events topic's wire format as Spark reads it (`layer.pipeline.io.decode_events`):
single Event records and EventBatches whose items are events or runs, decoded with spark-avro
from the bytes the coordinator's codec writes, and compared with the Python decoder."""

from __future__ import annotations

from pyspark.sql import SparkSession

from layer.pipeline.io import decode_events, raw_batch_id
from layer.protocol import Bookmark, Codec, Event, EventRun, EventType

CODEC = Codec()


def _event(**fields: object) -> Event:
    return Event(timestamp_ms=5, coordinator_id="c", coordinator_epoch=2, **fields)  # type: ignore[arg-type]


def _run(**fields: object) -> EventRun:
    return EventRun(timestamp_ms=6, coordinator_id="c", coordinator_epoch=2, queue="Jobs",
                    topic="orders", **fields)  # type: ignore[arg-type]


def _rows(spark: SparkSession, values: list[bytes], keep: bool = False) -> list[dict[str, object]]:
    raw = spark.createDataFrame([(v,) for v in values], "value binary")
    return [r.asDict() for r in decode_events(raw, keep_batch_ids=keep).collect()]


def _as_event(row: dict[str, object]) -> Event:
    return Event(type=EventType(row["type"]), timestamp_ms=row["timestamp_ms"],  # type: ignore[arg-type]
                 coordinator_id=row["coordinator_id"],  # type: ignore[arg-type]
                 coordinator_epoch=row["coordinator_epoch"],  # type: ignore[arg-type]
                 queue=row["queue"],  # type: ignore[arg-type]
                 bookmark=Bookmark.parse(row["bookmark"]) if row["bookmark"] else None,  # type: ignore[arg-type]
                 consumer_id=row["consumer_id"], session_id=row["session_id"],  # type: ignore[arg-type]
                 delivery_count=row["delivery_count"], reason=row["reason"],  # type: ignore[arg-type]
                 lease_expires_ms=row["lease_expires_ms"],  # type: ignore[arg-type]
                 available_at_ms=row["available_at_ms"],  # type: ignore[arg-type]
                 record_timestamp_ms=row["record_timestamp_ms"])  # type: ignore[arg-type]


def test_runs_read_as_one_event_per_offset_as_the_python_decoder_reads_them(
    spark: SparkSession,
) -> None:
    refused = _event(type=EventType.ACK_REFUSED, queue="Jobs",
                     bookmark=Bookmark("orders", 0, 3), consumer_id="w", reason="wrong_token")
    runs = [
        _run(type=EventType.ENQUEUED, partition=1, offsets=(10, 11, 12),
             record_timestamps_ms=(1_700_000_000_000, None, 1_700_000_000_002)),
        _run(type=EventType.LEASED, partition=1, offsets=(12, 10), consumer_id="w",
             session_id="s", delivery_count=1, lease_expires_ms=60_006),
        _run(type=EventType.ACKED, partition=1, offsets=(10,), consumer_id="w",
             reason="consumer"),
    ]
    batch = CODEC.encode_event_batch(7, 0, CODEC.event_array(
        [CODEC.event_item(CODEC.encode_event(refused)), *map(CODEC.run_item, runs)]))
    lost = _event(type=EventType.OWNERSHIP_LOST, queue="Jobs")
    values = [batch, batch, CODEC.encode_event(lost)]  # the batch published twice

    rows = _rows(spark, values)
    assert sorted(map(repr, map(_as_event, rows))) == sorted(
        map(repr, [*CODEC.decode_events(batch), lost]))
    assert len(rows) == 1 + 3 + 2 + 1 + 1  # each copy of the batch counted once
    leased = sorted((r["offset"], r["partition"], r["bookmark"]) for r in rows
                    if r["type"] == "LEASED")
    assert leased == [(10, 1, "orders/1/10"), (12, 1, "orders/1/12")]
    enqueued = {r["offset"]: r["record_timestamp_ms"] for r in rows if r["type"] == "ENQUEUED"}
    assert enqueued == {10: 1_700_000_000_000, 11: None, 12: 1_700_000_000_002}


def test_a_stream_keeps_where_each_event_came_from(spark: SparkSession) -> None:
    runs = [_run(type=EventType.ACKED, partition=0, offsets=(4, 5), consumer_id="w",
                 reason="consumer")]
    batch = CODEC.encode_event_batch(9, 1, CODEC.event_array(list(map(CODEC.run_item, runs))))
    rows = _rows(spark, [batch, batch], keep=True)
    # Both copies are there (a stream drops them across micro-batches), told apart by place.
    assert sorted((r["batch_id"], r["event_index"], r["run_index"], r["offset"])
                  for r in rows) == [(9, 0, 0, 4), (9, 0, 0, 4), (9, 0, 1, 5), (9, 0, 1, 5)]


def test_the_batch_id_is_read_from_the_raw_record_as_the_codec_wrote_it(
    spark: SparkSession,
) -> None:
    # Copies of a batch are dropped on this id before decoding: every varint length and sign.
    ids = [0, 1, -1, 63, -64, 64, 300, 2**31, -(2**31), 2**62, 2**63 - 1, -(2**63)]
    array = CODEC.event_array([CODEC.event_item(CODEC.encode_event(
        _event(type=EventType.OWNERSHIP_LOST, queue="Jobs")))])
    raw = spark.createDataFrame([(CODEC.encode_event_batch(i, 3, array),) for i in ids],
                                "value binary")
    assert [r[0] for r in raw.select(raw_batch_id()).collect()] == ids


def test_only_the_first_copy_of_a_batch_is_decoded(spark: SparkSession) -> None:
    runs = [_run(type=EventType.ACKED, partition=0, offsets=(4, 5), consumer_id="w",
                 reason="consumer")]
    first = CODEC.encode_event_batch(9, 1, CODEC.event_array(list(map(CODEC.run_item, runs))))
    other = CODEC.encode_event_batch(10, 1, CODEC.event_array(list(map(CODEC.run_item, runs))))
    # As the Kafka source reads them: the batch 9 at offsets 2 and 7 of partition 0.
    raw = spark.createDataFrame([(0, 7, first), (0, 2, first), (1, 3, other)],
                                "partition int, offset long, value binary")
    rows = decode_events(raw).collect()
    assert sorted((r["offset"], r["type"]) for r in rows) == [
        (4, "ACKED"), (4, "ACKED"), (5, "ACKED"), (5, "ACKED")]  # one copy of each batch
    assert len(rows) == 4
