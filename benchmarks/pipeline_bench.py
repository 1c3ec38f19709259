"""Pipeline benchmark: lifecycle, reconcile and metrics over 1,000,000 events on local[2].

    .venv/bin/python benchmarks/pipeline_bench.py --bootstrap-servers 127.0.0.1:29092
    .venv/bin/python benchmarks/pipeline_bench.py --entries 20000   # a smaller smoke run

Writes 200,000 entries x 5 events (layer.pipeline.synthetic: renewals, redeliveries after an
expired lease, releases, dead letters, pending entries), encoded with the protocol's Codec, to a
fresh events topic, and the matching 200,000-record journal; then times each job through
Spark's Kafka source, as the command runs it: lifecycle and metrics written as Parquet,
reconcile collected to its verdict. Each job runs once (the machine is shared: run it when it
is quiet). Results go to benchmarks/results/pipeline.json. Not a test: nothing is asserted
beyond the jobs agreeing with the known workload.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from common import create_topic, delete_topics, machine  # type: ignore[import-not-found]
from confluent_kafka import Producer

from layer.pipeline.io import local_session
from layer.pipeline.jobs import EventSource, run_lifecycle, run_metrics, run_reconcile
from layer.pipeline.synthetic import EVENTS_PER_ENTRY, expected_outcomes, workload
from layer.protocol import Codec, TopicNames

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"
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


def write_workload(bootstrap: str, events_topic: str, journal: str, entries: int) -> float:
    """The journal's records and the events of every entry; seconds it took."""
    began = time.perf_counter()
    producer = _producer(bootstrap)
    for i in range(entries):  # offsets dealt round-robin, as workload() expects
        body = json.dumps({"id": i, "region": ("east", "west", "north")[i % 3],
                           "price": i % 97, "qty": 1 + i % 5}).encode()
        _send(producer, journal, body, i % PARTITIONS)
    codec = Codec()
    start_ms = int(time.time() * 1000) - entries  # one entry per ms, ending now
    for n, event in enumerate(workload("Bench", journal, PARTITIONS, entries, start_ms)):
        _send(producer, events_topic, codec.encode_event(event), n % PARTITIONS)
        if n % 10000 == 0:
            producer.poll(0)
    producer.flush(120)
    return time.perf_counter() - began


def timed(step: str, results: dict[str, Any], run: Any) -> Any:
    began = time.perf_counter()
    value = run()
    results[step] = round(time.perf_counter() - began, 2)
    print(f"{step}: {results[step]} s", flush=True)
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:29092")
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--keep-topics", action="store_true")
    args = parser.parse_args()

    prefix = f"bench{uuid.uuid4().hex[:8]}."
    events_topic = TopicNames(prefix).events
    journal = f"bench-journal-{uuid.uuid4().hex[:8]}"
    create_topic(args.bootstrap_servers, events_topic, PARTITIONS)
    create_topic(args.bootstrap_servers, journal, PARTITIONS)
    seconds: dict[str, Any] = {}
    try:
        seconds["produce"] = round(write_workload(args.bootstrap_servers, events_topic, journal,
                                                  args.entries), 2)
        print(f"produce: {seconds['produce']} s", flush=True)
        spark = timed("session_start", seconds, lambda: local_session(args.master))
        source = EventSource(args.bootstrap_servers, prefix)
        with tempfile.TemporaryDirectory() as out:
            timed("lifecycle", seconds, lambda: run_lifecycle(
                spark, source, output=f"{out}/lifecycle"))
            table = spark.read.parquet(f"{out}/lifecycle")
            outcomes = {r["outcome"]: r["count"]
                        for r in table.groupBy("outcome").count().collect()}
            report = timed("reconcile", seconds, lambda: run_reconcile(
                spark, source, "Bench", journal))
            timed("metrics", seconds, lambda: run_metrics(
                spark, source, window="1 minute", output=f"{out}/metrics"))
            windows = spark.read.parquet(f"{out}/metrics").count()
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
        "seconds": seconds,
        "events_per_second": {job: round(events / seconds[job])
                              for job in ("lifecycle", "reconcile", "metrics")},
        "lifecycle_outcomes": outcomes,
        "reconcile": {"done": report.done, "pending": report.pending,
                      "violations": len(report.violations)},
        "metrics_windows": windows,
        "agrees_with_workload": agrees,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.entries == 200_000:
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    print(json.dumps(result, indent=2))
    return 0 if agrees else 1


if __name__ == "__main__":
    sys.exit(main())
