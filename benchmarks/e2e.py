"""End-to-end figures of one coordinator: throughput, latency, PostgreSQL statements per message.

    python benchmarks/e2e.py [--messages 20000] [--size 1024] [--consumers 3] [--rate 1000]

Runs against the local stack (`qlayer dev up`; or --bootstrap-servers / --database-url), in a
scratch database and under a fresh topic prefix, so it never touches real queues. The
coordinator runs in this process (so its counters can be read); each consumer is a separate
process using the SDK, acking every message. Results are printed and written to
benchmarks/results/e2e.json with the machine description.

- throughput: N messages of the given size are produced as fast as possible to a 3-partition
  journal while the consumers wait; the figure is N / (time from the first produce to the
  moment every message is acked, i.e. the queue's recovery points reach the journal's end);
- latency: messages carrying their send time are produced at a fixed rate; a consumer
  measures receive time minus send time (same machine, same clock);
- statements per message: the coordinator's own count of statements sent to PostgreSQL during
  the throughput phase, divided by N.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import struct
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import create_topic, machine, scratch_database
from confluent_kafka import Producer

from layer.coordinator.options import CoordinatorOptions
from layer.coordinator.process import CoordinatorProcess as Coordinator
from layer.settings import Settings
from layer.store.store import Store

STAMP = struct.Struct(">d")


def consume(settings: dict[str, str], queue: str, done: Any, total: int,
            latencies: Any, ready: Any) -> None:
    """A consumer process: ack everything; for latency runs, report send-to-receive times."""
    from layer import QueueConsumer

    consumer = QueueConsumer(queue, settings["bootstrap_servers"],
                             topic_prefix=settings["topic_prefix"], max_backlog=500,
                             ack_batch_size=500, ack_interval=0.005)
    ready.release()
    mine: list[float] = []
    while done.value < total:
        msg = consumer.receive(timeout=0.2)
        if msg is None:
            continue
        value = msg.value or b""
        if latencies is not None and len(value) >= STAMP.size:
            mine.append(time.time() - STAMP.unpack_from(value)[0])
        msg.ack()
        with done.get_lock():
            done.value += 1
    consumer.close()
    if latencies is not None:
        latencies.put(mine)


def acked(store: Store, queue: str) -> int:
    return sum(store.load_recovery_points(queue).values())


def run_phase(settings: Settings, queue: str, messages: int, size: int, consumers: int,
              rate: float | None, transactional: bool) -> dict[str, Any]:
    # Not under the internal-topic prefix: the coordinator never treats those as journals.
    journal = f"bench-{settings.topic_prefix.rstrip('.')}-{queue}"
    create_topic(settings.bootstrap_servers, journal, 3)
    with Store(settings.database_url) as store:
        store.put_queue(queue, {"name": queue, "underlying_topic": journal,
                                "lease_period": "60s", "max_per_subscription_backlog": 1000},
                        time.time())
    coordinator = Coordinator(settings, CoordinatorOptions(refresh_interval=0.5,
                                                           transactional=transactional))
    thread = threading.Thread(target=coordinator.run, kwargs={"install_signals": False},
                              daemon=True)
    thread.start()
    ctx = mp.get_context("spawn")
    done = ctx.Value("q", 0)
    ready = ctx.Semaphore(0)
    latencies = ctx.Queue() if rate is not None else None
    plain = {"bootstrap_servers": settings.bootstrap_servers,
             "topic_prefix": settings.topic_prefix}
    procs = [ctx.Process(target=consume, args=(plain, queue, done, messages, latencies, ready))
             for _ in range(consumers)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire(timeout=120)
    time.sleep(1.0)
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "linger.ms": 5})
    padding = b"x" * max(0, size - STAMP.size)
    statements_before = coordinator.counters["statements"]
    started = time.time()
    for i in range(messages):
        if rate is not None:
            wait = started + i / rate - time.time()
            if wait > 0:
                time.sleep(wait)
        producer.produce(journal, STAMP.pack(time.time()) + padding, key=str(i).encode())
        if i % 1000 == 0:
            producer.poll(0)
    producer.flush(60)
    with Store(settings.database_url) as store:
        deadline = time.time() + 600
        while acked(store, queue) < messages and time.time() < deadline:
            time.sleep(0.05)
        finished = time.time()
        complete = acked(store, queue) == messages
    statements = coordinator.counters["statements"] - statements_before
    result: dict[str, Any] = {"messages": messages, "size": size, "consumers": consumers,
                              "kafka_transactions": transactional,
                              "complete": complete, "seconds": round(finished - started, 3),
                              "statements": statements,
                              "statements_per_message": round(statements / messages, 4),
                              "transactions": coordinator.counters["transactions"]}
    if rate is None:
        result["acked_per_second"] = round(messages / (finished - started))
    else:
        samples: list[float] = []
        for _ in procs:
            assert latencies is not None
            samples.extend(latencies.get(timeout=60))
        samples.sort()
        result["rate"] = rate
        result["latency_ms"] = {
            "p50": round(1000 * samples[len(samples) // 2], 2),
            "p99": round(1000 * samples[int(len(samples) * 0.99)], 2),
            "max": round(1000 * samples[-1], 2),
            "mean": round(1000 * statistics.fmean(samples), 2),
        }
    for p in procs:
        p.join(30)
    coordinator.stop()
    thread.join(30)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--no-transactions", action="store_true",
                        help="coordinator without Kafka transactions (no zombie fencing)")
    parser.add_argument("--bootstrap-servers")
    parser.add_argument("--database-url", help="a server URL where CREATE DATABASE is allowed")
    args = parser.parse_args()
    base = Settings.load(bootstrap_servers=args.bootstrap_servers, database_url=args.database_url)
    settings = Settings(bootstrap_servers=base.bootstrap_servers,
                        database_url=scratch_database(base.database_url),
                        topic_prefix=f"bench{uuid.uuid4().hex[:6]}.")
    transactional = not args.no_transactions
    throughput = run_phase(settings, "Throughput", args.messages, args.size, args.consumers,
                           None, transactional)
    print(json.dumps({"throughput": throughput}))
    latency = run_phase(settings, "Latency", int(args.rate * args.latency_seconds), args.size,
                        args.consumers, args.rate, transactional)
    print(json.dumps({"latency": latency}))
    out = Path(__file__).parent / "results" / (
        "e2e.json" if transactional else "e2e-no-transactions.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine(),
                               "throughput": throughput, "latency": latency}, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
