"""Pipeline benchmark: lifecycle, reconcile and metrics over 1,000,000 events on local[2].

    .venv/bin/python benchmarks/pipeline_bench.py --bootstrap-servers 127.0.0.1:29092
    .venv/bin/python benchmarks/pipeline_bench.py --events 100000   # a smaller check

Writes ``--events`` / 5 entries x 5 events (layer.pipeline.synthetic: renewals, redeliveries
after an expired lease, releases, dead letters, pending entries) to a fresh events topic as a
protocol-3 coordinator does: `EventBatch` records (version 2 of the events' wire format,
docs/protocol.md §4.4b) of ``--batch-events`` events each, encoded with the protocol's Codec;
and the matching journal. Then times each job through Spark's Kafka source, as the command
runs it: lifecycle and metrics written as Parquet, reconcile collected to its verdict. Each job
runs once (the machine is shared: run it when it is quiet). The physical plan of each job goes
to benchmarks/results/pipeline-plans.txt, the figures to benchmarks/results/pipeline.json (at
1,000,000 events). Targets (issue 17): lifecycle and reconcile <= 20 s, metrics <= 30 s. Not a
test: nothing is asserted beyond the jobs agreeing with the known workload.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from common import create_topic, delete_topics, machine  # type: ignore[import-not-found]
from confluent_kafka import Producer

from layer.pipeline import transforms
from layer.pipeline.io import latest_rows, local_session, parse_sink, read_events, read_journal
from layer.pipeline.jobs import (
    EventSource,
    StreamOptions,
    run_lifecycle,
    run_lifecycle_stream,
    run_metrics,
    run_reconcile,
)
from layer.pipeline.synthetic import EVENTS_PER_ENTRY, expected_outcomes, workload
from layer.protocol import Codec, TopicNames

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"
PLANS = Path(__file__).resolve().parent / "results" / "pipeline-plans.txt"
PARTITIONS = 2


def _producer(bootstrap: str) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                     "batch.num.messages": 10000, "queue.buffering.max.messages": 500000,
                     "compression.type": "lz4"})


def _send(producer: Producer, topic: str, value: bytes, partition: int) -> None:
    while True:
        try:
            producer.produce(topic, value, partition=partition)
            return
        except BufferError:  # the local queue is full: let it drain
            producer.poll(0.05)


def write_workload(bootstrap: str, events_topic: str, journal: str, entries: int,
                   batch_events: int) -> float:
    """The journal's records and the events of every entry, ``batch_events`` events to an
    EventBatch record (one coordinator iteration's); seconds it took."""
    began = time.perf_counter()
    producer = _producer(bootstrap)
    for i in range(entries):  # offsets dealt round-robin, as workload() expects
        body = json.dumps({"id": i, "region": ("east", "west", "north")[i % 3],
                           "price": i % 97, "qty": 1 + i % 5}).encode()
        _send(producer, journal, body, i % PARTITIONS)
    codec = Codec()
    start_ms = int(time.time() * 1000) - entries  # one entry per ms, ending now
    items: list[bytes] = []
    batch_id = 0

    def publish() -> None:
        nonlocal batch_id
        for array in codec.event_arrays(items):
            batch_id += 1
            _send(producer, events_topic,
                  codec.encode_event_batch(batch_id, batch_id % PARTITIONS, array),
                  batch_id % PARTITIONS)
        items.clear()
        producer.poll(0)

    for event in workload("Bench", journal, PARTITIONS, entries, start_ms):
        items.append(codec.event_item(codec.encode_event(event)))
        if len(items) == batch_events:
            publish()
    publish()
    producer.flush(120)
    return time.perf_counter() - began


def jvm_cpu_seconds(spark: Any) -> float:
    """User + system CPU time of the Spark JVM so far: on a shared machine, wall time says
    as much about the neighbours as about the job; CPU time much less so."""
    pid = spark._jvm.java.lang.ProcessHandle.current().pid()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(step: str, results: dict[str, Any], run: Any, spark: Any = None,
          cpu: dict[str, Any] | None = None) -> Any:
    began = time.perf_counter()
    cpu_began = jvm_cpu_seconds(spark) if spark is not None else 0.0
    value = run()
    results[step] = round(time.perf_counter() - began, 2)
    if spark is not None and cpu is not None:
        cpu[step] = round(jvm_cpu_seconds(spark) - cpu_began, 2)
        print(f"{step}: {results[step]} s ({cpu[step]} s of JVM CPU)", flush=True)
    else:
        print(f"{step}: {results[step]} s", flush=True)
    return value


def plan(frame: Any) -> str:
    """The physical plan Spark runs for ``frame`` (what ``explain("formatted")`` prints)."""
    jvm = frame.sparkSession._jvm
    return str(jvm.PythonSQLUtils.explainString(frame._jdf.queryExecution(), "formatted"))


def breakdown(spark: Any, source: EventSource, cpu: dict[str, Any]) -> dict[str, Any]:
    """Where lifecycle's time goes: the same read cut short at each step, each run to
    Spark's ``noop`` sink (every row computed, nothing written)."""
    from layer.pipeline.io import _read_topic

    def noop(frame: Any) -> None:
        frame.write.format("noop").mode("overwrite").save()

    steps: dict[str, Any] = {}
    options = source.options()
    timed("kafka_read", steps, lambda: noop(_read_topic(
        spark, source.events_topic, options, None, None)), spark, cpu)
    timed("decode", steps, lambda: noop(read_events(spark, source.events_topic, options)),
          spark, cpu)
    timed("lifecycle_uncached", steps, lambda: noop(transforms.lifecycle(
        read_events(spark, source.events_topic, options))), spark, cpu)
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:29092")
    parser.add_argument("--events", type=int, default=1_000_000,
                        help="events to write (5 per entry)")
    parser.add_argument("--batch-events", type=int, default=500,
                        help="events per EventBatch record")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--keep-topics", action="store_true")
    parser.add_argument("--plans", type=Path, help="write the jobs' physical plans here too")
    parser.add_argument("--stream", action="store_true",
                        help="also time lifecycle --stream (incremental, per-entry state) "
                        "over the same events, one available-now run on a new checkpoint")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time lifecycle's steps one by one (read, decode, ...)")
    args = parser.parse_args()
    args.entries = args.events // EVENTS_PER_ENTRY

    prefix = f"bench{uuid.uuid4().hex[:8]}."
    events_topic = TopicNames(prefix).events
    journal = f"bench-journal-{uuid.uuid4().hex[:8]}"
    create_topic(args.bootstrap_servers, events_topic, PARTITIONS)
    create_topic(args.bootstrap_servers, journal, PARTITIONS)
    seconds: dict[str, Any] = {}
    cpu: dict[str, Any] = {}
    try:
        seconds["produce"] = round(write_workload(args.bootstrap_servers, events_topic, journal,
                                                  args.entries, args.batch_events), 2)
        print(f"produce: {seconds['produce']} s", flush=True)
        spark = timed("session_start", seconds, lambda: local_session(args.master))
        source = EventSource(args.bootstrap_servers, prefix)
        with tempfile.TemporaryDirectory() as out:
            life = timed("lifecycle", seconds, lambda: run_lifecycle(
                spark, source, output=f"{out}/lifecycle"), spark, cpu)
            table = spark.read.parquet(f"{out}/lifecycle")
            outcomes = {r["outcome"]: r["count"]
                        for r in table.groupBy("outcome").count().collect()}
            life_plan = plan(life)
            spark.catalog.clearCache()  # each job reads and decodes its own events
            report = timed("reconcile", seconds, lambda: run_reconcile(
                spark, source, "Bench", journal), spark, cpu)
            spark.catalog.clearCache()
            found = timed("metrics", seconds, lambda: run_metrics(
                spark, source, window="1 minute", output=f"{out}/metrics"), spark, cpu)
            windows = spark.read.parquet(f"{out}/metrics").count()
            # run_reconcile returns its verdict, not its table: the same table, built alike.
            audit = transforms.reconcile(
                read_events(spark, source.events_topic, source.options()),
                read_journal(spark, journal, source.options()), "Bench")
            plans = (f"# lifecycle\n{life_plan}\n# reconcile\n{plan(audit)}\n"
                     f"# metrics\n{plan(found)}\n")
            spark.catalog.clearCache()
            steps = breakdown(spark, source, cpu) if args.breakdown else {}
            if args.stream:
                summary = timed("lifecycle_stream", seconds, lambda: run_lifecycle_stream(
                    spark, source, parse_sink(f"{out}/lifecycle-stream", "-"),
                    StreamOptions(f"{out}/ckpt", available_now=True)), spark, cpu)
                streamed = latest_rows(spark.read.parquet(f"{out}/lifecycle-stream"),
                                       ["queue", "bookmark"])
                stream_outcomes = {r["outcome"]: r["count"]
                                   for r in streamed.groupBy("outcome").count().collect()}
                print(f"lifecycle_stream: {summary.batches} micro-batches, "
                      f"{summary.events} records, outcomes {stream_outcomes}", flush=True)
        spark.stop()
    finally:
        if not args.keep_topics:
            delete_topics(args.bootstrap_servers, [events_topic, journal])

    events = args.entries * EVENTS_PER_ENTRY
    expected = expected_outcomes(args.entries, PARTITIONS)
    agrees = (outcomes == expected and report.ok and report.done + report.pending == args.entries
              and report.pending == expected["pending"])
    result = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "machine": machine(),
        "master": args.master,
        "entries": args.entries,
        "events": events,
        "partitions": PARTITIONS,
        "events_per_record": args.batch_events,
        "seconds": seconds,
        "jvm_cpu_seconds": cpu,
        "lifecycle_steps_seconds": steps,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "events_per_second": {job: round(events / seconds[job])
                              for job in ("lifecycle", "reconcile", "metrics")},
        "lifecycle_outcomes": outcomes,
        "reconcile": {"done": report.done, "pending": report.pending,
                      "violations": len(report.violations)},
        "metrics_windows": windows,
        "agrees_with_workload": agrees,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.events == 1_000_000:
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        PLANS.write_text(plans)
        print(f"wrote {RESULTS} and {PLANS}")
    if args.plans is not None:
        args.plans.write_text(plans)
    print(json.dumps(result, indent=2))
    return 0 if agrees else 1


if __name__ == "__main__":
    sys.exit(main())
