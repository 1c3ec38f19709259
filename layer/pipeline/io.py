"""Spark I/O, apart from the transforms: the Kafka source in batch mode, Avro decoding, Parquet.

The events topic holds single-object-encoded `Event` records (docs/protocol.md §11): a 10-byte
header (magic + schema fingerprint) then the Avro body. Records with another header (a future
schema) are skipped; `from_avro` decodes the body with the `.avsc` shipped in the package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro

from layer.domain.definitions import is_topic_regex
from layer.pipeline.jars import ensure_spark_jars
from layer.protocol.codec import HEADER_LENGTH, ProtocolSchema, SchemaKind

__all__ = [
    "event_header_hex",
    "kafka_options",
    "local_session",
    "read_events",
    "read_journal",
    "write_parquet",
]


def local_session(master: str = "local[2]", app_name: str = "qlayer-pipeline",
                  shuffle_partitions: int = 2, jars: Sequence[Path] | None = None,
                  extra_conf: Mapping[str, str] | None = None) -> SparkSession:
    """A SparkSession with the Kafka source and spark-avro on its classpath (`spark.jars`).

    Under `spark-submit` on a cluster, pass the same jars with `--jars` and call
    `SparkSession.builder.getOrCreate()` instead; the jobs take the session as an argument.
    """
    found = list(jars) if jars is not None else ensure_spark_jars()
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.jars", ",".join(str(j) for j in found))
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    for key, value in (extra_conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def kafka_options(bootstrap_servers: str, security: Mapping[str, str] | None = None
                  ) -> dict[str, str]:
    """Options for Spark's Kafka source; `security` holds Kafka client settings
    (security.protocol, sasl.*), passed with the source's ``kafka.`` prefix."""
    # read_committed: a transactional coordinator's aborted writes are not events.
    options = {"kafka.bootstrap.servers": bootstrap_servers,
               "kafka.isolation.level": "read_committed"}
    options.update({f"kafka.{k}": v for k, v in (security or {}).items()})
    return options


def _read_topic(spark: SparkSession, topic: str, options: Mapping[str, str],
                start_ms: int | None, end_ms: int | None) -> DataFrame:
    # A queue's underlying topic may be a regular expression (DESIGN §2): the source reads
    # every topic it matches.
    how = "subscribePattern" if is_topic_regex(topic) else "subscribe"
    reader = spark.read.format("kafka").options(**options).option(how, topic)
    # By time when a range is given: the source turns times into offsets per partition, so
    # only the range is read. Without one, the whole topic as it is now.
    if start_ms is not None:
        reader = reader.option("startingTimestamp", str(start_ms))
    else:
        reader = reader.option("startingOffsets", "earliest")
    if end_ms is not None:
        reader = reader.option("endingTimestamp", str(end_ms))
    else:
        reader = reader.option("endingOffsets", "latest")
    # A partition without a record at or after the start time then reads nothing.
    return reader.option("startingOffsetsByTimestampStrategy", "latest").load()


def event_header_hex() -> str:
    """The 10-byte single-object header of `Event` records, as hex (magic + fingerprint)."""
    return ProtocolSchema.load(SchemaKind.EVENT).header.hex().upper()


def read_events(spark: SparkSession, events_topic: str, options: Mapping[str, str],
                start_ms: int | None = None, end_ms: int | None = None) -> DataFrame:
    """The events topic decoded to the `Event` columns, ``type`` as a string.

    The range is on the events' Kafka timestamps; an entry's events are written when they
    happen, so read a range wider than the journal's when reconciling (the outcomes of the last
    records come later).
    """
    raw = _read_topic(spark, events_topic, options, start_ms, end_ms)
    avsc = ProtocolSchema.load(SchemaKind.EVENT).text
    header = F.unhex(F.lit(event_header_hex()))
    body = F.expr(f"substring(value, {HEADER_LENGTH + 1})")
    return (
        raw.where(F.substring("value", 1, HEADER_LENGTH) == header)
        .select(from_avro(body, avsc, {"mode": "FAILFAST"}).alias("e"))
        .select("e.*")
    )


def read_journal(spark: SparkSession, topic: str, options: Mapping[str, str],
                 start_ms: int | None = None, end_ms: int | None = None) -> DataFrame:
    """A journal's records (topic, partition, offset, timestamp, key, value) in a time range;
    ``topic`` may be a queue's regular expression."""
    return _read_topic(spark, topic, options, start_ms, end_ms).select(
        "topic", "partition", "offset", "timestamp", "key", "value")


def write_parquet(frame: DataFrame, path: str, mode: str = "overwrite") -> None:
    """Write one job's output as Parquet (a directory; a path any Hadoop filesystem takes)."""
    frame.write.mode(mode).parquet(path)

