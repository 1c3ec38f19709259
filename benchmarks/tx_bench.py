"""What exactly-once processing costs (issue 34): consume-transform-produce through one
queue, settled in Kafka transactions of the consumers (``QueueConsumer(transactional=True)``,
``consumer.transaction()``) against the same work at-least-once, in one run.

    .venv/bin/python benchmarks/tx_bench.py [--bootstrap-servers ...] [--database-url ...]
        [--messages 6000] [--runs 3] [--size 1024] [--consumers 2] [--sizes 1,10,100]

One scratch installation (its own database and topic prefix, one `qlayer coordinator run`
process), one queue over a 4-partition journal. ``--consumers`` SDK processes take messages in
groups of up to N (the transaction size, ``--sizes``; a group is what arrived within 20 ms, at
most N) and, for each group:

- **at-least-once**: produce one result per message to an output topic (an idempotent
  producer), wait until Kafka has them (flush), then ack the messages: a crash in between
  repeats results, never loses one;
- **transactional**: begin a transaction, produce the results, ack the messages in it, commit:
  each result is committed once.

Each run produces ``--messages`` records of ``--size`` bytes and times first produce -> every
record acked (the queue's recovery points at the journal's end). Two latencies per message,
p50 and p99 over the runs: from the record's produce time (its timestamp) to the moment its
group was settled (acked, or committed), which includes waiting in the queue behind the burst
of a run; and from the moment the consumer received it to that settlement, which is what
settling costs (the group's wait for its other messages, the produce, the flush or commit).
Figures are medians of ``--runs`` runs; every cell in one
session.

Results: benchmarks/results/tx.json (with the machine and the command); benchmarks/report.py
renders them into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Feeder, create_topic, machine, percentile
from confluent_kafka import Producer
from shards_bench import Installation

from layer.settings import Settings

HERE = Path(__file__).resolve().parent.parent
RESULTS = HERE / "benchmarks" / "results" / "tx.json"
PARTITIONS = 4
GROUP_WAIT = 0.02


def worker(bootstrap: str, prefix: str, out: str, mode: str, size: int, name: str,
           stop: Any, ready: Any, latencies: Any) -> None:
    """One consumer process: settle groups of up to ``size`` messages in ``mode``; at the
    end, send the settle latencies (ms) of what it handled."""
    from layer.sdk import QueueConsumer

    transactional = mode == "transactional"
    consumer = QueueConsumer("Work", bootstrap, topic_prefix=prefix, consumer_id=name,
                             max_backlog=max(200, 2 * size), transactional=transactional,
                             subscribe_timeout=60)
    plain = None if transactional else Producer({"bootstrap.servers": bootstrap,
                                                 "enable.idempotence": True, "linger.ms": 5})
    ready.release()
    seen: list[float] = []  # produce -> settled, per message (ms)
    settling: list[float] = []  # received -> settled, per message (ms)
    while not stop.is_set():
        first = consumer.receive(timeout=0.2)
        if first is None:
            continue
        group = [first]
        received = [time.time() * 1000]
        until = time.monotonic() + GROUP_WAIT
        while len(group) < size and time.monotonic() < until:
            more = consumer.receive(timeout=max(until - time.monotonic(), 0.001))
            if more is not None:
                group.append(more)
                received.append(time.time() * 1000)
        if plain is not None:
            for m in group:
                plain.produce(out, (m.value or b"")[:64], key=m.key)
            plain.flush(30)
            for m in group:
                m.ack()
        else:
            with consumer.transaction() as tx:
                for m in group:
                    tx.produce(out, (m.value or b"")[:64], key=m.key)
                    tx.ack(m)
        settled = time.time() * 1000
        seen.extend(settled - m.timestamp.timestamp() * 1000 for m in group
                    if m.timestamp is not None)
        settling.extend(settled - at for at in received)
    consumer.close()
    latencies.put((seen, settling))


def run_cell(args: argparse.Namespace, mode: str, size: int) -> dict[str, Any]:
    cell = Installation(args.bootstrap_servers, args.database_url, HERE, args.log_dir)
    ctx = mp.get_context("spawn")
    stop, ready, latencies = ctx.Event(), ctx.Semaphore(0), ctx.Queue()
    workers: list[Any] = []
    try:
        cell.start("c0")
        cell.wait_running(1)
        journal = f"bench-{cell.prefix.rstrip('.')}-work"
        out = f"bench-{cell.prefix.rstrip('.')}-out"
        create_topic(args.bootstrap_servers, journal, PARTITIONS)
        create_topic(args.bootstrap_servers, out, PARTITIONS)
        cell._cli("queue", "create", "Work", "--underlying-topic", journal, "--lease-period",
                  "60s", "--max-backlog", "1000")
        for i in range(args.consumers):
            p = ctx.Process(target=worker, args=(args.bootstrap_servers, cell.prefix, out, mode,
                                                 size, f"w{i}", stop, ready, latencies))
            p.start()
            workers.append(p)
        for _ in workers:
            ready.acquire(timeout=120)
        feeder = Feeder(args.bootstrap_servers, journal, args.size)

        feeder.produce(500)  # warm-up: every consumer subscribed, every producer initialised
        cell.wait_acked("Work", feeder.produced)
        runs = []
        for _ in range(args.runs):
            started = time.time()
            feeder.produce(args.messages)
            cell.wait_acked("Work", feeder.produced)
            seconds = time.time() - started
            runs.append({"messages": args.messages, "seconds": round(seconds, 3),
                         "acked_per_second": round(args.messages / seconds)})
            print(json.dumps({"mode": mode, "size": size, **runs[-1]}), flush=True)
        stop.set()
        got = [latencies.get(timeout=60) for _ in workers]
        samples = sorted(x for seen, _ in got for x in seen)
        settle = sorted(x for _, settling in got for x in settling)
        return {"mode": mode, "transaction_size": size, "consumers": args.consumers,
                "message_size": args.size, "runs": runs,
                "acked_per_second": round(statistics.median(r["acked_per_second"]
                                                            for r in runs)),
                "p50_ms": round(percentile(samples, 0.5), 1),
                "p99_ms": round(percentile(samples, 0.99), 1),
                "settle_p50_ms": round(percentile(settle, 0.5), 1),
                "settle_p99_ms": round(percentile(settle, 0.99), 1)}
    finally:
        stop.set()
        for p in workers:
            p.join(30)
        cell.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", default=None,
                        help="default: the settings' (QLAYER_BOOTSTRAP_SERVERS, the dev stack)")
    parser.add_argument("--database-url", default=None,
                        help="a server URL where CREATE DATABASE is allowed (default: the "
                        "settings')")
    parser.add_argument("--messages", type=int, default=6000, help="records per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--sizes", default="1,10,100",
                        help="transaction sizes (messages per commit), comma-separated")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.bootstrap_servers is None or args.database_url is None:
        settings = Settings.load()
        args.bootstrap_servers = args.bootstrap_servers or settings.bootstrap_servers
        args.database_url = args.database_url or settings.database_url
    sizes = [int(s) for s in args.sizes.split(",")]
    cells = []
    for size in sizes:
        for mode in ("at-least-once", "transactional"):
            cells.append(run_cell(args, mode, size))
    for size in sizes:
        plain = next(c for c in cells if c["transaction_size"] == size
                     and c["mode"] == "at-least-once")
        for c in cells:
            if c["transaction_size"] == size:
                c["vs_at_least_once"] = round(c["acked_per_second"] / plain["acked_per_second"],
                                              2)
    result = {"version": 1, "command": " ".join(["python", *sys.argv]), "machine": machine(),
              "cells": cells}
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps([(c["mode"], c["transaction_size"], c["acked_per_second"], c["p50_ms"],
                       c["p99_ms"]) for c in cells]))
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
