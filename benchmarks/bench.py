"""qlayer side by side with the raw Kafka limit and Kafka's share groups (issue 7), in one run.

    make bench                      # quick matrix (~5 minutes on 2 cores)
    BENCH_FULL=1 make bench         # full matrix: more messages, more repetitions
    .venv/bin/python benchmarks/bench.py [--full] [--bootstrap-servers ...] [--database-url ...]

Every system gets the same journal (4 partitions), the same message count, payload sizes
(200 B, 1 KiB) and consumer counts (1, 4), and every message is acknowledged:

- relay: the limit for a layer of this shape. One Python process (confluent-kafka) consumes the
  journal, produces every record to a second topic, flushes, commits; consumer processes read
  that topic and commit what they read (their "ack").
- share-ck: Kafka share groups (KIP-932) through confluent-kafka's ShareConsumer, explicit
  ACCEPT for each record and commit_sync after each poll.
- share-tool: Kafka's own ShareConsumerPerformance (kafka-tools jar, Java, implicit acks) on
  records produced beforehand; its own nMsg.sec figure (it times consumption only).
- qlayer-alo / qlayer-amo: qlayer through the SDK (QueueConsumer, ack every message) on an
  at-least-once and an at-most-once queue; the coordinator runs in its own process so its CPU
  time and peak RSS are its own, with its default shard core (native when built).
- qlayer-alo-python: qlayer-alo with the coordinator's Python core (`--core python`, the
  reference): the native core's before/after in every run.

Throughput cell: the consumers (and relay/coordinator) start, a warm-up batch goes through,
then each repetition produces N records as fast as possible and the figure is N / (first
produce -> every record acknowledged). For qlayer "acknowledged" means the queue's recovery
points, in PostgreSQL, reach the journal's end. Medians over the repetitions. Latency cell:
records carrying their send time at a fixed rate, in as many runs as the plan's repetitions;
consumers record receive time minus send time; each quantile is the median of the runs' own.
Results: benchmarks/results/bench.json; `benchmarks/report.py` writes docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import random
import statistics
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import contextlib

from common import (
    broker_log_dir,
    create_topic,
    database_rows,
    delete_cell_topics,
    drop_database,
    machine,
    percentile,
    scratch_database,
    share_group_from_earliest,
    topic_log_bytes,
)
from confluent_kafka import Producer

from layer.settings import Settings

STAMP = struct.Struct(">d")
PARTITIONS = 4
SEED = 7
RESULTS = Path(__file__).parent / "results" / "bench.json"
CTX = mp.get_context("spawn")


@dataclass(frozen=True)
class Plan:
    messages: int
    warmup: int
    repetitions: int
    sizes: tuple[int, ...]
    consumer_counts: tuple[int, ...]
    latency_rate: float
    latency_seconds: float
    latency_size: int
    latency_consumers: int
    #: The messages in flight (leased, unacknowledged) per journal partition: 2,000 is the
    #: in-flight allowance of one share-partition in Kafka 4.x
    #: (`group.share.partition.max.record.locks`). A share group over the 4-partition journal
    #: may so have 8,000 in flight whatever its consumer count; qlayer's consumers share the
    #: same total (`max_backlog` = 2,000 × 4 / consumers each, and the queue's
    #: max_per_subscription_backlog), so both queue systems keep as much work on the way.
    max_backlog: int = 2000

    def backlog_per_consumer(self, consumers: int) -> int:
        return self.max_backlog * PARTITIONS // consumers


QUICK = Plan(messages=20_000, warmup=2_000, repetitions=3, sizes=(200, 1024),
             consumer_counts=(1, 4), latency_rate=1000.0, latency_seconds=5.0,
             latency_size=1024, latency_consumers=1)
FULL = Plan(messages=30_000, warmup=5_000, repetitions=5, sizes=(200, 1024),
            consumer_counts=(1, 4), latency_rate=1000.0, latency_seconds=20.0,
            latency_size=1024, latency_consumers=4)


# --- processes ------------------------------------------------------------------------------

def _stamp_of(value: bytes | None) -> float:
    if value is None or len(value) < STAMP.size:
        return 0.0
    return float(STAMP.unpack_from(value)[0])


#: A latency sample: (send time, receive time - send time), seconds. The send time tells which
#: of a latency cell's repetitions the record belongs to.
Sample = tuple[float, float]


def _samples(now: float, values: Any) -> list[Sample]:
    return [(s, now - s) for s in map(_stamp_of, values) if s > 0]


def _finish(samples: list[Sample], latencies: Any) -> None:
    latencies.put(samples)


def relay_worker(bootstrap: str, journal: str, out_topic: str, group: str, ready: Any,
                 stop: Any, linger_ms: int = 5) -> None:
    """The relay itself: journal -> out_topic, at least once (flush before commit)."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": linger_ms})
    consumer.subscribe([journal])
    ready.release()
    while not stop.is_set():
        # A short wait: consume() holds a batch until it is full or the timeout passes, which
        # at a moderate rate would be latency the relay adds for nothing.
        records = consumer.consume(2000, timeout=0.005)
        good = [r for r in records if r.error() is None]
        if not good:
            continue
        for r in good:
            producer.produce(out_topic, r.value(), key=r.key(), headers=r.headers(),
                             partition=r.partition())
        producer.flush(30)
        consumer.commit(asynchronous=True)
    consumer.close()


def kafka_worker(bootstrap: str, topic: str, group: str, done: Any, ready: Any, stop: Any,
                 latencies: Any) -> None:
    """A relay's final consumer: reads and commits (its ack) every record."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    ready.release()
    samples: list[Sample] = []
    while not stop.is_set():
        records = consumer.consume(500, timeout=0.005)
        good = [r for r in records if r.error() is None]
        if not good:
            continue
        samples.extend(_samples(time.time(), (r.value() for r in good)))
        consumer.commit(asynchronous=False)
        with done.get_lock():
            done.value += len(good)
    consumer.close()
    _finish(samples, latencies)


def share_worker(bootstrap: str, topic: str, group: str, done: Any, ready: Any, stop: Any,
                 latencies: Any) -> None:
    """A confluent-kafka ShareConsumer: explicit ACCEPT of every record, commit_sync per poll."""
    from confluent_kafka import ShareConsumer

    consumer = ShareConsumer({"bootstrap.servers": bootstrap, "group.id": group,
                              "share.acknowledgement.mode": "explicit"})
    consumer.subscribe([topic])
    ready.release()
    samples: list[Sample] = []
    while not stop.is_set():
        records = consumer.poll(timeout=0.1) or []
        good = [r for r in records if r.error() is None]
        for r in records:
            if r.error() is None:
                consumer.acknowledge(r)
        if not good:
            continue
        samples.extend(_samples(time.time(), (r.value() for r in good)))
        consumer.commit_sync()
        with done.get_lock():
            done.value += len(good)
    consumer.close()
    _finish(samples, latencies)


def qlayer_worker(bootstrap: str, prefix: str, queue: str, done: Any, ready: Any, stop: Any,
                  latencies: Any, max_backlog: int) -> None:
    """An SDK consumer acking every message (acks batched by the SDK)."""
    from layer import QueueConsumer

    errors: list[Any] = []
    consumer = QueueConsumer(queue, bootstrap, topic_prefix=prefix, max_backlog=max_backlog,
                             ack_batch_size=500, ack_interval=0.005,
                             on_ack_error=errors.append)
    if os.environ.get("QLAYER_BENCH_CONSUMER_GC") == "freeze":
        # What an application may do once it has set up (docs/sdk.md, "Garbage collection"):
        # the consumer's later full collections do not walk what the start-up left.
        import gc

        gc.collect()
        gc.freeze()
    ready.release()
    samples: list[Sample] = []
    counted = 0  # acked, not yet added to `done` (a lock per message cost a microsecond)

    def count() -> None:
        nonlocal counted
        if counted:
            with done.get_lock():
                done.value += counted
            counted = 0

    # `stop` is a multiprocessing Event (a semaphore lock per look): looked at when the buffer
    # runs dry or every 500 messages, as the other systems' workers look once per poll, not
    # per message (per message it was 6 % of this process's CPU, py-spy).
    while True:
        msg = consumer.receive(timeout=0)
        if msg is None:
            # Nothing more buffered: what was acked counts before waiting (as the other
            # systems' workers count a whole poll's records at once).
            count()
            if stop.is_set():
                break
            msg = consumer.receive(timeout=0.1)
            if msg is None:
                continue
        stamp = _stamp_of(msg.value)
        if stamp > 0:
            samples.append((stamp, time.time() - stamp))
        msg.ack()
        counted += 1
        if counted >= 500:
            count()
            if stop.is_set():
                break
    count()
    consumer.close()
    _finish(samples, latencies)


def coordinator_process(settings: dict[str, str], conn: Any, core: str = "auto") -> None:
    """The coordinator alone in a process, answering "counters" and "stop" on a pipe."""
    import threading

    from layer.coordinator.options import CoordinatorOptions
    from layer.coordinator.process import CoordinatorProcess as Coordinator

    # The defaults a user runs with, but the core. (A refresh interval of 0.5 s, used here
    # before, re-read the catalog from PostgreSQL four times as often: 2.7 % of the
    # coordinator's time in a throughput cell, py-spy; the queue exists before it starts.)
    # QLAYER_BENCH_IDLE_SHARD_INTERVAL and QLAYER_BENCH_OFFSET_COMMIT_INTERVAL: a
    # before/after of those options in one session (0 is the behaviour before each existed:
    # every shard every round; the inputs' Kafka offsets committed after every iteration).
    overrides = {name: float(value) for name, variable in (
        ("idle_shard_interval", "QLAYER_BENCH_IDLE_SHARD_INTERVAL"),
        ("offset_commit_interval", "QLAYER_BENCH_OFFSET_COMMIT_INTERVAL"))
        if (value := os.environ.get(variable)) is not None}
    options = CoordinatorOptions(core=core, **overrides)  # type: ignore[arg-type]
    coordinator = Coordinator(Settings(**settings), options)
    thread = threading.Thread(target=coordinator.run, kwargs={"install_signals": False},
                              daemon=True)
    thread.start()
    while True:
        command = conn.recv()
        if command == "counters":
            conn.send(dict(coordinator.counters))
        else:
            coordinator.stop()
            thread.join(30)
            conn.send(dict(coordinator.counters))
            return


# --- measurement ------------------------------------------------------------------------------

def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads, librdkafka's included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Workload:
    """Produces stamped records of one size to a journal, keys seeded so every run is alike."""

    def __init__(self, bootstrap: str, journal: str, size: int, linger_ms: int = 5) -> None:
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": linger_ms})
        self.journal = journal
        # Distinct incompressible payloads: the coordinator's producer compresses (lz4), and one
        # repeated payload would shrink its batches to nothing. A thousand payloads cycle at
        # ~1 MB intervals, beyond lz4's 64 KiB window.
        rng = random.Random(SEED)
        self.paddings = [rng.randbytes(max(0, size - STAMP.size)) for _ in range(1000)]
        self.keys = [str(i).encode() for i in range(1000)]
        self.sent = 0

    def send(self, count: int, rate: float | None = None, stamped: bool = True) -> None:
        started = time.time()
        for i in range(count):
            if rate is not None:
                wait = started + i / rate - time.time()
                if wait > 0:
                    time.sleep(wait)
            stamp = time.time() if stamped else 0.0
            n = (self.sent + i) % 1000
            self.producer.produce(self.journal, STAMP.pack(stamp) + self.paddings[n],
                                  key=self.keys[n])
            if i % 500 == 0:
                self.producer.poll(0)
        self.producer.flush(60)
        self.sent += count


def wait_for(condition: Callable[[], bool], timeout: float = 300.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@dataclass
class Cell:
    system: str
    size: int
    consumers: int
    rate: float | None = None


def linger_ms(cell: Cell) -> int:
    """The harness's producer (and the relay's) batch for 5 ms in throughput cells, as
    publishers tuned for throughput do; in latency cells they send at once, as qlayer's
    coordinator does, so that no system's figure carries the harness's own batching wait
    (librdkafka's default 5 ms added 2.5-5 ms to every system's latency before)."""
    return 5 if cell.rate is None else 0


class Harness:
    def __init__(self, settings: Settings, plan: Plan) -> None:
        self.settings = settings
        self.plan = plan
        self.bootstrap = settings.bootstrap_servers
        self.log_dir = broker_log_dir(self.bootstrap)
        self.run_id = uuid.uuid4().hex[:6]
        self.counter = 0

    def name(self, what: str) -> str:
        self.counter += 1
        return f"bench-{self.run_id}-{self.counter}-{what}"

    # One cell: set up the system, warm it up, run the repetitions (or the latency run).
    def run(self, cell: Cell) -> dict[str, Any]:
        if cell.system == "share-tool":
            return self.share_tool(cell)
        journal = self.name("journal")
        create_topic(self.bootstrap, journal, PARTITIONS)
        done = CTX.Value("q", 0)
        ready = CTX.Semaphore(0)
        stop = CTX.Event()
        latencies = CTX.Queue()
        procs: list[Any] = []
        layer_pid: int | None = None
        prefixes: list[str] = []
        topics = [journal]
        pipe = None
        store = None
        database = ""
        queue = ""
        group = self.name("group")
        if cell.system == "relay":
            out = self.name("relayed")
            create_topic(self.bootstrap, out, PARTITIONS)
            topics.append(out)
            relay = CTX.Process(target=relay_worker,
                                args=(self.bootstrap, journal, out, group + "-relay", ready, stop,
                                      linger_ms(cell)))
            procs.append(relay)
            procs += [CTX.Process(target=kafka_worker, args=(self.bootstrap, out, group, done,
                                                             ready, stop, latencies))
                      for _ in range(cell.consumers)]
        elif cell.system == "share-ck":
            share_group_from_earliest(self.bootstrap, group)
            procs += [CTX.Process(target=share_worker, args=(self.bootstrap, journal, group, done,
                                                             ready, stop, latencies))
                      for _ in range(cell.consumers)]
        else:
            from layer.store.store import Store

            prefix = f"bench{self.run_id}x{self.counter}."
            prefixes.append(prefix)
            database = scratch_database(self.settings.database_url)
            queue = "Bench"
            store = Store(database)
            semantics = "at-most-once" if cell.system == "qlayer-amo" else "at-least-once"
            store.put_queue(queue, {"name": queue, "underlying_topic": journal,
                                    "semantics": semantics, "lease_period": "60s",
                                    "max_per_subscription_backlog":
                                        self.plan.backlog_per_consumer(cell.consumers)},
                            time.time())
            pipe, child = CTX.Pipe()
            core = "python" if cell.system == "qlayer-alo-python" else "auto"
            coord = CTX.Process(target=coordinator_process,
                                args=({"bootstrap_servers": self.bootstrap,
                                       "database_url": database, "topic_prefix": prefix}, child,
                                      core))
            coord.start()
            layer_pid = coord.pid
            time.sleep(2.0)  # the coordinator owns the shard before consumers subscribe
            procs += [CTX.Process(target=qlayer_worker, args=(self.bootstrap, prefix, queue, done,
                                                              ready, stop, latencies,
                                                              self.plan.backlog_per_consumer(
                                                                  cell.consumers)))
                      for _ in range(cell.consumers)]
        for p in procs:
            p.start()
        if cell.system == "relay":
            layer_pid = procs[0].pid
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise RuntimeError(f"{cell.system}: a consumer did not start")
        time.sleep(2.0)  # group assignments settle

        def acked() -> int:
            if store is not None:
                return sum(store.load_recovery_points(queue).values())
            return int(done.value)

        def through(target: int) -> Callable[[], bool]:
            if store is not None:
                return lambda: done.value >= target and acked() >= target
            return lambda: done.value >= target

        workload = Workload(self.bootstrap, journal, cell.size, linger_ms(cell))
        workload.send(self.plan.warmup, stamped=False)
        if not wait_for(through(workload.sent), 120):
            raise RuntimeError(f"{cell.system}: the warm-up did not go through ({acked()})")
        result: dict[str, Any] = {"system": cell.system, "size": cell.size,
                                  "consumers": cell.consumers}
        bytes_before = topic_log_bytes(self.log_dir, topics, prefixes)
        journal_before = topic_log_bytes(self.log_dir, [journal], [])
        cpu_before = process_cpu(layer_pid) if layer_pid else None
        counters_before = self._counters(pipe)
        rows_before = database_rows(database) if store is not None else None
        count = 0
        windows: list[tuple[float, float]] = []  # each latency repetition's sends
        if cell.rate is None:
            rates = []
            for _ in range(self.plan.repetitions):
                started = time.time()
                workload.send(self.plan.messages)
                complete = wait_for(through(workload.sent))
                rates.append(self.plan.messages / (time.time() - started))
                if not complete:
                    result["incomplete"] = True
                    break
                count += self.plan.messages
            result["acked_per_second"] = round(statistics.median(rates))
            result["repetitions"] = [round(r) for r in rates]
        else:
            # Repetitions as in the throughput cells: one run's p99 rests on its worst 1 % (50
            # records at 5 s), which one pause of the machine decides; the median of several
            # runs is the figure.
            per_run = int(cell.rate * self.plan.latency_seconds)
            for _ in range(self.plan.repetitions):
                started = time.time()
                workload.send(per_run, rate=cell.rate)
                windows.append((started, time.time()))
                if not wait_for(through(workload.sent), 120):
                    result["incomplete"] = True
                    break
                count += per_run
                time.sleep(1.0)
            result["rate"] = cell.rate
        time.sleep(1.5)  # broker segments and pg_stat_database catch up
        messages = max(count, 1)
        if layer_pid:
            result["layer_cpu_seconds_per_1k"] = round(
                1000 * (process_cpu(layer_pid) - (cpu_before or 0.0)) / messages, 4)
            result["layer_peak_rss_mb"] = round(peak_rss_mb(layer_pid), 1)
        counters_after = self._counters(pipe)
        if counters_before is not None and counters_after is not None:
            result["statements_per_message"] = round(
                (counters_after["statements"] - counters_before["statements"]) / messages, 4)
            result["transactions_per_message"] = round(
                (counters_after["transactions"] - counters_before["transactions"]) / messages, 5)
            # The coordinator loop's wall time by phase, in µs per message.
            result["loop_us_per_message"] = {
                phase: round((counters_after.get(f"us_{phase}", 0)
                              - counters_before.get(f"us_{phase}", 0)) / messages, 1)
                for phase in ("polling", "deciding", "committing", "encoding", "writing")}
        if rows_before is not None and store is not None:
            result["rows_per_message"] = round(
                (database_rows(database) - rows_before) / messages, 3)
        bytes_after = topic_log_bytes(self.log_dir, topics, prefixes)
        journal_after = topic_log_bytes(self.log_dir, [journal], [])
        if bytes_before is not None and bytes_after is not None:
            result["kafka_bytes_per_message"] = round((bytes_after - bytes_before) / messages)
            result["journal_bytes_per_message"] = round(
                ((journal_after or 0) - (journal_before or 0)) / messages)
        stop.set()
        samples: list[Sample] = []
        reporters = len(procs) - (1 if cell.system == "relay" else 0)
        for _ in range(reporters):
            with contextlib.suppress(Exception):
                samples.extend(latencies.get(timeout=30))
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if pipe is not None:
            pipe.send("stop")
            pipe.recv()
        if cell.rate is not None:
            runs = [sorted(latency for stamp, latency in samples if first <= stamp <= last)
                    for first, last in windows]
            runs = [run for run in runs if run]
            quantiles = (("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999))
            each = [{q: round(1000 * percentile(run, v), 2) for q, v in quantiles}
                    for run in runs]
            result["latency_samples"] = sum(len(run) for run in runs)
            result["latency_repetitions"] = each
            result["latency_ms"] = {q: round(statistics.median(e[q] for e in each), 2)
                                    for q, _ in quantiles} if each else {}
        if store is not None:
            store.close()
        delete_cell_topics(self.bootstrap, topics, prefixes)
        if database:
            drop_database(database)
        return result

    def _counters(self, pipe: Any) -> dict[str, int] | None:
        if pipe is None:
            return None
        pipe.send("counters")
        return pipe.recv()  # type: ignore[no-any-return]

    def share_tool(self, cell: Cell) -> dict[str, Any]:
        """Kafka's ShareConsumerPerformance on records produced beforehand.

        Its own nMsg.sec is timed from the consumers' start, so it includes joining the share
        group (about five seconds on this broker); the drain rate counts from the first record
        any of its consumers received to the end, which is what the records themselves cost.
        """
        from layer.localstack.kafka import tool_command
        from layer.localstack.stack import StackConfig

        journal = self.name("journal")
        create_topic(self.bootstrap, journal, PARTITIONS)
        # More records than the other systems get: the group join would dominate otherwise.
        records = max(self.plan.messages, 20_000)
        workload = Workload(self.bootstrap, journal, cell.size)
        workload.send(records)
        kafka = StackConfig.from_env().kafka()
        overall, drain = [], []
        for _ in range(self.plan.repetitions):
            group = self.name("toolgroup")
            share_group_from_earliest(self.bootstrap, group)
            command = tool_command(kafka, "org.apache.kafka.tools.ShareConsumerPerformance",
                                   "--bootstrap-server", self.bootstrap, "--topic", journal,
                                   "--group", group, "--num-records", str(records),
                                   "--threads", str(cell.consumers), "--timeout", "30000",
                                   "--show-detailed-stats")
            out = subprocess.run(command, capture_output=True, text=True, timeout=300)
            rate, drained = parse_share_tool(out.stdout, records)
            overall.append(rate)
            if drained is not None:
                drain.append(drained)
        delete_cell_topics(self.bootstrap, [journal], [])
        return {"system": "share-tool", "size": cell.size, "consumers": cell.consumers,
                "records": records,
                "acked_per_second": round(statistics.median(overall)),
                "repetitions": [round(r) for r in overall],
                "drain_per_second": round(statistics.median(drain)) if drain else None}


_TOOL_TIME = "%Y-%m-%d %H:%M:%S:%f"


def parse_share_tool(stdout: str, records: int) -> tuple[float, float | None]:
    """(nMsg.sec, drain rate) from ShareConsumerPerformance's comma-separated output.

    The summary line is the last data line; with --show-detailed-stats each consumer also
    prints a line ending "for share consumer N" when it gets its first records.
    """
    from datetime import datetime

    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    header = next((i for i, line in enumerate(lines) if "nMsg.sec" in line), None)
    if header is None:
        raise RuntimeError(f"ShareConsumerPerformance printed no nMsg.sec:\n{stdout}")
    names = [n.strip() for n in lines[header].split(",")]
    firsts: list[float] = []
    summary: list[str] | None = None
    for line in lines[header + 1:]:
        values = [v.strip() for v in line.split(",")]
        if len(values) < len(names):
            continue
        if "for share consumer" in line:
            end = values[names.index("end.time")]
            firsts.append(datetime.strptime(end, _TOOL_TIME).timestamp())
        else:
            summary = values
    if summary is None:
        raise RuntimeError(f"ShareConsumerPerformance printed no summary:\n{stdout}")
    rate = float(summary[names.index("nMsg.sec")])
    end = datetime.strptime(summary[names.index("end.time")], _TOOL_TIME).timestamp()
    drain = None
    if firsts and end > min(firsts):
        drain = records / (end - min(firsts))
    return rate, drain


def ratios(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """qlayer's throughput over the relay's and the share consumer's, cell by cell."""
    by = {(c["system"], c["size"], c["consumers"]): c.get("acked_per_second") for c in cells}
    drains = {(c["size"], c["consumers"]): c.get("drain_per_second") for c in cells
              if c["system"] == "share-tool"}
    out = []
    for (system, size, consumers), rate in sorted(by.items()):
        if not system.startswith("qlayer") or not rate:
            continue
        row: dict[str, Any] = {"system": system, "size": size, "consumers": consumers}
        for anchor in ("relay", "share-ck"):
            base = by.get((anchor, size, consumers))
            row[f"vs_{anchor}"] = round(rate / base, 3) if base else None
        # The tool's own figure is mostly its share-group join; its drain rate is comparable.
        tool = drains.get((size, consumers))
        row["vs_share-tool-drain"] = round(rate / tool, 3) if tool else None
        out.append(row)
    return out


SYSTEMS = ("relay", "share-ck", "share-tool", "qlayer-alo", "qlayer-amo", "qlayer-alo-python")
LATENCY_SYSTEMS = ("relay", "share-ck", "qlayer-alo", "qlayer-amo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", default=bool(os.environ.get("BENCH_FULL")))
    parser.add_argument("--bootstrap-servers")
    parser.add_argument("--database-url", help="a server URL where CREATE DATABASE is allowed")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--messages", type=int, help="override the plan's message count")
    parser.add_argument("--repetitions", type=int, help="override the plan's repetitions")
    parser.add_argument("--sizes", help="override the payload sizes, e.g. 1024")
    parser.add_argument("--consumer-counts", help="override the consumer counts, e.g. 1,4")
    parser.add_argument("--no-latency", action="store_true", help="skip the latency cells")
    parser.add_argument("--only-latency", action="store_true",
                        help="run the latency cells only (no throughput cells)")
    parser.add_argument("--max-backlog", type=int,
                        help="messages in flight per journal partition (default 2000, a "
                             "share-partition's allowance); each of N qlayer consumers gets "
                             "this × 4 / N as its max_backlog")
    args = parser.parse_args()
    plan = FULL if args.full else QUICK
    if args.messages or args.repetitions:
        plan = dataclasses.replace(plan, messages=args.messages or plan.messages,
                                   warmup=min(plan.warmup, args.messages or plan.warmup),
                                   repetitions=args.repetitions or plan.repetitions)
    if args.sizes:
        plan = dataclasses.replace(plan, sizes=tuple(int(v) for v in args.sizes.split(",")))
    if args.consumer_counts:
        plan = dataclasses.replace(plan, consumer_counts=tuple(
            int(v) for v in args.consumer_counts.split(",")))
    if args.max_backlog:
        plan = dataclasses.replace(plan, max_backlog=args.max_backlog)
    systems = [s for s in args.systems.split(",") if s]
    settings = Settings.load(bootstrap_servers=args.bootstrap_servers,
                             database_url=args.database_url)
    harness = Harness(settings, plan)
    started = time.time()
    cells: list[dict[str, Any]] = []
    for size in [] if args.only_latency else plan.sizes:
        for consumers in plan.consumer_counts:
            for system in systems:
                result = harness.run(Cell(system, size, consumers))
                print(json.dumps(result), flush=True)
                cells.append(result)
    latency: list[dict[str, Any]] = []
    for system in [] if args.no_latency else systems:
        if system in LATENCY_SYSTEMS:
            result = harness.run(Cell(system, plan.latency_size, plan.latency_consumers,
                                      plan.latency_rate))
            print(json.dumps(result), flush=True)
            latency.append(result)
    report = {"command": "make bench" + (" (BENCH_FULL=1)" if args.full else ""),
              "argv": sys.argv, "mode": "full" if args.full else "quick",
              "plan": plan.__dict__, "machine": machine(),
              "broker_log_dir_found": harness.log_dir is not None,
              "seconds": round(time.time() - started), "throughput": cells,
              "ratios": ratios(cells), "latency": latency}
    args.output.parent.mkdir(exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
