"""The pipeline's batch jobs: read with Spark's Kafka source, transform, write Parquet, report.

Run locally with ``python -m layer.pipeline.jobs lifecycle|reconcile ...`` (a `local[2]`
session with the jars Maven fetched) or on a cluster with ``spark-submit ... --from-submit``
(docs/pipeline.md). ``reconcile`` exits with status 1 when it finds a violation; a job that
fails (Kafka unreachable, jars missing) exits with status 2, so the two are told apart.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from layer.pipeline import transforms
from layer.pipeline.io import (
    kafka_options,
    local_session,
    read_events,
    read_journal,
    write_parquet,
)
from layer.protocol import TopicNames

__all__ = [
    "CLOCK_SKEW_MS",
    "EventSource",
    "ReconcileReport",
    "ViolationRow",
    "main",
    "run",
    "run_lifecycle",
    "run_reconcile",
]

#: Events are read from this long before the journal range starts: an entry's ENQUEUED is
#: written after its record was journaled, but the two timestamps come from different clocks.
CLOCK_SKEW_MS = 60_000


@dataclass(frozen=True)
class EventSource:
    """Where the events and journals are: the Kafka cluster and the coordinator's topic prefix.

    ``kafka`` holds Kafka Java client settings (security.protocol, sasl.jaas.config, ...).
    """

    bootstrap_servers: str
    topic_prefix: str = "qlayer."
    kafka: Mapping[str, str] = field(default_factory=dict)

    @property
    def events_topic(self) -> str:
        return TopicNames(self.topic_prefix).events

    def options(self) -> dict[str, str]:
        return kafka_options(self.bootstrap_servers, self.kafka)


@dataclass(frozen=True)
class ViolationRow:
    queue: str
    bookmark: str
    violation: str


@dataclass(frozen=True)
class ReconcileReport:
    """A reconciliation's verdict: entry counts by status and every violation found."""

    queue: str
    done: int
    pending: int
    violations: list[ViolationRow]

    @property
    def ok(self) -> bool:
        return not self.violations


def run_lifecycle(spark: SparkSession, source: EventSource, *, queue: str | None = None,
                  start_ms: int | None = None, end_ms: int | None = None,
                  output: str | None = None) -> DataFrame:
    """The lifecycle table from the events written in ``[start_ms, end_ms)``; written as
    Parquet to ``output`` when given. Returns the (lazy) table."""
    events = read_events(spark, source.events_topic, source.options(), start_ms, end_ms)
    if queue is not None:
        events = events.where(F.col("queue") == F.lit(queue))
    table = transforms.lifecycle(events)
    if output is not None:
        write_parquet(table, output)
    return table


def run_reconcile(spark: SparkSession, source: EventSource, queue: str, journal: str, *,
                  start_ms: int | None = None, end_ms: int | None = None,
                  output: str | None = None) -> ReconcileReport:
    """Reconcile ``queue`` over the records of ``journal`` (its underlying topic) journaled in
    ``[start_ms, end_ms)`` against every event written since; ``output`` gets the per-entry
    statuses as Parquet."""
    events_from = None if start_ms is None else start_ms - CLOCK_SKEW_MS
    events = read_events(spark, source.events_topic, source.options(), events_from, None)
    records = read_journal(spark, journal, source.options(), start_ms, end_ms)
    reconciled = transforms.reconcile(events, records, queue, start_ms, end_ms).cache()
    try:
        if output is not None:
            write_parquet(reconciled, output)
        by_status = {row["status"]: int(row["count"])
                     for row in reconciled.groupBy("status").count().collect()}
        found = [ViolationRow(r["queue"], r["bookmark"], r["violation"])
                 for r in transforms.violations(reconciled)
                 .orderBy("topic", "partition", "offset", "violation").collect()]
    finally:
        reconciled.unpersist()
    return ReconcileReport(queue, by_status.get("done", 0), by_status.get("pending", 0), found)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m layer.pipeline.jobs",
                                     description="qlayer's Spark batch jobs")
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--topic-prefix", default="qlayer.",
                        help="the coordinator's topic prefix (its events topic is <prefix>events)")
    parser.add_argument("--kafka-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a Kafka Java client setting for the source (security.protocol=...)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--from-submit", action="store_true",
                        help="use the session spark-submit configured (its --master and --jars)")
    parser.add_argument("--start-ms", type=int, help="range start, epoch milliseconds")
    parser.add_argument("--end-ms", type=int, help="range end (exclusive), epoch milliseconds")
    parser.add_argument("--output", help="directory for the Parquet output")
    jobs = parser.add_subparsers(dest="job", required=True)
    life = jobs.add_parser("lifecycle", help="one row per (queue, bookmark)")
    life.add_argument("--queue")
    recon = jobs.add_parser("reconcile", help="every admitted message has exactly one outcome")
    recon.add_argument("--queue", required=True)
    recon.add_argument("--journal", required=True, help="the queue's underlying topic")
    return parser


def _source(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EventSource:
    pairs = [item.partition("=") for item in args.kafka_option]
    bad = [key for key, sep, _ in pairs if not sep]
    if bad:
        parser.error(f"--kafka-option takes KEY=VALUE; got {', '.join(bad)}")  # exits 2
    return EventSource(args.bootstrap_servers, args.topic_prefix,
                       {key: value for key, _, value in pairs})


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    source = _source(args, parser)
    if args.from_submit:
        spark = SparkSession.builder.appName(f"qlayer-{args.job}").getOrCreate()
    else:
        spark = local_session(args.master, app_name=f"qlayer-{args.job}")
    try:
        if args.job == "lifecycle":
            table = run_lifecycle(spark, source, queue=args.queue, start_ms=args.start_ms,
                                  end_ms=args.end_ms, output=args.output)
            totals = table.groupBy("queue", "outcome").count().orderBy("queue", "outcome")
            for row in totals.collect():
                print(f"{row['queue']}\t{row['outcome']}\t{row['count']}")
            return 0
        report = run_reconcile(spark, source, args.queue, args.journal, start_ms=args.start_ms,
                               end_ms=args.end_ms, output=args.output)
        print(f"{report.queue}: {report.done} done, {report.pending} pending, "
              f"{len(report.violations)} violations")
        for v in report.violations:
            print(f"{v.violation}\t{v.queue}\t{v.bookmark}")
        return 0 if report.ok else 1
    finally:
        # Under spark-submit the application ends with the driver; a session the job did not
        # create (a notebook's, a test's) is left to its owner.
        if not args.from_submit:
            spark.stop()


def run(argv: Sequence[str] | None = None) -> int:
    """`main`, with a failure of the job itself as status 2 (1 means violations)."""
    try:
        return main(argv)
    except Exception:
        traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(run())
