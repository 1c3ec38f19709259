"""Issue 36 finding 2: what a hostile subscription filter costs a coordinator, and whether its
memory comes back when the subscriber leaves.

    .venv/bin/python benchmarks/hostile_filter.py [--tree /path/to/a/checkout] [--label after]
        [--rounds 2] [--heavy-rounds 3] [--output benchmarks/results/hostile-filter.json]

    # the code before the limits, from a worktree of the commit before them:
    git worktree add /tmp/qlayer-before <commit>
    .venv/bin/python benchmarks/hostile_filter.py --tree /tmp/qlayer-before --label before

Runs against the test stack (broker 127.0.0.1:39092, PostgreSQL 127.0.0.1:35432; override
with --bootstrap-servers / --database-url or QLAYER_BOOTSTRAP_SERVERS / QLAYER_DATABASE_URL),
in a scratch database of the default 16 shards under a fresh topic prefix, both removed at the
end. The coordinator is one real `qlayer coordinator run` process of ``--tree`` (all 16 shards
share its one thread); this driver, its consumers and the producer use this tree's SDK.

- canary: queue ``Canary`` on shard 0, a record produced every 20 ms, an SDK consumer acking
  each; its *gap* is the longest time between two consecutive deliveries.
- hostile filters, each sent to queue ``Target`` on shard 1 as a raw Subscribe (what a hostile
  client sends; the SDK would check the filter itself first), timed from the send to the reply:
  ``A``: 4.6 KB, 200 ``LIKE '\\pL{140}'`` (the report's accepted filter); ``B``: 6.9 KB, 299 of
  them then ``\\pL{999}``, which RE2 refuses (the report's refused one). ``--rounds`` of each,
  every round a new text (a hostile client varies it, so no cache answers).
- baseline: a Subscribe whose filter is a syntax error, to show the round trip itself.
- heavy: a filter within the limits and as heavy as they let it be (16 LIKE patterns whose
  RE2 DFAs grow to their memory budget on the ``Target`` records), subscribed, evaluated, then
  unsubscribed, ``--heavy-rounds`` times: the coordinator's RSS after each unsubscribe.
- in-process: ``compile_expression`` of A and B timed in a fresh interpreter of ``--tree``.

The heavy rounds run before A and B, so memory A and B leave freed cannot hide the heavy
filter's growth. RSS is the coordinator's VmRSS from /proc. The gap of each attempt is the
longest canary gap between one second before the send and two seconds after the reply;
``quiet`` is the longest gap of six seconds with no hostile client. Results: benchmarks/results/
hostile-filter.json, one entry per ``--label``, with the machine, the command and the tree's
commit (its working tree may hold more). Measured on the shared 2-core development machine (AMD
EPYC, 24 GB, Python 3.11); the table is in docs/expressions.md, "Limits".
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from common import create_topic, delete_cell_topics, machine
from confluent_kafka import Consumer, Producer, TopicPartition
from sqlalchemy.engine import make_url

from layer import QueueConsumer
from layer.kafka.logs import logged
from layer.protocol import (
    Codec,
    Subscribe,
    SubscribeResult,
    TopicNames,
    Unsubscribe,
    is_reply,
    proof_headers,
    secret_headers,
)
from layer.protocol.headers import new_session_secret

HERE = Path(__file__).resolve().parent.parent
RESULTS = HERE / "benchmarks" / "results" / "hostile-filter.json"
CANARY_INTERVAL = 0.02


# --- the filters ------------------------------------------------------------------------------

def filter_a(round_: int) -> str:
    """4.6 KB: 200 LIKE patterns of 8 characters, each a program near RE2's old 8 MiB budget."""
    return f"/r = {round_} AND (" + " OR ".join(
        [f"/f{round_ % 10} LIKE '\\pL{{140}}'"] * 200) + ")"


def filter_b(round_: int) -> str:
    """6.9 KB: 299 such patterns, then one RE2 refuses (too large), so the filter is refused."""
    field = f"/g{round_ % 10}"
    return f"/r = {round_} AND (" + " OR ".join(
        [f"{field} LIKE '\\pL{{140}}'"] * 299 + [f"{field} LIKE '\\pL{{999}}'"]) + ")"


def filter_heavy(round_: int) -> str:
    """Within the limits and as heavy as they allow: 16 patterns (the most) whose DFAs have 2^20+
    states and never match the records' random a/b text, so every record is scanned whole and
    each DFA cache fills its memory budget (then RE2 runs its NFA)."""
    return " OR ".join(f"/h LIKE '{round_}x|a[ab]{{{20 + i}}}c'" for i in range(16))


def heavy_records(count: int) -> list[bytes]:
    rng = random.Random(7)
    return [json.dumps({"h": "".join(rng.choice("ab") for _ in range(1000)) + "z"}).encode()
            for _ in range(count)]


# --- the installation ---------------------------------------------------------------------------

class Installation:
    """A scratch database of 16 shards and a topic prefix, with one coordinator of ``tree``."""

    def __init__(self, bootstrap: str, admin_url: str, tree: Path, log_dir: Path) -> None:
        self.bootstrap, self.tree, self.log_dir = bootstrap, tree, log_dir
        u = make_url(admin_url)
        self.dbname = f"hostile_{uuid.uuid4().hex[:8]}"
        self._pg = {"host": u.host, "port": u.port, "user": u.username, "password": u.password}
        with psycopg.connect(dbname="postgres", autocommit=True, **self._pg) as conn:
            conn.execute(f'CREATE DATABASE "{self.dbname}"')  # type: ignore[arg-type]
        self.url = u.set(database=self.dbname).render_as_string(hide_password=False)
        self.prefix = f"qh{uuid.uuid4().hex[:6]}."
        self.proc: subprocess.Popen[bytes] | None = None
        self.cli("db", "upgrade")

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.tree),
                "QLAYER_BOOTSTRAP_SERVERS": self.bootstrap, "QLAYER_DATABASE_URL": self.url,
                "QLAYER_TOPIC_PREFIX": self.prefix}

    def cli(self, *args: str) -> None:
        subprocess.run([sys.executable, "-m", "layer_cli.main", *args], cwd=self.tree,
                       env=self.env(), check=True, capture_output=True)

    def sql(self, query: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(dbname=self.dbname, autocommit=True, **self._pg) as conn:
            return list(conn.execute(query))  # type: ignore[call-overload]

    def start(self) -> int:
        log = (self.log_dir / f"{self.prefix}coordinator.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "layer_cli.main", "coordinator", "run", "--owner-id", "hf",
             "--group-session-timeout", "6"],
            cwd=self.tree, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if len(self.sql("SELECT shard FROM ownership WHERE owner_id = 'hf'")) == 16:
                return self.proc.pid
            time.sleep(0.2)
        raise TimeoutError("the coordinator does not run the 16 shards after 120 s")

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        with psycopg.connect(dbname="postgres", autocommit=True, **self._pg) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')  # type: ignore[arg-type]


# --- the canary -----------------------------------------------------------------------------------

class Canary:
    """A producer writing a record every 20 ms and an SDK consumer acking each, in threads;
    ``times`` are the monotonic times of the deliveries."""

    def __init__(self, bootstrap: str, prefix: str, journal: str) -> None:
        self.bootstrap, self.prefix, self.journal = bootstrap, prefix, journal
        self.times: list[float] = []
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._produce, daemon=True),
                        threading.Thread(target=self._consume, daemon=True)]

    def __enter__(self) -> Canary:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _produce(self) -> None:
        producer = Producer(logged({"bootstrap.servers": self.bootstrap, "linger.ms": 0}))
        n = 0
        next_at = time.monotonic()
        while not self.stop.is_set():
            producer.produce(self.journal, json.dumps({"n": n}).encode())
            producer.poll(0)
            n += 1
            next_at += CANARY_INTERVAL
            time.sleep(max(0.0, next_at - time.monotonic()))
        producer.flush(10)

    def _consume(self) -> None:
        try:
            consumer = QueueConsumer("Canary", self.bootstrap, topic_prefix=self.prefix,
                                     max_backlog=50, subscribe_timeout=60, ack_interval=0.005)
            while not self.stop.is_set():
                message = consumer.receive(timeout=0.05)
                if message is not None:
                    self.times.append(time.monotonic())
                    message.ack()
            consumer.close()
        except BaseException as exc:  # shown by the driver
            self.errors.append(exc)

    def gap(self, start: float, end: float) -> float:
        """The longest time between consecutive deliveries, counting every pair with one end in
        [start, end] (a delivery stall that spans the window is counted whole)."""
        times = list(self.times)
        worst = 0.0
        for a, b in itertools.pairwise(times):
            if b >= start and a <= end:
                worst = max(worst, b - a)
        return worst

    def wait_steady(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < 100:
            if self.errors:
                raise self.errors[0]
            if time.monotonic() > deadline:
                raise TimeoutError("the canary got no steady deliveries")
            time.sleep(0.1)


# --- the hostile client -------------------------------------------------------------------------

class Hostile:
    """A consumer speaking the wire protocol only (no SDK check of its filter)."""

    def __init__(self, bootstrap: str, prefix: str) -> None:
        self.codec = Codec()
        self.topics = TopicNames(prefix)
        self.consumer_id = f"hostile-{uuid.uuid4().hex[:8]}"
        self.delivery_topic = self.topics.delivery(self.consumer_id)
        create_topic(bootstrap, self.delivery_topic, 1)
        self.producer = Producer(logged({"bootstrap.servers": bootstrap, "linger.ms": 0}))
        self.consumer = Consumer(logged({
            "bootstrap.servers": bootstrap, "group.id": self.consumer_id,
            "enable.auto.commit": False, "auto.offset.reset": "earliest"}))
        self.consumer.assign([TopicPartition(self.delivery_topic, 0, 0)])
        self.session_id = ""
        self.secret = b""

    def subscribe(self, queue: str, filter: str, timeout: float = 180.0
                  ) -> tuple[SubscribeResult, float, float]:
        """The reply, the send time and the reply time (monotonic)."""
        self.session_id, self.secret = uuid.uuid4().hex, new_session_secret()
        request_id = uuid.uuid4().hex
        record = Subscribe(consumer_id=self.consumer_id, session_id=self.session_id,
                           request_id=request_id, queue=queue, queue_is_regex=False,
                           max_backlog=10, filter=filter, delivery_topic=self.delivery_topic,
                           session_timeout_ms=30_000, client_name="hostile", client_version="0",
                           sent_at_ms=int(time.time() * 1000))
        self.producer.produce(self.topics.control, self.codec.encode_control(record),
                              key=self.consumer_id.encode(),
                              headers=list(secret_headers(self.secret)))
        self.producer.flush(10)
        sent = time.monotonic()
        deadline = sent + timeout
        while time.monotonic() < deadline:
            m = self.consumer.poll(0.005)
            if m is None or m.error() is not None or not is_reply(m.headers() or []):
                continue
            reply = self.codec.decode_reply(m.value())
            if isinstance(reply, SubscribeResult) and reply.request_id == request_id:
                return reply, sent, time.monotonic()
        raise TimeoutError(f"no answer to the Subscribe within {timeout}s")

    def unsubscribe(self) -> None:
        record = Unsubscribe(consumer_id=self.consumer_id, session_id=self.session_id,
                             reason="bench", sent_at_ms=int(time.time() * 1000))
        self.producer.produce(self.topics.control, self.codec.encode_control(record),
                              key=self.consumer_id.encode(),
                              headers=list(proof_headers(self.secret)))
        self.producer.flush(10)

    def close(self) -> None:
        self.consumer.close()


# --- the run -------------------------------------------------------------------------------------

def in_process(tree: Path) -> dict[str, Any]:
    """compile_expression of A and B in a fresh interpreter of ``tree``: seconds and outcome."""
    code = (
        "import json, sys, time\n"
        "from layer.domain.expressions import compile_expression\n"
        "from layer.domain.errors import ExpressionError\n"
        "out = {}\n"
        "for name, text in json.loads(sys.stdin.read()).items():\n"
        "    t = time.perf_counter()\n"
        "    try:\n"
        "        compile_expression(text); outcome = 'accepted'\n"
        "    except ExpressionError as exc:\n"
        "        outcome = 'refused: ' + str(exc)[:200]\n"
        "    out[name] = {'seconds': round(time.perf_counter() - t, 4), 'outcome': outcome}\n"
        "print(json.dumps(out))\n")
    texts = {"A": filter_a(90), "B": filter_b(91), "heavy": filter_heavy(92)}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(texts).encode(),
                          cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          check=True, capture_output=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def attempt(inst: Installation, canary: Canary, hostile: Hostile, kind: str, text: str,
            leave: bool) -> dict[str, Any]:
    before = inst.rss_mib()
    reply, sent, answered = hostile.subscribe("Target", text)
    time.sleep(2.0)
    row: dict[str, Any] = {
        "filter": kind, "chars": len(text), "status": reply.status.value,
        "message": (reply.message or "")[:160],
        "answer_ms": round((answered - sent) * 1000, 1),
        "canary_gap_s": round(canary.gap(sent - 1.0, answered + 2.0), 3),
        "rss_before_mib": round(before), "rss_after_mib": round(inst.rss_mib()),
    }
    if leave and reply.status.value == "OK":
        hostile.unsubscribe()
        time.sleep(3.0)
        row["rss_after_unsubscribe_mib"] = round(inst.rss_mib())
    print(json.dumps(row), flush=True)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    tree = Path(args.tree).resolve()
    inst = Installation(args.bootstrap_servers, args.database_url, tree, args.log_dir)
    journals = [f"hf-{inst.prefix.rstrip('.')}-canary", f"hf-{inst.prefix.rstrip('.')}-target"]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result: dict[str, Any] = {"label": args.label, "tree": str(tree), "commit": commit}
    try:
        for journal in journals:
            create_topic(args.bootstrap_servers, journal, 1)
        inst.cli("queue", "create", "Canary", "--underlying-topic", journals[0],
                 "--lease-period", "60s", "--set", "shard=0")
        inst.cli("queue", "create", "Target", "--underlying-topic", journals[1],
                 "--lease-period", "60s", "--set", "shard=1")
        producer = Producer(logged({"bootstrap.servers": args.bootstrap_servers}))
        for value in heavy_records(args.heavy_records):
            producer.produce(journals[1], value)
        producer.flush(30)
        result["in_process"] = in_process(tree)
        print("in-process:", json.dumps(result["in_process"]), flush=True)
        inst.start()
        with Canary(args.bootstrap_servers, inst.prefix, journals[0]) as canary:
            canary.wait_steady()
            time.sleep(5.0)  # warm-up: the loop's first iterations, the consumer's first fetches
            quiet_start = time.monotonic()
            time.sleep(6.0)
            result["quiet_gap_s"] = round(canary.gap(quiet_start, time.monotonic()), 3)
            result["rss_start_mib"] = round(inst.rss_mib())
            print(f"quiet gap {result['quiet_gap_s']} s, RSS {result['rss_start_mib']} MiB",
                  flush=True)
            hostile = Hostile(args.bootstrap_servers, inst.prefix)
            rows = [attempt(inst, canary, hostile, "syntax error", "/f LIKE", leave=True)]
            # The heavy filter first, so memory A and B leave freed cannot hide its growth.
            for r in range(args.heavy_rounds):
                rows.append(attempt(inst, canary, hostile, "heavy", filter_heavy(r), leave=True))
            for r in range(args.rounds):
                rows.append(attempt(inst, canary, hostile, "A", filter_a(r), leave=True))
            for r in range(args.rounds):
                rows.append(attempt(inst, canary, hostile, "B", filter_b(r), leave=True))
            hostile.close()
            result["attempts"] = rows
            result["rss_end_mib"] = round(inst.rss_mib())
            result["worst_gap_whole_run_s"] = round(canary.gap(0, time.monotonic()), 3)
            result["canary_deliveries"] = len(canary.times)
            if canary.errors:
                raise canary.errors[0]
    finally:
        inst.stop()
        delete_cell_topics(args.bootstrap_servers, journals, [inst.prefix])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", default=str(HERE), help="the checkout whose coordinator runs")
    parser.add_argument("--label", default="after")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--heavy-rounds", type=int, default=3)
    parser.add_argument("--heavy-records", type=int, default=200)
    parser.add_argument("--bootstrap-servers", default=os.environ.get(
        "QLAYER_BOOTSTRAP_SERVERS", "127.0.0.1:39092"))
    parser.add_argument("--database-url", default=os.environ.get(
        "QLAYER_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:35432/postgres"))
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = run(args)
    result["machine"] = machine()
    result["command"] = " ".join([".venv/bin/python", "benchmarks/hostile_filter.py",
                                  *sys.argv[1:]])
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    saved: dict[str, Any] = (json.loads(args.output.read_text())
                             if args.output.exists() else {})
    saved[args.label] = result
    args.output.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"saved to {args.output}")


if __name__ == "__main__":
    main()
