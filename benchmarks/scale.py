"""The coordinator at scale (issue 7): memory per queued message with 1,000,000 queued, and
restart-to-first-delivery with 1,000,000 queued and 10,000 leased.

    make bench-scale                                   # the issue's 1,000,000 / 10,000
    .venv/bin/python benchmarks/scale.py --messages 20000 --leased 1000    # a smoke run
    .venv/bin/python benchmarks/scale.py [--bootstrap-servers ...] [--database-url ...]

One journal (8 partitions) gets N distinct 200-byte JSON records from one confluent-kafka
producer before any coordinator runs. Then:

1. Memory. For each payload budget (0, so no payload is held in memory, then the default,
   which holds all of them at these sizes): a coordinator in its own process (defaults of
   `qlayer coordinator run` but the budget) on a fresh database and topic prefix, no queue yet.
   Its RSS is read once it owns the shard and idles; then one queue on the journal
   (recovery point `beginning`, no consumers) is created and the coordinator admits all N
   records. Bytes per queued message = (VmRSS after - VmRSS before) / N, once the queue's
   `enqueued` counter in PostgreSQL is N. The admission rate (records read per second, from
   the first to the last, as the coordinator counts them) comes with it.
2. Restart. On the default-budget coordinator: consumers in another process (QueueConsumer,
   never acking) take L leases (lease period 30 min); a prober consumer holds a full backlog
   (10) it has received. The coordinator is SIGKILLed, the prober acks its backlog meanwhile,
   a new process starts; the figure is the time from just before the new process is spawned
   to the first message a consumer receives that the new coordinator delivered (the delivery
   time is the lease deadline minus the lease period, both from the coordinator's clock).
   Milestones of the new process (imported, shard owned, first iteration, first ack read,
   first delivery produced, journal replayed) are timed on the same clock. Several
   kills in a row give a median. Correctness: no entry delivered under a second lease while
   its first lease was held, and the L leases are still recorded in PostgreSQL at the end.
   With ``--instance-id NAME`` every coordinator runs under that instance id (Kafka static
   membership), so the new process is given the shards without waiting for Kafka to notice
   the killed one (its group session timeout); without, that wait is part of the figure.

Results: benchmarks/results/scale.json; `benchmarks/report.py` renders them into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import peak_rss_mb, process_cpu, wait_for
from common import create_topic, delete_topics, machine, scratch_database
from confluent_kafka import Producer

from layer.settings import Settings

RESULTS = Path(__file__).parent / "results" / "scale.json"
CTX = mp.get_context("spawn")
SEED = 7
PARTITIONS = 8
PAYLOAD_BYTES = 200
QUEUE = "Scale"
LEASE_PERIOD = 1800.0  # seconds: no lease of the run may expire, or redeliveries would be due
MiB = 1024 * 1024


# --- the coordinator in its own process --------------------------------------------------------

def coordinator_process(settings: dict[str, str], budget: int | None, target: int,
                        spawned_at: float, conn: Any, instance_id: str | None = None) -> None:
    """A coordinator with `qlayer coordinator run`'s defaults (but the payload budget), and a
    watcher timing its milestones; answers ("status",), ("target", n) and ("stop",)."""
    marks: dict[str, float] = {"spawned": spawned_at}
    from layer.coordinator.options import CoordinatorOptions
    from layer.coordinator.process import CoordinatorProcess as Coordinator

    marks["imported"] = time.time()
    options = CoordinatorOptions(instance_id=instance_id)
    if budget is not None:
        options = CoordinatorOptions(instance_id=instance_id, payload_budget=budget)
    coordinator = Coordinator(Settings(**settings), options)
    marks["constructed"] = time.time()
    thread = threading.Thread(target=coordinator.run, kwargs={"install_signals": False},
                              daemon=True)
    thread.start()

    def counters() -> dict[str, int]:
        for _ in range(10):  # the loop thread may add a key while we copy
            with contextlib.suppress(RuntimeError):
                return dict(coordinator.counters)
        return {}

    while True:
        now = time.time()
        c = coordinator.counters
        if "owner" not in marks and coordinator.is_owner:
            marks["owner"] = now
        for mark, reached in (("first_iteration", c["iterations"] >= 1),
                              ("first_record", c["journal_records"] >= 1),
                              ("first_ack", c["ack_items"] >= 1),
                              ("first_delivery", c["deliveries"] >= 1),
                              ("all_records", target > 0 and c["journal_records"] >= target)):
            if reached and mark not in marks:
                marks[mark] = now
                # How far the journal replay had come (an ack or a delivery waiting on it).
                marks[f"records_at_{mark}"] = c["journal_records"]
        if not conn.poll(0.005):
            continue
        command = conn.recv()
        if command[0] == "target":
            target = int(command[1])
            conn.send(None)
        elif command[0] == "status":
            conn.send({"marks": dict(marks), "counters": counters(),
                       "alive": thread.is_alive()})
        else:
            coordinator.stop()
            thread.join(60)
            conn.send({"marks": dict(marks), "counters": counters(), "alive": thread.is_alive()})
            return


@dataclass(frozen=True)
class Shared:
    """What the benchmark and the consumers' process share."""

    received: Any  # receipts so far
    kill_ms: Any  # when the last coordinator was killed (0: no restart under way)
    first_after: Any  # when a consumer first received what a restarted coordinator delivered
    prober_acking: Any  # the prober acks while set, holds what it gets otherwise
    prober_held: Any  # messages the prober holds unacked


class CoordinatorProcess:
    def __init__(self, settings: dict[str, str], budget: int | None, target: int = 0,
                 instance_id: str | None = None) -> None:
        self.pipe, child = CTX.Pipe()
        self.spawned_at = time.time()
        # Daemonic: should the benchmark fail, no coordinator outlives it.
        self.process = CTX.Process(target=coordinator_process, daemon=True,
                                   args=(settings, budget, target, self.spawned_at, child,
                                         instance_id))
        self.process.start()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def ask(self, *command: Any) -> Any:
        self.pipe.send(command)
        if not self.pipe.poll(120):
            raise RuntimeError(f"the coordinator process did not answer {command[0]!r}")
        return self.pipe.recv()

    def status(self) -> dict[str, Any]:
        return self.ask("status")  # type: ignore[no-any-return]

    def mark(self, name: str) -> float | None:
        return self.status()["marks"].get(name)  # type: ignore[no-any-return]

    def stop(self) -> dict[str, Any]:
        result = self.ask("stop")
        self.process.join(60)
        return result  # type: ignore[no-any-return]

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(30)


def code_state() -> dict[str, Any]:
    """Which code was measured: the tree is shared with engineers changing the coordinator."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=30)
        except OSError:
            return ""
        return done.stdout.rstrip("\n")  # porcelain lines start with a space: keep it

    return {"commit": git("rev-parse", "--short", "HEAD").strip(),
            "uncommitted_in_layer": [line[3:] for line in
                                     git("status", "--porcelain", "--", "layer").splitlines()]}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --- consumers in their own process ------------------------------------------------------------

def consumers_process(bootstrap: str, prefix: str, holders: int, backlog: int,
                      prober_backlog: int, session_timeout: float, received: Any,
                      kill_ms: Any, first_after: Any, prober_on: Any, prober_acking: Any,
                      prober_held: Any, stop: Any, out: Any) -> None:
    """`holders` consumers that never ack (they hold `backlog` leases each) and, once
    `prober_on` is set, a prober that acks what it gets while `prober_acking` is set and
    holds it (`prober_held` says how many) otherwise.

    Every receipt is kept: (consumer, bookmark, lease, delivered at ms, delivery count,
    received at, acked). The first receipt delivered after `kill_ms` sets `first_after`."""
    from layer import QueueConsumer
    from layer.domain.errors import QlayerError

    lock = threading.Lock()
    receipts: list[tuple[str, str, str, float, int, float, bool]] = []
    errors: list[str] = []

    def record(consumer_id: str, msg: Any, acked: bool) -> None:
        now = time.time()
        delivered_ms = msg.lease_expires_at.timestamp() * 1000 - LEASE_PERIOD * 1000
        with lock:
            receipts.append((consumer_id, str(msg.bookmark), msg.lease, delivered_ms,
                             msg.delivery_count, now, acked))
        with received.get_lock():
            received.value += 1
        killed = kill_ms.value
        if killed > 0 and delivered_ms >= killed:
            with first_after.get_lock():
                if first_after.value == 0:
                    first_after.value = now

    def run(consumer_id: str, max_backlog: int, prober: bool) -> None:
        try:
            consumer = QueueConsumer(QUEUE, bootstrap, topic_prefix=prefix,
                                     consumer_id=consumer_id, max_backlog=max_backlog,
                                     session_timeout=session_timeout, subscribe_timeout=120,
                                     ack_interval=0.005)
        except QlayerError as exc:
            errors.append(f"{consumer_id}: {exc}")
            return
        held: list[Any] = []
        while not stop.is_set():
            try:
                msg = consumer.receive(timeout=0.25)
            except QlayerError as exc:
                errors.append(f"{consumer_id}: {exc}")
                continue
            acking = prober and prober_acking.is_set()
            if msg is not None:
                record(consumer_id, msg, acking)
                if prober:
                    held.append(msg)
                    prober_held.value = len(held)
            if acking and held:
                for m in held:
                    m.ack()
                held.clear()
                prober_held.value = 0
        with contextlib.suppress(Exception):
            consumer.close(timeout=5)

    threads = [threading.Thread(target=run, args=(f"holder-{i}", backlog, False), daemon=True)
               for i in range(holders)]
    for t in threads:
        t.start()
    prober_on.wait()
    if not stop.is_set():
        prober = threading.Thread(target=run, args=("prober", prober_backlog, True), daemon=True)
        prober.start()
        threads.append(prober)
    stop.wait()
    for t in threads:
        t.join(15)
    with lock:
        out.put((list(receipts), errors))


# --- the journal --------------------------------------------------------------------------------

def produce_journal(bootstrap: str, topic: str, count: int) -> dict[str, Any]:
    """`count` distinct JSON records of exactly PAYLOAD_BYTES bytes, keys cycling over 1,000."""
    rng = random.Random(SEED)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50,
                         "batch.size": 1_000_000, "compression.type": "lz4",
                         "queue.buffering.max.messages": 1_000_000,
                         "queue.buffering.max.kbytes": 1_048_576})
    template = '{"id":"m%09d","customer":"c-%04d","amount":%06d,"region":"eu-west","note":"%s"}'
    pad = PAYLOAD_BYTES - len(template % (0, 0, 0, ""))
    notes = [rng.randbytes(pad // 2 + 1).hex()[:pad] for _ in range(1000)]
    keys = [b"c-%04d" % i for i in range(1000)]
    started = time.time()
    for i in range(count):
        n = i % 1000
        value = (template % (i, n, rng.randrange(1_000_000), notes[(i * 7) % 1000])).encode()
        while True:
            try:
                producer.produce(topic, value, key=keys[n])
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10_000 == 0:
            producer.poll(0)
    if producer.flush(300) != 0:
        raise RuntimeError("the journal producer did not flush in 300 s")
    seconds = time.time() - started
    return {"records": count, "payload_bytes": PAYLOAD_BYTES, "key_bytes": 6,
            "seconds": round(seconds, 1), "per_second": round(count / seconds)}


# --- the run ------------------------------------------------------------------------------------

class Scale:
    def __init__(self, settings: Settings, args: argparse.Namespace) -> None:
        self.settings = settings
        self.args = args
        self.bootstrap = settings.bootstrap_servers
        self.run_id = uuid.uuid4().hex[:6]
        self.journal = f"scale-{self.run_id}-journal"
        self.prefixes: list[str] = []
        self.databases: list[str] = []

    def fresh(self) -> tuple[dict[str, str], str]:
        prefix = f"scale{self.run_id}x{len(self.prefixes)}."
        self.prefixes.append(prefix)
        database = scratch_database(self.settings.database_url)
        self.databases.append(database)
        return {"bootstrap_servers": self.bootstrap, "database_url": database,
                "topic_prefix": prefix}, database

    def queue_definition(self) -> dict[str, Any]:
        return {"name": QUEUE, "underlying_topic": self.journal, "semantics": "at-least-once",
                "recovery_point": "beginning", "lease_period": f"{int(LEASE_PERIOD)}s",
                "max_per_subscription_backlog": max(self.args.leased, 10)}

    def memory(self, budget: int | None, keep: bool
               ) -> tuple[dict[str, Any], CoordinatorProcess | None, dict[str, str]]:
        """Admit the whole journal into one queue of a fresh coordinator; RSS before/after."""
        from layer.coordinator.payloads import DEFAULT_PAYLOAD_BUDGET
        from layer.store.store import Store

        n = self.args.messages
        settings, database = self.fresh()
        coordinator = CoordinatorProcess(settings, budget, instance_id=self.args.instance_id)
        if not wait_for(lambda: coordinator.mark("first_iteration") is not None, 120):
            raise RuntimeError("the coordinator did not start")
        time.sleep(3.0)  # idle: clients connected, first refreshes done
        before = rss_mb(coordinator.pid)
        cpu_before = process_cpu(coordinator.pid)
        store = Store(database)
        coordinator.ask("target", n)
        store.put_queue(QUEUE, self.queue_definition(), time.time())

        def enqueued() -> int:
            counts = store.load_counters(QUEUE).get(QUEUE)
            return counts.enqueued if counts is not None else 0

        if not wait_for(lambda: enqueued() >= n, self.args.timeout):
            raise RuntimeError(f"only {enqueued():,} of {n:,} records were admitted in "
                               f"{self.args.timeout:.0f} s")
        cpu = process_cpu(coordinator.pid) - cpu_before
        time.sleep(2.0)  # the loop is idle again; transient batches are gone
        after = rss_mb(coordinator.pid)
        status = coordinator.status()
        marks, counters = status["marks"], status["counters"]
        span = marks["all_records"] - marks["first_record"]
        effective = DEFAULT_PAYLOAD_BUDGET if budget is None else budget
        result = {
            "payload_budget_bytes": effective,
            "payload_budget": "default" if budget is None else f"{budget} bytes",
            "payloads_in_memory": effective >= n * (PAYLOAD_BYTES + 6),
            "documents_projected": counters.get("documents_projected", 0),
            "queued": enqueued(),
            "rss_before_mib": round(before, 1),
            "rss_after_mib": round(after, 1),
            "peak_rss_mib": round(peak_rss_mb(coordinator.pid), 1),
            "bytes_per_message": round((after - before) * MiB / n),
            "admitted_per_second": round(n / span) if span > 0 else None,
            "admission_seconds": round(span, 1),
            "cpu_us_per_message": round(1e6 * cpu / n, 1),
        }
        store.close()
        print(json.dumps({"memory": result}), flush=True)
        if keep:
            return result, coordinator, settings
        coordinator.stop()
        return result, None, settings

    def restart(self, coordinator: CoordinatorProcess, settings: dict[str, str]
                ) -> dict[str, Any]:
        from layer.store.store import Store

        args = self.args
        store = Store(settings["database_url"])
        holders = max(1, min(args.holders, args.leased))
        backlog = -(-args.leased // holders)
        received = CTX.Value("q", 0)
        kill_ms = CTX.Value("d", 0.0)
        first_after = CTX.Value("d", 0.0)
        prober_held = CTX.Value("q", 0)
        prober_on, prober_acking, stop = CTX.Event(), CTX.Event(), CTX.Event()
        out = CTX.Queue()
        consumers = CTX.Process(target=consumers_process, daemon=True, args=(
            self.bootstrap, settings["topic_prefix"], holders, backlog, args.prober_backlog,
            args.session_timeout, received, kill_ms, first_after, prober_on, prober_acking,
            prober_held, stop, out))

        def leased(consumer: str | None = None) -> int:
            return sum(1 for row in store.load_entries(QUEUE) if row.state == "LEASED"
                       and consumer in (None, row.lease_consumer))

        started = time.time()
        consumers.start()
        target = holders * backlog
        if not wait_for(lambda: received.value >= target and leased() >= target,
                        args.timeout):
            raise RuntimeError(f"{received.value:,} deliveries received, {leased():,} leases "
                               f"recorded; wanted {target:,}")
        lease_seconds = time.time() - started
        prober_on.set()
        shared = Shared(received, kill_ms, first_after, prober_acking, prober_held)
        rounds: list[dict[str, Any]] = []
        for r in range(args.restarts):
            coordinator, result = self.restart_round(coordinator, settings, store, shared,
                                                     leased)
            print(json.dumps({"restart": r + 1, **result}), flush=True)
            rounds.append(result)
        prober_acking.clear()
        stop.set()
        prober_on.set()
        receipts, errors = out.get(timeout=120)
        consumers.join(60)
        final = coordinator.stop()
        counts = store.load_counters(QUEUE)[QUEUE]
        store.close()
        return {"holders": holders, "backlog_per_holder": backlog,
                "prober_backlog": args.prober_backlog, "leases_taken_s": round(lease_seconds, 1),
                "rounds": rounds, "medians": medians(rounds),
                "correctness": check(receipts, errors),
                # Running totals as `qlayer stats` shows them after the restarts.
                "queue_counters_at_end": {"enqueued": counts.enqueued,
                                          "delivered": counts.delivered,
                                          "redelivered": counts.redelivered,
                                          "acked": counts.acked},
                "last_coordinator_counters": {k: v for k, v in final["counters"].items()
                                              if v}}

    def restart_round(self, coordinator: CoordinatorProcess, settings: dict[str, str],
                      store: Any, shared: Shared, leased: Callable[[str | None], int]
                      ) -> tuple[CoordinatorProcess, dict[str, Any]]:
        """SIGKILL the coordinator, start another, time it to the first delivery received.

        The kill comes when the prober holds a full backlog it has received, and it acks
        that backlog while the coordinator is down: its next message needs the restarted
        coordinator to read an ack, free a slot and deliver. (Killed while deliveries are in
        flight, a consumer may instead hold leases whose deliveries were never produced, and
        get nothing until they expire; that is the documented crash window, not timed here.)
        """
        args = self.args
        want = args.prober_backlog
        if not wait_for(lambda: shared.prober_held.value >= want and leased("prober") >= want,
                        120):
            raise RuntimeError(f"the prober holds {shared.prober_held.value} of {want} leases")
        time.sleep(0.5)
        counts = store.load_counters(QUEUE)[QUEUE]
        points = store.load_recovery_points(QUEUE)
        replay = args.messages - sum(points.values())
        at_kill = {"leased": leased(None), "acked": counts.acked,
                   "queued": args.messages - counts.acked, "replay_records": replay,
                   "coordinator_rss_mib": round(rss_mb(coordinator.pid), 1)}
        shared.kill_ms.value = 0.0
        shared.first_after.value = 0.0
        coordinator.kill()
        killed = time.time()
        shared.kill_ms.value = killed * 1000
        new = CoordinatorProcess(settings, None, target=replay,
                                 instance_id=self.args.instance_id)
        shared.prober_acking.set()
        if not wait_for(lambda: shared.first_after.value > 0, args.timeout):
            raise RuntimeError(f"no delivery {args.timeout:.0f} s after the restart")
        received_first = shared.first_after.value
        # Once the prober has its first message it holds what it gets, so the queue stays
        # near N while the new coordinator replays the journal.
        shared.prober_acking.clear()
        replayed = wait_for(lambda: new.mark("all_records") is not None, args.timeout)
        marks = new.status()["marks"]

        def since(mark: str) -> float | None:
            return round(marks[mark] - new.spawned_at, 3) if mark in marks else None

        return new, {
            "at_kill": at_kill,
            "spawn_to_imported_s": since("imported"),
            "spawn_to_owner_s": since("owner"),
            "spawn_to_first_iteration_s": since("first_iteration"),
            "spawn_to_first_ack_read_s": since("first_ack"),
            "records_replayed_at_first_ack": marks.get("records_at_first_ack"),
            "spawn_to_first_delivery_produced_s": since("first_delivery"),
            "records_replayed_at_first_delivery": marks.get("records_at_first_delivery"),
            "spawn_to_first_delivery_received_s": round(received_first - new.spawned_at, 3),
            "kill_to_first_delivery_received_s": round(received_first - killed, 3),
            "spawn_to_replayed_s": since("all_records") if replayed else None,
            "replay_per_second": (round(replay / (marks["all_records"] - marks["owner"]))
                                  if replayed and replay > 0 else None),
            "rss_after_replay_mib": round(rss_mb(new.pid), 1),
            "leased_after": leased(None),
        }

    def cleanup(self) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        names = [t for t in admin.list_topics(timeout=30).topics
                 if t == self.journal or any(t.startswith(p) for p in self.prefixes)]
        delete_topics(self.bootstrap, names)
        for url in self.databases:
            with contextlib.suppress(Exception):
                drop_database(self.settings.database_url, url)


def drop_database(admin_url: str, url: str) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    admin, name = make_url(admin_url), make_url(url).database
    with psycopg.connect(host=admin.host, port=admin.port, user=admin.username,
                         password=admin.password, dbname="postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def medians(rounds: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in rounds[0] if rounds else []:
        values = [r[name] for r in rounds if isinstance(r.get(name), int | float)]
        if values and name != "at_kill":
            out[name] = round(statistics.median(values), 3)
    return out


def check(receipts: list[tuple[str, str, str, float, int, float, bool]],
          errors: list[str]) -> dict[str, Any]:
    """Redeliveries while the first lease was held (a bug; leases last 30 min here)."""
    by_bookmark: dict[str, list[tuple[str, str, float, bool]]] = {}
    for consumer, bookmark, lease, delivered_ms, _, _, acked in receipts:
        by_bookmark.setdefault(bookmark, []).append((consumer, lease, delivered_ms, acked))
    while_held = after_ack = repeated = 0
    for deliveries in by_bookmark.values():
        leases: dict[str, tuple[float, bool]] = {}
        for _, lease, delivered_ms, acked in sorted(deliveries, key=lambda d: d[2]):
            if lease in leases:
                repeated += 1  # the same delivery read twice (not a redelivery)
                continue
            earlier = [a for d, a in leases.values() if delivered_ms < d + LEASE_PERIOD * 1000]
            if any(not a for a in earlier):
                while_held += 1
            elif earlier:
                after_ack += 1
            leases[lease] = (delivered_ms, acked)
    return {"receipts": len(receipts), "distinct_entries": len(by_bookmark),
            "redelivered_while_leased": while_held, "redelivered_after_ack": after_ack,
            "same_delivery_read_twice": repeated, "consumer_errors": errors[:20]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000, help="records queued")
    parser.add_argument("--leased", type=int, default=10_000, help="leases held at the kill")
    parser.add_argument("--holders", type=int, default=10,
                        help="consumers holding the leases (each holds leased/holders)")
    parser.add_argument("--prober-backlog", type=int, default=10)
    parser.add_argument("--restarts", type=int, default=3, help="kills in a row (median)")
    parser.add_argument("--budgets", default="0,default",
                        help="payload budgets of the memory runs, bytes or 'default'; the last "
                             "one's coordinator goes on to the restart runs")
    parser.add_argument("--session-timeout", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds any one wait may take")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--instance-id",
                        help="run every coordinator under this --instance-id (Kafka static "
                             "membership: the restarted one takes the shards back at once)")
    parser.add_argument("--keep", action="store_true", help="keep the topics and databases")
    parser.add_argument("--bootstrap-servers")
    parser.add_argument("--database-url", help="a server URL where CREATE DATABASE is allowed")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    settings = Settings.load(bootstrap_servers=args.bootstrap_servers,
                             database_url=args.database_url)
    budgets: list[int | None] = [None if b == "default" else int(b)
                                 for b in args.budgets.split(",") if b]
    scale = Scale(settings, args)
    started = time.time()
    report: dict[str, Any] = {
        "command": "make bench-scale", "argv": sys.argv, "machine": machine(),
        "code": code_state(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "parameters": {"messages": args.messages, "leased": args.leased,
                       "partitions": PARTITIONS, "payload_bytes": PAYLOAD_BYTES,
                       "lease_period_s": LEASE_PERIOD, "session_timeout_s": args.session_timeout,
                       "restarts": args.restarts, "budgets": args.budgets,
                       "instance_id": args.instance_id},
    }
    try:
        create_topic(scale.bootstrap, scale.journal, PARTITIONS)
        report["journal"] = produce_journal(scale.bootstrap, scale.journal, args.messages)
        print(json.dumps({"journal": report["journal"]}), flush=True)
        report["memory"] = []
        kept: tuple[CoordinatorProcess | None, dict[str, str]] = (None, {})
        for i, budget in enumerate(budgets):
            last = i == len(budgets) - 1 and not args.skip_restart
            result, coordinator, coordinator_settings = scale.memory(budget, keep=last)
            report["memory"].append(result)
            kept = (coordinator, coordinator_settings)
        if kept[0] is not None:
            report["restart"] = scale.restart(kept[0], kept[1])
        report["seconds"] = round(time.time() - started)
        args.output.parent.mkdir(exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"written to {args.output}")
    finally:
        if not args.keep:
            scale.cleanup()


if __name__ == "__main__":
    main()
