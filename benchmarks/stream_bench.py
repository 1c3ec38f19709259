"""Streaming benchmark: what a `metrics` / `views` micro-batch costs as the history grows.

    .venv/bin/python benchmarks/stream_bench.py --bootstrap-servers 127.0.0.1:29092
    .venv/bin/python benchmarks/stream_bench.py --entries-per-round 2000 --rounds 3

Writes ``--rounds`` rounds of ``--entries-per-round`` entries x 5 events
(layer.pipeline.synthetic: renewals, redeliveries, releases, dead letters, one in ten left
leased), each round an hour after the one before in event time, as a protocol-3 coordinator
writes them (`EventBatch` records of ``--batch-events`` events, the protocol's Codec), with
their journal records. After each round it runs ``metrics --stream`` and ``views --stream``
(``--include-leased``, grouped by region) with ``--available-now`` on one checkpoint each, and
prints per run: the event records read, Spark's input rows, the state rows updated and
removed, the parts (windows, buckets) rewritten and the rows read back from them, the output
rows written, and the wall seconds of the run and of its micro-batches (Spark's
``batchDuration``). A flat cost per round while the history grows is what incremental means.
``--save`` writes the run's figures to benchmarks/results/pipeline-stream.json (as committed,
that file holds the runs docs/pipeline.md quotes, before and after). Not a test.
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

from layer.pipeline.io import local_session
from layer.pipeline.jobs import EventSource, MetricsJob, StreamOptions, ViewsJob, run_job
from layer.pipeline.synthetic import EVENTS_PER_ENTRY, FATES, entry_trail
from layer.protocol import Codec, TopicNames
from layer.protocol.bookmark import Bookmark

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline-stream.json"
PARTITIONS = 2
HOUR = 3_600_000


def _send(producer: Producer, topic: str, value: bytes, partition: int) -> None:
    while True:
        try:
            producer.produce(topic, value, partition=partition)
            return
        except BufferError:  # the local queue is full: let it drain
            producer.poll(0.05)


def write_round(bootstrap: str, events_topic: str, journal: str, first: int, entries: int,
                start_ms: int, batch_events: int, batch_base: int) -> int:
    """Entries ``first`` .. ``first + entries - 1`` (journal records and events), enqueued one
    per ms from ``start_ms``; returns the event records written."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                         "compression.type": "lz4"})
    codec = Codec()
    items: list[bytes] = []
    records = 0
    for g in range(first, first + entries):
        body = json.dumps({"id": g, "region": ("east", "west", "north")[g % 3],
                           "qty": 1 + g % 5}).encode()
        _send(producer, journal, body, g % PARTITIONS)
    for n, g in enumerate(range(first, first + entries)):
        bookmark = Bookmark(journal, g % PARTITIONS, g // PARTITIONS)
        for event in entry_trail("Bench", bookmark, start_ms + n,
                                 FATES[bookmark.offset % len(FATES)]):
            items.append(codec.event_item(codec.encode_event(event)))
    for i in range(0, len(items), batch_events):
        for array in codec.event_arrays(items[i:i + batch_events]):
            batch_id = batch_base + records
            _send(producer, events_topic,
                  codec.encode_event_batch(batch_id, batch_id % PARTITIONS, array),
                  batch_id % PARTITIONS)
            records += 1
    producer.flush(120)
    return records


def run(job: Any, spark: Any, source: EventSource, stream: StreamOptions, output: str
        ) -> dict[str, Any]:
    began = time.perf_counter()
    done = run_job(job, source, spark=spark, stream=stream, output=output)
    wall = round(time.perf_counter() - began, 2)
    s = done.stream
    assert s is not None
    changes = getattr(s, "changes", ())
    return {
        "wall_s": wall,
        "micro_batches": s.batches,
        "event_records": s.events,
        "input_rows": sum(p.input_rows for p in s.progress),
        "batch_s": [round(getattr(p, "duration_ms", 0) / 1000, 2) for p in s.progress],
        "state_rows_total": s.progress[-1].state_rows_total if s.progress else None,
        "state_rows_updated": sum(p.state_rows_updated for p in s.progress),
        "state_rows_removed": sum(p.state_rows_removed for p in s.progress),
        "entries": sum(c.entries for c in changes),
        "parts": sum(c.parts for c in changes),
        "part_rows_read": sum(c.part_rows_read for c in changes),
        "rows_written": sum(c.rows_written for c in changes),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:29092")
    parser.add_argument("--entries-per-round", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--first-round", type=int,
                        help="entries of the first round (a history written before the "
                        "rounds that are compared); default --entries-per-round")
    parser.add_argument("--batch-events", type=int, default=500)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--jobs", default="metrics,views", help="of metrics, views")
    parser.add_argument("--save", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args()

    prefix = f"sbench{uuid.uuid4().hex[:8]}."
    events_topic = TopicNames(prefix).events
    journal = f"sbench-journal-{uuid.uuid4().hex[:8]}"
    create_topic(args.bootstrap_servers, events_topic, PARTITIONS)
    create_topic(args.bootstrap_servers, journal, PARTITIONS)
    n = args.entries_per_round
    base_ms = int(time.time() * 1000) - (args.rounds + 1) * HOUR
    runs: list[dict[str, Any]] = []
    try:
        spark = local_session(args.master)
        source = EventSource(args.bootstrap_servers, prefix)
        with tempfile.TemporaryDirectory() as out:
            metrics = StreamOptions(f"{out}/metrics-ckpt", available_now=True)
            views = StreamOptions(f"{out}/views-ckpt", available_now=True)
            view_job = ViewsJob("Bench", journal, ("/region", "SUM(/qty) AS /units",
                                                   "COUNT(*) AS /entries"), ("/region",),
                                None, True, base_ms + (args.rounds + 1) * HOUR)
            sizes = [args.first_round or n] + [n] * (args.rounds - 1)
            for r, size in enumerate(sizes):
                first = sum(sizes[:r])
                written = write_round(args.bootstrap_servers, events_topic, journal, first,
                                      size, base_ms + r * HOUR, args.batch_events,
                                      10**9 * (r + 1))
                for name, job, stream in (("metrics", MetricsJob("Bench"), metrics),
                                          ("views", view_job, views)):
                    if name not in args.jobs.split(","):
                        continue
                    found = run(job, spark, source, stream, f"{out}/{name}")
                    found.update(job=name, round=r + 1, round_entries=size,
                                 history_events=(first + size) * EVENTS_PER_ENTRY,
                                 round_records=written)
                    runs.append(found)
                    print(json.dumps(found), flush=True)
        spark.stop()
    finally:
        delete_topics(args.bootstrap_servers, [events_topic, journal])
    result = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "machine": machine(),
        "master": args.master,
        "entries_per_round": n,
        "events_per_round": n * EVENTS_PER_ENTRY,
        "events_per_record": args.batch_events,
        "runs": runs,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.save:
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
