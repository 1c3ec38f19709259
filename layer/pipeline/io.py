"""Spark I/O, apart from the transforms: the Kafka source (batch and streaming), Avro decoding,
Parquet and Postgres (JDBC) output.

The events topic holds single-object-encoded `EventBatch` and `Event` records
(docs/protocol.md §4.4b, §11): a 10-byte header (magic + schema fingerprint) then the Avro
body. Records with another header (a future schema) are skipped; `from_avro` decodes the body
with the `.avsc` shipped in the package.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from pyspark.sql import Column, DataFrame, DataFrameWriter, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro
from pyspark.sql.types import ArrayType, MapType, StructType
from sqlalchemy import create_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from layer.domain.definitions import is_topic_regex
from layer.domain.errors import QlayerError
from layer.pipeline.jars import ensure_spark_jars
from layer.protocol.codec import HEADER_LENGTH, ProtocolSchema, SchemaKind
from layer.store.reports import (
    check_table_name,
    drop_staging,
    final_state_query,
    merge_table,
    queue_definition_query,
    replace_table,
)

__all__ = [
    "BATCH_ID_COLUMNS",
    "DELETED",
    "SOURCE_READS",
    "OutputError",
    "Sink",
    "StoreRead",
    "decode_events",
    "event_header_hex",
    "java_kafka_settings",
    "jdbc_ready",
    "kafka_options",
    "latest_rows",
    "local_session",
    "merge_rows",
    "parse_sink",
    "raw_batch_id",
    "read_events",
    "read_journal",
    "read_journal_offsets",
    "read_store",
    "store_url",
    "stream_events",
    "write_parquet",
    "write_table",
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
    # Python workers (the incremental lifecycle's per-entry state) must run this interpreter,
    # whose environment has pandas and pyarrow, not whatever `python3` is first on PATH.
    # PySpark reads only the environment for it, when the context starts.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
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


#: librdkafka properties whose Java client name and meaning are the same.
_SAME_IN_JAVA = ("security.protocol", "client.id", "ssl.endpoint.identification.algorithm")
_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def _jaas_quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def java_kafka_settings(librdkafka: Mapping[str, object]) -> tuple[dict[str, str], list[str]]:
    """qlayer's ``kafka:`` settings (librdkafka names) as Kafka Java client settings, for
    Spark's Kafka source; and the keys left out (librdkafka tuning with no Java twin).

    ``sasl.username`` / ``sasl.password`` become a ``sasl.jaas.config`` line for the mechanism
    (PLAIN, SCRAM-SHA-256/512); ``ssl.ca.location`` (a PEM file) a PEM trust store. Mutual TLS
    files have no Java twin (Java wants one keystore): give ``ssl.keystore.*`` as Java options.
    Raises `QlayerError` for a SASL login it cannot express.
    """
    given = {k: str(v).lower() if isinstance(v, bool) else str(v)
             for k, v in librdkafka.items()}
    out: dict[str, str] = {}
    for key in _SAME_IN_JAVA:
        if key in given:
            out[key] = given.pop(key)
    if out.get("ssl.endpoint.identification.algorithm") == "none":
        out["ssl.endpoint.identification.algorithm"] = ""  # Java's "off"
    mechanism = given.pop("sasl.mechanisms", None) or given.pop("sasl.mechanism", None)
    user, password = given.pop("sasl.username", None), given.pop("sasl.password", None)
    if mechanism is not None:
        out["sasl.mechanism"] = mechanism
    if user is not None or password is not None:
        module = _LOGIN_MODULES.get((mechanism or "PLAIN").upper())
        if module is None or user is None or password is None:
            raise QlayerError(
                f"the kafka: settings' SASL login (mechanism {mechanism or 'PLAIN'}) has no "
                "Spark equivalent qlayer can write: give the source's sasl.jaas.config "
                "with --kafka-option")
        out["sasl.jaas.config"] = (f"{module} required username={_jaas_quoted(user)} "
                                   f"password={_jaas_quoted(password)};")
    ca = given.pop("ssl.ca.location", None)
    if ca is not None:
        out["ssl.truststore.type"] = "PEM"
        out["ssl.truststore.location"] = ca
    return out, sorted(given)


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
    """The events topic decoded to the `Event` columns, ``type`` as a string, in
    ``[start_ms, end_ms)``.

    The range bounds the read: the Kafka source turns it into offsets by the records'
    timestamps (``startingTimestamp`` / ``endingTimestamp``), so only that part of the topic
    is read. It is then applied to each event's own ``timestamp_ms`` too: an `EventBatch`
    published late (an outbox drained by the shard's next owner) carries events older than
    its record, and those are outside the range. An entry's events are written when they
    happen, so read a range wider than the journal's when reconciling (the outcomes of the
    last records come later).
    """
    events = decode_events(_read_topic(spark, events_topic, options, start_ms, end_ms))
    if start_ms is not None:
        events = events.where(F.col("timestamp_ms") >= F.lit(start_ms))
    if end_ms is not None:
        events = events.where(F.col("timestamp_ms") < F.lit(end_ms))
    return events


def stream_events(spark: SparkSession, events_topic: str, options: Mapping[str, str],
                  max_offsets_per_trigger: int | None = None) -> DataFrame:
    """The events topic as a stream (Spark's Kafka source), decoded like `read_events`; a new
    checkpoint starts at the earliest event, an existing one where it stopped."""
    reader = (spark.readStream.format("kafka").options(**options)
              .option("subscribe", events_topic).option("startingOffsets", "earliest")
              # Retention may have deleted events a checkpoint still points at: go on from
              # the oldest left rather than stop the stream (the gap shows in reconcile).
              .option("failOnDataLoss", "false"))
    if max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    return decode_events(reader.load(), keep_batch_ids=True)


#: How many times `decode_events` reads its input in a plan (single Event records, EventBatch
#: records): a stream's `numInputRows` counts each record that many times.
SOURCE_READS = 2

#: Columns `decode_events(keep_batch_ids=True)` adds: which EventBatch an event came in (null
#: for a single Event record), its item's place in it, and its place in that item's run (0
#: for an item that is one Event).
BATCH_ID_COLUMNS = ("batch_id", "event_index", "run_index")


def _byte(position: str) -> str:
    """SQL: the unsigned byte of ``value`` at a 1-based position (an SQL expression)."""
    return f"CAST(conv(hex(substring(value, {position}, 1)), 16, 10) AS BIGINT)"


def raw_batch_id() -> Column:
    """An EventBatch record's ``batch_id`` read from its raw bytes, without decoding the rest.

    The body starts with it (docs/protocol.md §4.4b: the header, then ``batch_id`` as an Avro
    ``long``, a zigzag varint of at most 10 bytes), so copies of a batch can be told apart
    before the whole record is decoded: dropping them after decoding shuffled every batch's
    decoded events (docs/pipeline.md "Speed"). Only for records with the EventBatch header.
    """
    at = f"{HEADER_LENGTH + 1} + i"
    varint = (
        "aggregate(sequence(0, 9), named_struct('n', 0L, 'more', true), "
        f"(acc, i) -> IF(acc.more, named_struct("
        f"'n', acc.n | shiftleft({_byte(at)} & 127L, 7 * i), "
        f"'more', {_byte(at)} >= 128L), acc), acc -> acc.n)")
    return F.expr(f"shiftrightunsigned({varint}, 1) ^ -({varint} & 1L)")


def _first_copies(batches: DataFrame) -> DataFrame:
    """Raw EventBatch records without the copies of a batch published twice: per
    ``batch_id``, the record of the lowest (partition, offset), the one written first.

    This shuffles the raw records (one per coordinator iteration, a few KiB each), not the
    events decoded from them. Into as many partitions as the application has cores, by
    number: the decoding after it is most of a job's work, and adaptive execution would
    coalesce a shuffle this small into one partition, decoded by one core."""
    order: list[str] = [c for c in ("partition", "offset") if c in batches.columns]
    # A hand-built frame may have no place: any copy then, as they are the same batch.
    first = Window.partitionBy("raw_batch_id").orderBy(*(order or ["raw_batch_id"]))
    cores = batches.sparkSession.sparkContext.defaultParallelism
    return (batches.withColumn("raw_batch_id", raw_batch_id())
            .repartition(cores, "raw_batch_id")
            .withColumn("copy", F.row_number().over(first))
            .where(F.col("copy") == F.lit(1)))


def _run_or_event(name: str, run: Column) -> Column:
    """One `Event` column of a batch item: the run's value for an `EventRun` item (one row
    per offset), the event's own for an `Event` item."""
    return F.when(F.col("item.member1").isNotNull(), run).otherwise(
        F.col(f"item.member0.{name}")).alias(name)


def _item_as_events() -> tuple[Column, ...]:
    """A batch item's columns as `Event` columns: an `Event` item as it is, an `EventRun` item
    as the `Event`s it stands for (one row per offset after the posexplode of its offsets, as
    ``run_index`` and ``run_offset``)."""
    r = "item.member1"
    return (
        _run_or_event("type", F.col(f"{r}.type")),
        _run_or_event("timestamp_ms", F.col(f"{r}.timestamp_ms")),
        _run_or_event("coordinator_id", F.col(f"{r}.coordinator_id")),
        _run_or_event("coordinator_epoch", F.col(f"{r}.coordinator_epoch")),
        _run_or_event("queue", F.col(f"{r}.queue")),
        _run_or_event("bookmark", F.concat_ws(
            "/", F.col(f"{r}.topic"), F.col(f"{r}.partition").cast("string"),
            F.col("run_offset").cast("string"))),
        _run_or_event("topic", F.col(f"{r}.topic")),
        _run_or_event("partition", F.col(f"{r}.partition")),
        _run_or_event("offset", F.col("run_offset")),
        _run_or_event("consumer_id", F.col(f"{r}.consumer_id")),
        _run_or_event("session_id", F.col(f"{r}.session_id")),
        _run_or_event("delivery_count", F.col(f"{r}.delivery_count")),
        _run_or_event("reason", F.col(f"{r}.reason")),
        _run_or_event("lease_expires_ms", F.col(f"{r}.lease_expires_ms")),
        _run_or_event("available_at_ms", F.lit(None).cast("long")),
        _run_or_event("record_timestamp_ms", F.expr(
            f"try_element_at({r}.record_timestamps_ms, run_index + 1)")),
    )


def decode_events(raw: DataFrame, keep_batch_ids: bool = False) -> DataFrame:
    """Kafka source rows of the events topic as `Event` columns. The events' wire format is
    known here only: every reader (batch, stream) goes through this function.

    The topic holds EventBatch records (protocol 3: one per coordinator iteration, from the
    outbox) and single Event records (earlier coordinators; a clean stop's OWNERSHIP_LOST).
    A batch's items are single events or runs (`EventRun`, one event per offset), expanded
    here. A batch published twice (a crash between publishing and forgetting it) counts once:
    copies are dropped by ``batch_id``, read from the raw records before they are decoded. A
    stream cannot drop them within one micro-batch's rows only, so it keeps
    `BATCH_ID_COLUMNS` (the per-entry step drops a copy by its place in its batch).
    """
    header = F.substring("value", 1, HEADER_LENGTH)
    body = F.expr(f"substring(value, {HEADER_LENGTH + 1})")
    single_avsc = ProtocolSchema.load(SchemaKind.EVENT).text
    batch_avsc = ProtocolSchema.load(SchemaKind.EVENT_BATCH).text
    singles = (raw.where(header == F.unhex(F.lit(event_header_hex())))
               .select(from_avro(body, single_avsc, {"mode": "FAILFAST"}).alias("e"))
               .select("e.*", F.lit(None).cast("long").alias("batch_id"),
                       F.lit(None).cast("int").alias("event_index"),
                       F.lit(None).cast("int").alias("run_index")))
    batch_header = ProtocolSchema.load(SchemaKind.EVENT_BATCH).header.hex().upper()
    records = raw.where(header == F.unhex(F.lit(batch_header)))
    if not keep_batch_ids:
        records = _first_copies(records)
    batches = (records.select(from_avro(body, batch_avsc, {"mode": "FAILFAST"}).alias("b"))
               .select(F.col("b.batch_id").alias("batch_id"), F.col("b.events").alias("events")))
    # A union of two records reads as a struct of both, the one not written null. Both kinds
    # of item go through one pipeline (an Event item as a run of one, with no offset), so
    # each record is decoded once: a union of two branches decoded it once per branch.
    # posexplode_outer: for posexplode the optimizer infers a filter on the array's size and
    # pushes it below the decoding, which then decodes every record twice (the outer row of
    # an empty batch is dropped by the filter here).
    items = (batches.select("batch_id",
                            F.posexplode_outer("events").alias("event_index", "item"))
             .where(F.col("item.member0").isNotNull() | F.col("item.member1").isNotNull()))
    offsets = F.when(F.col("item.member1").isNotNull(), F.col("item.member1.offsets")).otherwise(
        F.array(F.lit(None).cast("long")))
    batched = (items.select("batch_id", "event_index", "item",
                            F.posexplode(offsets).alias("run_index", "run_offset"))
               .select(*_item_as_events(), "batch_id", "event_index", "run_index"))
    events = singles.unionByName(batched)
    if keep_batch_ids:
        return events
    return events.drop(*BATCH_ID_COLUMNS)


def read_journal(spark: SparkSession, topic: str, options: Mapping[str, str],
                 start_ms: int | None = None, end_ms: int | None = None) -> DataFrame:
    """A journal's records (topic, partition, offset, timestamp, key, value) in a time range;
    ``topic`` may be a queue's regular expression."""
    return _read_topic(spark, topic, options, start_ms, end_ms).select(
        "topic", "partition", "offset", "timestamp", "key", "value")


def read_journal_offsets(spark: SparkSession, options: Mapping[str, str],
                         rounds: Sequence[Mapping[tuple[str, int], tuple[int, int]]]
                         ) -> DataFrame:
    """The journal records in the given offset ranges (each round: ``{(topic, partition):
    (start, end)}``, end exclusive; `layer.pipeline.changes.offset_rounds`), one Kafka read
    per round: the records of the entries a views micro-batch touches, not the journal.
    Columns as `read_journal`. Records deleted by retention are skipped."""
    reads = []
    for ranges in rounds:
        topics: dict[str, list[int]] = {}
        starts: dict[str, dict[str, int]] = {}
        ends: dict[str, dict[str, int]] = {}
        for (topic, partition), (start, end) in sorted(ranges.items()):
            topics.setdefault(topic, []).append(partition)
            starts.setdefault(topic, {})[str(partition)] = start
            ends.setdefault(topic, {})[str(partition)] = end
        reads.append(spark.read.format("kafka").options(**options)
                     .option("assign", json.dumps(topics))
                     .option("startingOffsets", json.dumps(starts))
                     .option("endingOffsets", json.dumps(ends))
                     .option("failOnDataLoss", "false").load()
                     .select("topic", "partition", "offset", "timestamp", "key", "value"))
    if not reads:
        return spark.createDataFrame(
            [], "topic string, partition int, offset long, timestamp timestamp, key binary, "
            "value binary")
    found = reads[0]
    for more in reads[1:]:
        found = found.unionByName(more)
    return found


def _jdbc_reader(spark: SparkSession, target: Sink, query: str) -> DataFrame:
    reader = (spark.read.format("jdbc").option("url", target.jdbc_url)
              .option("driver", "org.postgresql.Driver").option("query", query))
    if target.user is not None:
        reader = reader.option("user", target.user)
    if target.password is not None:
        reader = reader.option("password", target.password)
    return reader.load()


@dataclass(frozen=True)
class StoreRead:
    """What `read_store` took from qlayer's PostgreSQL for one queue: its entries' stored
    state (`layer.store.reports.final_state_query` rows) and whether it has a filter."""

    state: DataFrame
    has_filter: bool


def read_store(spark: SparkSession, target: Sink, queue: str) -> StoreRead:
    """qlayer's PostgreSQL (``target``, a JDBC sink without a table) for ``queue``, through
    Spark's JDBC source and the Postgres driver the pom fetches. The entries' state is read
    with one statement, so from one snapshot; call `DataFrame.cache` and count it to fix the
    moment it is read. Raises `OutputError` when the queue is not defined there."""
    rows = _jdbc_reader(spark, target, queue_definition_query(queue)).collect()
    if not rows:
        raise OutputError(f"queue {queue!r} is not defined in the PostgreSQL at "
                          f"{target.jdbc_url}: reconcile compares with its stored state")
    definition = json.loads(rows[0]["definition"])
    return StoreRead(_jdbc_reader(spark, target, final_state_query(queue)),
                     definition.get("filter") is not None)


def write_parquet(frame: DataFrame, path: str, mode: str = "overwrite") -> None:
    """Write one job's output as Parquet (a directory; a path any Hadoop filesystem takes)."""
    frame.write.mode(mode).parquet(path)


class OutputError(QlayerError, ValueError):
    """An ``--output`` that names no place the pipeline can write to."""


@dataclass(frozen=True)
class Sink:
    """Where a job's table goes: a Parquet directory, or a Postgres table through JDBC."""

    path: str | None = None
    jdbc_url: str | None = None
    table: str | None = None
    user: str | None = None
    password: str | None = None

    @property
    def is_jdbc(self) -> bool:
        return self.jdbc_url is not None

    def describe(self) -> str:
        """Where the output went, for people (no password)."""
        return f"{self.jdbc_url} table {self.table}" if self.is_jdbc else str(self.path)


_POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2")


def parse_sink(target: str, table: str) -> Sink:
    """``--output``: a directory (Parquet), a PostgreSQL URL (``postgresql://user:pw@host/db``,
    SQLAlchemy's ``postgresql+psycopg://`` as in qlayer's settings too) or a JDBC URL
    (``jdbc:postgresql://host/db?user=...``). ``table`` names the Postgres table."""
    scheme = target.split(":", 1)[0].lower() if "://" in target else ""
    if not scheme:
        return Sink(path=target)
    if scheme == "jdbc":
        if not target.lower().startswith("jdbc:postgresql://"):
            raise OutputError(f"--output {target!r}: only jdbc:postgresql:// URLs are supported")
        return Sink(jdbc_url=target, table=table)
    if scheme not in _POSTGRES_SCHEMES:
        # Hadoop filesystems (s3a://, hdfs://, file://) are Parquet directories.
        return Sink(path=target)
    try:
        url = make_url(target)
    except ArgumentError as exc:
        raise OutputError(f"--output {target!r} is not a PostgreSQL URL: {exc}") from None
    if not url.database:
        raise OutputError(f"--output {target!r} names no database (postgresql://host/DB)")
    host = url.host or "localhost"
    port = f":{url.port}" if url.port else ""
    query = "&".join(f"{k}={v}" for k, v in sorted(url.query.items()) if isinstance(v, str))
    jdbc = f"jdbc:postgresql://{host}{port}/{url.database}" + (f"?{query}" if query else "")
    return Sink(jdbc_url=jdbc, table=table, user=url.username, password=url.password)


def jdbc_ready(frame: DataFrame) -> DataFrame:
    """Nested columns (arrays, structs, maps) as JSON text: Postgres' JDBC writer takes only
    flat columns, and jsonb-castable text keeps them queryable."""
    nested = (ArrayType, MapType, StructType)
    return frame.select(*[
        F.to_json(F.col(f.name)).alias(f.name) if isinstance(f.dataType, nested)
        else F.col(f.name)
        for f in frame.schema.fields])


def store_url(sink: Sink) -> URL:
    """The SQLAlchemy URL (psycopg, qlayer's driver) of a Postgres sink: the JDBC URL's host,
    port and database, its ``user`` and ``password`` (or the sink's), and its other parameters
    passed on to libpq (``sslmode`` has the same name in both)."""
    assert sink.jdbc_url is not None
    parts = urlsplit(sink.jdbc_url.removeprefix("jdbc:"))
    params = dict(parse_qsl(parts.query))
    user = params.pop("user", None) or sink.user
    password = params.pop("password", None) or sink.password
    return URL.create("postgresql+psycopg", username=user, password=password,
                      host=parts.hostname, port=parts.port,
                      database=parts.path.lstrip("/") or None, query=params)


def _staging_name(table: str) -> str:
    schema, _, name = table.rpartition(".")
    staging = f"{name[:40]}_staging_{uuid.uuid4().hex[:12]}"
    return f"{schema}.{staging}" if schema else staging


def _jdbc_writer(frame: DataFrame, sink: Sink, table: str, mode: str) -> DataFrameWriter:
    writer = (frame.write.format("jdbc").mode(mode)
              .option("url", sink.jdbc_url).option("dbtable", table)
              .option("driver", "org.postgresql.Driver"))
    if sink.user is not None:
        writer = writer.option("user", sink.user)
    if sink.password is not None:
        writer = writer.option("password", sink.password)
    return writer


def write_table(frame: DataFrame, sink: Sink, mode: str = "overwrite") -> None:
    """Write a job's table to its sink. A Postgres table is replaced by ``overwrite`` in one
    transaction, and created on the first write.

    Spark's JDBC writer commits each partition on its own, so writing the table in place
    (TRUNCATE, then insert) shows readers an empty, then a half-written table. The rows go to
    a staging table first; `layer.store.reports.replace_table` then swaps them in with one
    transaction (readers see the old rows, then the new ones; grants and indexes stay).
    """
    if not sink.is_jdbc:
        assert sink.path is not None
        write_parquet(frame, sink.path, mode)
        return
    assert sink.table is not None
    table = check_table_name(sink.table)
    flat = jdbc_ready(frame)
    if mode != "overwrite":
        _jdbc_writer(flat, sink, table, mode).save()
        return
    staging = _staging_name(table)
    engine = create_engine(store_url(sink))
    try:
        try:
            _jdbc_writer(flat, sink, staging, "overwrite").save()
            with engine.begin() as conn:
                replace_table(conn, table, staging, flat.columns)
        except BaseException:
            # The staging table is ours alone: leave nothing behind when the swap did not
            # happen (it holds no row anyone reads).
            with engine.begin() as conn:
                drop_staging(conn, staging)
            raise
    finally:
        engine.dispose()


#: The column a change log's row carries when its key left the table (a metrics window or a
#: view group with nothing left in it): `merge_rows` deletes the key, `latest_rows` drops it.
DELETED = "_deleted"


def merge_rows(frame: DataFrame, sink: Sink, keys: Sequence[str], batch_id: int, *,
               deletes: bool = False, null_safe: bool = False) -> None:
    """Write the rows one micro-batch changed, keyed by ``keys``, so the sink's work is that
    batch's rows only. With ``deletes``, ``frame`` has a `DELETED` column: its true rows are
    keys to remove. ``null_safe``: a null key matches a null key (a view's group).

    Postgres: the rows replace the table's rows with the same keys, in one transaction
    (`layer.store.reports.merge_table`). Parquet: a directory cannot replace rows in
    place, so the output is a change log, ``<path>/batch=<id>``, each batch directory
    overwritten whole (a replayed batch lands once); `latest_rows` reads the table from it.
    """
    if not sink.is_jdbc:
        assert sink.path is not None
        write_parquet(frame, f"{sink.path.rstrip('/')}/batch={batch_id}")
        return
    assert sink.table is not None
    table = check_table_name(sink.table)
    flat = jdbc_ready(frame)
    staging = _staging_name(table)
    engine = create_engine(store_url(sink))
    try:
        try:
            _jdbc_writer(flat, sink, staging, "overwrite").save()
            with engine.begin() as conn:
                merge_table(conn, table, staging, flat.columns, keys,
                            deleted=DELETED if deletes else None, null_safe=null_safe)
        except BaseException:
            with engine.begin() as conn:
                drop_staging(conn, staging)
            raise
    finally:
        engine.dispose()


def latest_rows(change_log: DataFrame, keys: Sequence[str]) -> DataFrame:
    """The table a `merge_rows` Parquet change log stands for: per ``keys`` (null-safe), the
    row of the highest ``batch``, unless it says the key was deleted; without the ``batch``
    and `DELETED` columns."""
    latest = Window.partitionBy(*keys).orderBy(F.col("batch").desc())
    rows = (change_log.withColumn("_latest", F.row_number().over(latest))
            .where(F.col("_latest") == F.lit(1)).drop("_latest", "batch"))
    if DELETED in rows.columns:
        rows = rows.where(~F.col(DELETED)).drop(DELETED)
    return rows
