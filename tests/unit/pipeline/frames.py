"""Hand-built event and journal frames for the pipeline's unit tests."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from layer.pipeline.transforms import event_schema

TOPIC = "orders"
T0 = 1_700_000_000_000


def ev(kind: str, at: int, offset: int, queue: str = "Q", **fields: Any) -> dict[str, Any]:
    """One entry event, as the coordinator writes it, ``at`` ms after T0."""
    row: dict[str, Any] = {name: None for name in event_schema().fieldNames()}
    row.update(type=kind, timestamp_ms=T0 + at, coordinator_id="c1", coordinator_epoch=1,
               queue=queue, bookmark=f"{TOPIC}/0/{offset}", topic=TOPIC, partition=0,
               offset=offset)
    if kind == "ENQUEUED":
        row["record_timestamp_ms"] = T0 + at - 5
    row.update(fields)
    return row


def leased(at: int, offset: int, consumer: str, count: int) -> dict[str, Any]:
    return ev("LEASED", at, offset, consumer_id=consumer, session_id=f"s-{consumer}",
              delivery_count=count, lease_expires_ms=T0 + at + 30_000)


def acked(at: int, offset: int, consumer: str, count: int) -> dict[str, Any]:
    return ev("ACKED", at, offset, consumer_id=consumer, delivery_count=count)


def frame(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    schema = event_schema()
    return spark.createDataFrame([tuple(r[n] for n in schema.fieldNames()) for r in rows],
                                 schema)


def journal(spark: SparkSession, offsets: Iterable[int], at: int = 0,
            values: dict[int, str | None] | None = None) -> DataFrame:
    """Journal records at ``offsets`` of partition 0, journaled ``at`` ms after T0; ``values``
    gives payloads by offset (JSON text; None for a delete)."""
    when = datetime.fromtimestamp((T0 + at) / 1000, UTC)
    payloads = values or {}

    def value(offset: int) -> bytes | None:
        text = payloads.get(offset, "{}")
        return None if text is None else text.encode()

    return spark.createDataFrame(
        [(TOPIC, 0, o, when, value(o)) for o in offsets],
        "topic string, partition int, offset long, timestamp timestamp, value binary")


def store(spark: SparkSession, recovery_point: int | None,
          rows: list[tuple[int, str, int]]) -> DataFrame:
    """Rows of `layer.store.reports.final_state_query` for partition 0 of the journal: its
    recovery point, and (offset, state, seq) writes of entries."""
    points = [] if recovery_point is None else [
        ("recovery_point", TOPIC, 0, recovery_point, None, None)]
    writes = [("entry", TOPIC, 0, offset, state, seq) for offset, state, seq in rows]
    return spark.createDataFrame(
        points + writes,
        "kind string, topic string, partition int, offset long, state string, seq long")
