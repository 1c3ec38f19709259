"""Coordinator v2 figures: acked msg/s with 1 and 2 coordinator processes, failover time, and
the coordinator's CPU µs per message before and after the split, in one run.

    .venv/bin/python benchmarks/shards_bench.py [--messages 40000] [--size 1024]
        [--failovers 5] [--queued 100000] [--before-tree /path/to/an/older/checkout ...]

Runs against the local stack (`qlayer dev up`), in scratch databases under fresh topic
prefixes. Coordinators are real `qlayer coordinator run` processes (their CPU time is read
from /proc); consumers are SDK processes (one per queue, acking every message).

- throughput: 4 queues, one per consumer, on shards spread over the processes; N messages of
  the given size produced as fast as possible (N/4 per queue); the figure is N / (first produce
  -> every queue's recovery points at its journal's end). CPU µs/msg: the coordinator
  processes' user+system CPU over that window, divided by N.
- before/after: with --before-tree (repeatable), the 1-process cell is also run with the
  coordinator (and its migrations) of that checkout, e.g. a `git worktree` of the commit before
  the split. The
  consumers are this tree's SDK in both cells (a protocol-2 consumer works against a protocol-1
  coordinator).
- failover: 2 processes, one queue with `--queued` messages and a consumer holding 100 leases;
  SIGKILL the process running the queue's shard and time until the consumer sees its first
  delivery from the new owner (the resent deliveries of its restored leases count). Median of
  `--failovers` rounds; each round starts a replacement process first.

Results: benchmarks/results/shards.json, with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from common import create_topic, machine
from confluent_kafka import Producer
from sqlalchemy.engine import make_url

HERE = Path(__file__).resolve().parent.parent
RESULTS = HERE / "benchmarks" / "results" / "shards.json"
QUEUES = 4


# --- processes -------------------------------------------------------------------------------

class Installation:
    """A scratch database and topic prefix, with coordinator processes from a source tree."""

    def __init__(self, bootstrap: str, admin_url: str, tree: Path, log_dir: Path) -> None:
        self.bootstrap = bootstrap
        self.tree = tree
        self.log_dir = log_dir
        u = make_url(admin_url)
        name = f"shards_{uuid.uuid4().hex[:8]}"
        self._pg = {"host": u.host, "port": u.port, "user": u.username, "password": u.password}
        with psycopg.connect(dbname="postgres", autocommit=True, **self._pg) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
        self.dbname = name
        self.url = u.set(database=name).render_as_string(hide_password=False)
        self.prefix = f"qb{uuid.uuid4().hex[:6]}."
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._cli("db", "upgrade")

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.tree),
                "QLAYER_BOOTSTRAP_SERVERS": self.bootstrap, "QLAYER_DATABASE_URL": self.url,
                "QLAYER_TOPIC_PREFIX": self.prefix}

    def _cli(self, *args: str) -> None:
        subprocess.run([sys.executable, "-m", "layer_cli.main", *args], cwd=self.tree,
                       env=self.env(), check=True, capture_output=True)

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(dbname=self.dbname, autocommit=True, **self._pg) as conn:
            return list(conn.execute(query, params))  # type: ignore[call-overload]

    def start(self, name: str) -> int:
        log = (self.log_dir / f"{self.prefix}{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "layer_cli.main", "coordinator", "run", "--owner-id", name,
             *(["--group-session-timeout", "6"] if self.sharded else [])],
            cwd=self.tree, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        return self.procs[name].pid

    @property
    def sharded(self) -> bool:
        return (self.tree / "layer" / "coordinator" / "process.py").exists()

    def owners(self) -> dict[str, str]:
        return dict(self.sql("SELECT shard, owner_id FROM ownership WHERE owner_id IS NOT NULL"))

    def wait_running(self, processes: int, timeout: float = 120) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            owners = self.owners()
            live = {n for n, p in self.procs.items() if p.poll() is None}
            if self.sharded:
                if len(owners) == 16 and set(owners.values()) == live and len(live) == processes:
                    return owners
            elif owners:
                return owners
            time.sleep(0.2)
        raise TimeoutError(f"{processes} coordinator processes not running within {timeout}s")

    def queue(self, name: str, journal: str, shard: str | None, backlog: int) -> None:
        extra = ["--set", f"shard={shard}"] if shard is not None and self.sharded else []
        self._cli("queue", "create", name, "--underlying-topic", journal, "--lease-period",
                  "60s", "--max-backlog", str(backlog), *extra)

    def wait_acked(self, queue: str, total: int, timeout: float = 600) -> None:
        """Until the queue's recovery points add up to ``total`` (every record acked)."""
        deadline = time.monotonic() + timeout
        while self.acked(queue) < total:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{total - self.acked(queue)} not acked within {timeout:g}s")
            time.sleep(0.05)

    def acked(self, queue: str) -> int:
        rows = self.sql('SELECT coalesce(sum("offset"), 0) FROM recovery_points WHERE queue = %s',
                        queue)
        return int(rows[0][0])

    def cpu(self) -> float:
        return sum(process_cpu(p.pid) for p in self.procs.values() if p.poll() is None)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs.pop(name).wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def consume(bootstrap: str, prefix: str, queue: str, ack: bool, counter: Any,
            stop: Any) -> None:
    """A consumer process: with ``ack``, acks everything; without, holds its leases and counts
    every delivery it sees, repeats of a lease included."""
    from layer import QueueConsumer

    deadline = time.monotonic() + 120
    while True:
        try:
            consumer = QueueConsumer(queue, bootstrap, topic_prefix=prefix, max_backlog=100 if
                                     not ack else 500, ack_batch_size=500, ack_interval=0.005,
                                     subscribe_timeout=20)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    while not stop.is_set():
        message = consumer.receive(timeout=0.05)
        if message is not None and ack:
            message.ack()
        stats = consumer.stats
        with counter.get_lock():
            counter.value = stats.delivered + stats.repeated
    consumer.close()


# --- cells ------------------------------------------------------------------------------------

def throughput(args: argparse.Namespace, tree: Path, processes: int) -> dict[str, Any]:
    inst = Installation(args.bootstrap_servers, args.database_url, tree, args.log_dir)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    consumers: list[Any] = []
    try:
        for i in range(processes):
            inst.start(f"c{i}")
        owners = inst.wait_running(processes)
        by_owner: dict[str, list[str]] = {}
        for shard, owner in sorted(owners.items(), key=lambda kv: int(kv[0]) if
                                   kv[0].isdigit() else 0):
            by_owner.setdefault(owner, []).append(shard)
        names = sorted(by_owner)
        journals = {}
        for i in range(QUEUES):
            owner = names[i % len(names)]
            shard = by_owner[owner][i // len(names)] if inst.sharded else None
            queue, journal = f"Q{i}", f"bench-{inst.prefix.rstrip('.')}-{i}"
            create_topic(args.bootstrap_servers, journal, 3)
            inst.queue(queue, journal, shard, 1000)
            journals[queue] = journal
        counters = []
        for queue in journals:
            counter = ctx.Value("q", 0)
            p = ctx.Process(target=consume, args=(args.bootstrap_servers, inst.prefix, queue,
                                                  True, counter, stop))
            p.start()
            consumers.append(p)
            counters.append(counter)
        producer = Producer({"bootstrap.servers": args.bootstrap_servers, "linger.ms": 5})
        padding = os.urandom(args.size)

        def produce(per_queue: int) -> None:
            for journal in journals.values():
                for i in range(per_queue):
                    producer.produce(journal, padding, key=str(i).encode())
                    if i % 1000 == 0:
                        producer.poll(0)
            producer.flush(60)

        def wait_acked(total: int) -> None:
            deadline = time.monotonic() + 600
            while sum(inst.acked(q) for q in journals) < total:
                if time.monotonic() > deadline:
                    raise TimeoutError("messages not acked within 600s")
                time.sleep(0.05)

        warm = 1000
        produce(warm)  # every consumer subscribed, every shard warm
        wait_acked(QUEUES * warm)
        per_queue = args.messages // QUEUES
        cpu_before = inst.cpu()
        started = time.time()
        produce(per_queue)
        wait_acked(QUEUES * (warm + per_queue))
        seconds = time.time() - started
        cpu = inst.cpu() - cpu_before
        n = QUEUES * per_queue
        return {"processes": processes, "tree": str(tree), "sharded": inst.sharded,
                "messages": n, "size": args.size, "consumers": QUEUES,
                "seconds": round(seconds, 3), "acked_per_second": round(n / seconds),
                "coordinator_cpu_us_per_message": round(cpu / n * 1e6, 1)}
    finally:
        stop.set()
        for p in consumers:
            p.join(30)
        inst.stop()


def failover(args: argparse.Namespace) -> dict[str, Any]:
    inst = Installation(args.bootstrap_servers, args.database_url, HERE, args.log_dir)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    counter = ctx.Value("q", 0)
    consumer = None
    times: list[float] = []
    try:
        inst.start("f0")
        inst.start("f1")
        inst.wait_running(2)
        journal = f"bench-{inst.prefix.rstrip('.')}-failover"
        create_topic(args.bootstrap_servers, journal, 3)
        inst.queue("Queued", journal, None, 100)
        producer = Producer({"bootstrap.servers": args.bootstrap_servers, "linger.ms": 5})
        padding = os.urandom(args.size)
        for i in range(args.queued):
            producer.produce(journal, padding, key=str(i).encode())
            if i % 1000 == 0:
                producer.poll(0)
        producer.flush(60)
        consumer = ctx.Process(target=consume, args=(args.bootstrap_servers, inst.prefix,
                                                     "Queued", False, counter, stop))
        consumer.start()
        deadline = time.monotonic() + 120
        while counter.value < 100 and time.monotonic() < deadline:
            time.sleep(0.1)
        shard = str(inst.sql("SELECT shard FROM queues WHERE name = 'Queued'")[0][0])
        for round_ in range(args.failovers):
            victim = inst.owners()[shard]
            seen = counter.value
            killed = time.monotonic()
            inst.kill(victim)
            while counter.value == seen:
                if time.monotonic() - killed > 120:
                    raise TimeoutError("no delivery within 120s of the kill")
                time.sleep(0.005)
            times.append(time.monotonic() - killed)
            inst.start(f"f{round_ + 2}")
            inst.wait_running(2)
        return {"processes": 2, "queued": args.queued, "rounds": len(times),
                "group_session_timeout_s": 6.0,
                "seconds": [round(t, 2) for t in times],
                "median_seconds": round(statistics.median(times), 2)}
    finally:
        stop.set()
        if consumer is not None:
            consumer.join(30)
        inst.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--failovers", type=int, default=5)
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--before-tree", type=Path, action="append", default=[],
                        help="an older checkout whose coordinator runs the 1-process cell "
                        "too (repeatable)")
    parser.add_argument("--bootstrap-servers", default=os.environ.get(
        "QLAYER_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--database-url", default=os.environ.get(
        "QLAYER_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    cells = []
    for tree in args.before_tree:
        cells.append(throughput(args, tree.resolve(), 1))
        print(json.dumps(cells[-1]), flush=True)
    for processes in (1, 2):
        cells.append(throughput(args, HERE, processes))
        print(json.dumps(cells[-1]), flush=True)
    down = failover(args)
    print(json.dumps(down), flush=True)
    result = {"command": " ".join(sys.argv), "machine": machine(), "throughput": cells,
              "failover": down}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
