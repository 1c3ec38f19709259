"""The fault-injection soak (issue 15): `make soak`, or `python -m tests.soak.run [options]`.

It starts a stack of its own (a Kafka broker and a PostgreSQL server as local processes, in a
temporary state directory, on free ports) because it kills them; coordinators (`qlayer
coordinator run`, one owner and hot standbys) and SDK consumer processes
(`tests/soak/worker.py`). A producer publishes numbered records at a fixed rate to one journal
that two queues read: one at-least-once, one at-most-once. Meanwhile, at seeded random times,
it SIGKILLs coordinators (and starts them again), SIGKILLs consumers (and starts new ones),
SIGKILLs the broker and crashes PostgreSQL (`pg_ctl stop -m immediate`), each for a while, then
starts them again, as an operator's supervisor would.

When every record is published and every fault done, it waits until both queues' recovery
points in PostgreSQL reach the journal's end, stops everything and checks what a user would:

- at-least-once: every published record was processed (recorded by a consumer) at least once;
  every entry has exactly one ACKED event and none is leased again after it;
- at-most-once: no record was processed twice, and none delivered twice (LEASED events);
- no coordinator exited on its own (consumers that did are counted, and replaced).

The figures and the fault log go to ``--output`` (JSON); the exit status is 1 when a check
failed. The integration test `tests/integration/test_soak.py` runs a short plan of it in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, Producer

from layer.localstack import StackConfig
from layer.localstack.process import LocalStackError
from layer.localstack.stack import Endpoints, LocalStack
from layer.protocol import EventType
from layer.settings import Settings
from layer.store import migrate
from layer.store.store import Store
from tests.support.coordinator import put_queues
from tests.support.kafka import create_topic
from tests.support.ports import free_ports
from tests.support.processes import CoordinatorSubprocess, Subprocess, read_events

#: Below Linux's ephemeral port range (32768-60999), so no client connection holds them.
KAFKA_PORTS_FROM = 30_092
POSTGRES_PORTS_FROM = 30_532

ALO = "SoakAtLeastOnce"
AMO = "SoakAtMostOnce"


@dataclass(frozen=True)
class SoakPlan:
    """What the soak does. The defaults are the issue's soak (about 8 minutes on 2 cores)."""

    messages: int = 100_000
    rate: float = 400.0
    partitions: int = 4
    consumers: int = 4
    coordinators: int = 2
    coordinator_kills: int = 7
    consumer_kills: int = 6
    broker_kills: int = 1
    postgres_crashes: int = 1
    #: How long the broker or PostgreSQL stays down before it is started again (seconds).
    outage: float = 10.0
    lease_period: str = "10s"
    seed: int = 1
    #: After the last record and fault: how long every entry may take to be done (seconds).
    drain_timeout: float = 600.0
    core: str = "native"

    def faults(self) -> list[tuple[float, str]]:
        """(seconds after the first record, fault) for every fault, in time order: spread
        over the middle 80 % of the publishing time, jittered by the seed."""
        kinds = (["coordinator"] * self.coordinator_kills + ["consumer"] * self.consumer_kills
                 + ["broker"] * self.broker_kills + ["postgres"] * self.postgres_crashes)
        rng = random.Random(self.seed)
        rng.shuffle(kinds)
        span = self.messages / self.rate
        slot = 0.8 * span / max(1, len(kinds))
        return [(0.1 * span + (i + rng.random() * 0.5) * slot, kind)
                for i, kind in enumerate(kinds)]


@dataclass
class SoakResult:
    plan: dict[str, Any]
    published: int = 0
    publish_failures: int = 0
    faults: list[tuple[float, str, str]] = field(default_factory=list)
    seconds: float = 0.0
    drained: bool = False
    alo_processed: int = 0
    alo_lost: list[int] = field(default_factory=list)
    alo_processed_twice: int = 0
    amo_processed: int = 0
    amo_processed_twice: list[int] = field(default_factory=list)
    amo_not_processed: int = 0
    alo_entries_without_acked_event: int = 0
    alo_entries_acked_twice: int = 0
    entries_leased_after_acked: int = 0
    amo_entries_leased_twice: int = 0
    coordinator_unplanned_exits: list[str] = field(default_factory=list)
    consumer_unplanned_exits: list[str] = field(default_factory=list)
    #: For a few lost records and entries without an ACKED event: their events, in order.
    histories: dict[str, list[str]] = field(default_factory=dict)

    def problems(self) -> list[str]:
        found = []
        if not self.drained:
            found.append("the queues were not drained in time (recovery points short of the "
                         "journal's end)")
        if self.alo_lost:
            found.append(f"{len(self.alo_lost)} at-least-once records never processed, e.g. "
                         f"{self.alo_lost[:10]}")
        if self.amo_processed_twice:
            found.append(f"{len(self.amo_processed_twice)} at-most-once records processed "
                         f"twice, e.g. {self.amo_processed_twice[:10]}")
        if self.alo_entries_without_acked_event:
            found.append(f"{self.alo_entries_without_acked_event} at-least-once entries "
                         "without an ACKED event")
        if self.alo_entries_acked_twice:
            found.append(f"{self.alo_entries_acked_twice} entries with two ACKED events")
        if self.entries_leased_after_acked:
            found.append(f"{self.entries_leased_after_acked} entries leased after their ACKED")
        if self.amo_entries_leased_twice:
            found.append(f"{self.amo_entries_leased_twice} at-most-once entries leased twice")
        if self.coordinator_unplanned_exits:
            found.append("coordinators exited on their own: "
                         + "; ".join(self.coordinator_unplanned_exits))
        return found




class Publisher(threading.Thread):
    """Publishes 0..n-1 at a fixed rate; librdkafka keeps retrying through a broker outage."""

    def __init__(self, bootstrap: str, topic: str, plan: SoakPlan) -> None:
        super().__init__(daemon=True, name="soak-publisher")
        self.topic, self.plan = topic, plan
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5,
                                  "enable.idempotence": True,
                                  "message.timeout.ms": 900_000,
                                  # The outages are on purpose: not a line per retry.
                                  "log_level": 2})
        self.delivered: set[int] = set()
        self.failures = 0
        self.started = 0.0

    def _report(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            self.delivered.add(int(msg.value() or b"-1"))
        else:
            self.failures += 1

    def run(self) -> None:
        self.started = time.monotonic()
        for i in range(self.plan.messages):
            wait = self.started + i / self.plan.rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            while True:
                try:
                    self.producer.produce(self.topic, str(i).encode(),
                                          key=str(i % 97).encode(), on_delivery=self._report)
                    break
                except BufferError:  # the queue is full while the broker is away
                    self.producer.poll(0.1)
            self.producer.poll(0)
        while self.producer.flush(5) > 0:
            pass


class Soak:
    def __init__(self, plan: SoakPlan, state_dir: Path, say: Callable[[str], None],
                 keep_stack: bool = False) -> None:
        self.plan, self.state_dir, self.say, self.keep_stack = plan, state_dir, say, keep_stack
        self.stack = self._stack(KAFKA_PORTS_FROM, POSTGRES_PORTS_FROM)
        self.logs = state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.coordinators: dict[str, CoordinatorSubprocess] = {}
        self.workers: dict[str, tuple[Subprocess, Path]] = {}
        self.outputs: list[Path] = []
        self.planned_exits: set[int] = set()
        self.result = SoakResult(plan=dataclasses.asdict(plan))
        self.rng = random.Random(plan.seed + 1)
        self._count = 0

    def _stack(self, kafka_from: int, postgres_from: int) -> LocalStack:
        kafka_port = free_ports(kafka_from, 2)
        pg_port = free_ports(postgres_from, 1)
        return LocalStack(StackConfig.from_env(
            {}, state_dir=self.state_dir / f"stack-{kafka_port}", kafka_port=kafka_port,
            postgres_port=pg_port))

    def _up(self) -> Endpoints:
        """The stack started; on other ports when a port that looked free could not be bound
        (another process took it between the look and the bind)."""
        for attempt in range(3):
            try:
                return self.stack.up()
            except LocalStackError as exc:
                if attempt == 2:
                    raise
                self.say(f"the stack did not start ({str(exc).splitlines()[0]}); other ports")
                self.stack.down()
                self.stack = self._stack(self.stack.config.kafka_port + 10,
                                         self.stack.config.postgres_port + 10)
        raise AssertionError("unreachable")

    # --- processes --------------------------------------------------------------------------

    def _start_coordinator(self, name: str) -> None:
        self.coordinators[name] = CoordinatorSubprocess(self.settings, self.logs, name,
                                                        "--core", self.plan.core)

    def _start_worker(self) -> None:
        self._count += 1
        name = f"consumer{self._count}"
        out = self.logs / f"{name}.received"
        out.touch()
        self.outputs.append(out)
        proc = Subprocess([sys.executable, "-m", "tests.soak.worker", str(out), ALO, AMO],
                          self.settings, self.logs / f"{name}.log")
        self.workers[name] = (proc, out)

    def _supervise(self) -> None:
        """Start again what exited without being killed by the soak, and count it."""
        for name, proc in list(self.coordinators.items()):
            code = proc.proc.poll()
            if code is not None and proc.pid not in self.planned_exits:
                self.result.coordinator_unplanned_exits.append(
                    f"{name} (pid {proc.pid}) exit {code}, log {proc.log}")
                self.say(f"coordinator {name} exited on its own ({code}); starting it again")
                self._start_coordinator(name)
        for name, (worker, _) in list(self.workers.items()):
            code = worker.proc.poll()
            if code is not None and worker.pid not in self.planned_exits:
                self.result.consumer_unplanned_exits.append(f"{name} exit {code}")
                self.say(f"{name} exited on its own ({code}); starting another consumer")
                del self.workers[name]
                self._start_worker()

    # --- faults -----------------------------------------------------------------------------

    def _fault(self, kind: str) -> str:
        if kind == "coordinator":
            name = self.rng.choice(sorted(self.coordinators))
            proc = self.coordinators[name]
            self.planned_exits.add(proc.pid)
            proc.kill()
            time.sleep(1.0)
            self._start_coordinator(name)
            return f"SIGKILL coordinator {name} (pid {proc.pid}), started again"
        if kind == "consumer":
            name = self.rng.choice(sorted(self.workers))
            worker, _ = self.workers.pop(name)
            self.planned_exits.add(worker.pid)
            worker.kill()
            self._start_worker()
            return f"SIGKILL {name} (pid {worker.pid}), a new consumer started"
        if kind == "broker":
            pid = self.stack.kafka.kill()
            self._sleep_supervised(self.plan.outage)
            self.stack.kafka.up()
            return f"SIGKILL broker (pid {pid}), down {self.plan.outage:.0f}s, started again"
        if kind == "postgres":
            self.stack.postgres.crash()
            self._sleep_supervised(self.plan.outage)
            self.stack.postgres.up()
            return f"PostgreSQL stopped -m immediate, down {self.plan.outage:.0f}s, started again"
        raise ValueError(kind)

    def _sleep_supervised(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._supervise()
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))

    # --- the run ----------------------------------------------------------------------------

    def _recovered(self) -> bool:
        try:
            with Store(self.settings.database_url) as store:
                return all(sum(store.load_recovery_points(q).values()) >= self.result.published
                           for q in (ALO, AMO))
        except Exception:  # PostgreSQL may be restarting: asked again later
            return False

    def run(self) -> SoakResult:
        began = time.monotonic()
        endpoints = self._up()
        self.settings = Settings(bootstrap_servers=endpoints.bootstrap_servers,
                                 database_url=endpoints.database_url,
                                 topic_prefix=f"soak{uuid.uuid4().hex[:6]}.")
        self.say(f"stack up: {endpoints.bootstrap_servers}, {endpoints.database_url}")
        try:
            migrate.upgrade(self.settings.database_url, shard_count=4)
            journal = self.journal = f"soak-journal-{uuid.uuid4().hex[:6]}"
            create_topic(self.settings.bootstrap_servers, journal, self.plan.partitions)
            put_queues(self.settings,
                       {"name": ALO, "underlying_topic": journal,
                        "lease_period": self.plan.lease_period},
                       {"name": AMO, "underlying_topic": journal, "semantics": "at-most-once",
                        "lease_period": self.plan.lease_period})
            for i in range(self.plan.coordinators):
                self._start_coordinator(f"coordinator{i}")
            for _ in range(self.plan.consumers):
                self._start_worker()
            publisher = Publisher(self.settings.bootstrap_servers, journal, self.plan)
            publisher.start()
            for at, kind in self.plan.faults():
                while time.monotonic() < publisher.started + at:
                    self._supervise()
                    time.sleep(0.5)
                t = time.monotonic() - publisher.started
                what = self._fault(kind)
                self.result.faults.append((round(t, 1), kind, what))
                self.say(f"t={t:6.1f}s {what}")
            while publisher.is_alive():
                self._supervise()
                publisher.join(0.5)
            self.result.published = len(publisher.delivered)
            self.result.publish_failures = publisher.failures
            self.say(f"published {self.result.published} records "
                     f"({publisher.failures} failed to publish); draining")
            deadline = time.monotonic() + self.plan.drain_timeout
            while time.monotonic() < deadline:
                self._supervise()
                if self._recovered():
                    self.result.drained = True
                    break
                time.sleep(1.0)
            time.sleep(2.0)  # the last acks' events are published after their transaction
            self._stop_processes()
            self._check(publisher.delivered)
        finally:
            self._stop_processes()
            if not self.keep_stack:
                self.stack.down()
            self.result.seconds = round(time.monotonic() - began, 1)
        return self.result

    def _stop_processes(self) -> None:
        for worker, _ in self.workers.values():
            self.planned_exits.add(worker.pid)
            worker.stop()
        for proc in self.coordinators.values():
            self.planned_exits.add(proc.pid)
            proc.stop()

    def _check(self, published: set[int]) -> None:
        processed: dict[str, Counter[int]] = {ALO: Counter(), AMO: Counter()}
        for out in self.outputs:
            for line in out.read_text(encoding="utf-8").splitlines():
                queue, _, value = line.partition("\t")
                if queue in processed and value:
                    processed[queue][int(value)] += 1
        r = self.result
        alo, amo = processed[ALO], processed[AMO]
        r.alo_processed = sum(alo.values())
        r.alo_lost = sorted(published - set(alo))
        r.alo_processed_twice = sum(1 for n in alo.values() if n > 1)
        r.amo_processed = sum(amo.values())
        r.amo_processed_twice = sorted(v for v, n in amo.items() if n > 1)
        r.amo_not_processed = len(published - set(amo))
        acked: dict[str, Counter[str]] = {ALO: Counter(), AMO: Counter()}
        leased: dict[str, Counter[str]] = {ALO: Counter(), AMO: Counter()}
        acked_at: dict[tuple[str, str], int] = {}
        late = 0
        events = read_events(self.settings, {ALO, AMO})
        history: dict[str, list[str]] = {}
        for e in events:
            if e.queue == ALO and e.bookmark is not None:
                history.setdefault(e.bookmark.format(), []).append(
                    f"{e.type}{'(' + e.reason + ')' if e.reason else ''}"
                    f"@{e.timestamp_ms}{' ' + e.consumer_id if e.consumer_id else ''}")
        for e in events:
            if e.bookmark is None or e.queue is None:
                continue
            key = e.bookmark.format()
            if e.type is EventType.ACKED:
                acked[e.queue][key] += 1
                acked_at[(e.queue, key)] = e.timestamp_ms
            elif e.type is EventType.LEASED:
                leased[e.queue][key] += 1
                if (e.queue, key) in acked_at and e.timestamp_ms > acked_at[(e.queue, key)]:
                    late += 1
        r.alo_entries_without_acked_event = max(0, len(published) - len(acked[ALO]))
        r.alo_entries_acked_twice = sum(1 for n in acked[ALO].values() if n > 1)
        r.entries_leased_after_acked = late
        r.amo_entries_leased_twice = sum(1 for n in leased[AMO].values() if n > 1)
        if r.alo_lost or r.alo_entries_without_acked_event:
            where = self._bookmarks_of(published)
            lost = [where[v] for v in r.alo_lost[:8] if v in where]
            unacked = [b for b in sorted(where.values()) if acked[ALO][b] == 0][:8]
            for b in dict.fromkeys(lost + unacked):
                record = next(v for v, w in where.items() if w == b)
                r.histories[f"{b} (record {record})"] = history.get(b, [])

    def _bookmarks_of(self, published: set[int]) -> dict[int, str]:
        """Each published record's bookmark, read back from the journal."""
        consumer = Consumer({"bootstrap.servers": self.settings.bootstrap_servers,
                             "group.id": f"soak-{uuid.uuid4().hex}",
                             "auto.offset.reset": "earliest", "enable.auto.commit": False})
        consumer.subscribe([self.journal])
        found: dict[int, str] = {}
        deadline = time.monotonic() + 60
        while len(found) < len(published) and time.monotonic() < deadline:
            for m in consumer.consume(10_000, 0.5):
                if m.error() is None and m.value():
                    found[int(m.value() or b"-1")] = f"{m.topic()}/{m.partition()}/{m.offset()}"
        consumer.close()
        return found


def soak_dir() -> Path:
    """A new directory for the soak's stack and logs that the postgres user can enter
    (PostgreSQL refuses a data directory under a private parent; mkdtemp makes it 0700)."""
    path = Path(tempfile.mkdtemp(prefix="qlayer-soak-", dir="/tmp"))
    path.chmod(0o755)
    return path


def main(argv: list[str] | None = None) -> int:
    defaults = SoakPlan()
    parser = argparse.ArgumentParser(
        prog="python -m tests.soak.run",
        description="qlayer's fault-injection soak: a stack of its own, coordinators and "
                    "consumers SIGKILLed, the broker killed, PostgreSQL crashed; then checks "
                    "that nothing was lost (at-least-once) or processed twice (at-most-once).")
    for f in dataclasses.fields(SoakPlan):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        parser.add_argument(flag, type=type(default), default=default,
                            help=f"(default: {default})")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the stack and the logs go (default: a new temporary "
                             "directory, kept for reading the logs)")
    parser.add_argument("--keep-stack", action="store_true",
                        help="leave the soak's broker and PostgreSQL running afterwards, to "
                             "look into them (stop them with `qlayer dev down` and "
                             "QLAYER_DEV_STATE_DIR=STATE_DIR/stack-KAFKAPORT and the soak's ports)")
    parser.add_argument("--output", type=Path, default=Path("soak-result.json"),
                        help="the figures and the fault log, JSON (default: %(default)s)")
    args = parser.parse_args(argv)
    plan = SoakPlan(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SoakPlan)})
    state_dir = args.state_dir or soak_dir()

    def say(line: str) -> None:
        print(f"[soak] {line}", flush=True)

    say(f"state and logs in {state_dir}")
    result = Soak(plan, state_dir, say, keep_stack=args.keep_stack).run()
    args.output.write_text(json.dumps(dataclasses.asdict(result), indent=2) + "\n",
                           encoding="utf-8")
    summary = {k: v for k, v in dataclasses.asdict(result).items()
               if k not in ("plan", "faults", "alo_lost", "amo_processed_twice", "histories")}
    for key, value in summary.items():
        say(f"{key:36} {value}")
    problems = result.problems()
    for p in problems:
        say(f"PROBLEM: {p}")
    for entry, seen in result.histories.items():
        say(f"events of {entry}: {' '.join(seen) or 'none'}")
    say("passed" if not problems else f"FAILED ({len(problems)} problems); logs in {state_dir}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
