"""The fault-injection soak (issue 15): `make soak`, or `python -m tests.soak.run [options]`.

It starts a stack of its own (a Kafka broker and a PostgreSQL server as local processes, in a
temporary state directory, on free ports) because it kills them; coordinators (`qlayer
coordinator run`, one owner and hot standbys) and SDK consumer processes
(`tests/soak/worker.py`). A producer publishes numbered records at a fixed rate to one journal
that two queues read: one at-least-once, one at-most-once. Meanwhile, at seeded random times,
it SIGKILLs coordinators (and starts them again), SIGKILLs consumers (and starts new ones),
SIGKILLs the broker and crashes PostgreSQL (`pg_ctl stop -m immediate`), each for a while, then
starts them again, as an operator's supervisor would. It also publishes a poison record (larger
than the delivery topics take) to the journal, and deletes (and makes again) the journal of a
third, at-least-once queue while its entries are queued and leased.

When every record is published and every fault done, it waits until both queues' recovery
points in PostgreSQL reach the journal's end, stops everything and checks what a user would:

- at-least-once: every published record was processed (recorded by a consumer) at least once;
  every entry has exactly one ACKED event and none is leased again after it;
- at-most-once: no record was processed twice, and none delivered twice (LEASED events);
- no coordinator exited on its own (consumers that did are counted, and replaced);
- the poison record left both queues dead-lettered with reason ``too_large``; every entry of
  the deleted journal expired with reason ``journal_deleted``, every record of the journal
  made again was processed; neither cost a shard failure (a rebuild), and no shard failed
  until the end (a rebuild loop);
- `qlayer pipeline reconcile` (Spark) finds no violation in either queue: the journal, the
  events and PostgreSQL agree on every entry.

It prints a table per fault (lost, duplicated, the pause in acks and the recovery time).

The figures and the fault log go to ``--output`` (JSON); the exit status is 1 when a check
failed. The integration test `tests/integration/test_soak.py` runs a short plan of it in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
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

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from layer.localstack import StackConfig
from layer.localstack.process import LocalStackError
from layer.localstack.stack import Endpoints, LocalStack
from layer.protocol import Event, EventType, TopicNames
from layer.protocol.headers import DLQ_REASON
from layer.sdk import QueueConsumer
from layer.settings import Settings
from layer.store import migrate
from layer.store.rows import PartitionKey
from layer.store.store import Store
from tests.soak.report import (
    FaultRow,
    ShardFailure,
    Timeline,
    audit_verdict,
    fault_rows,
    shard_failures,
    table,
)
from tests.support.coordinator import put_queues
from tests.support.kafka import create_topic
from tests.support.ports import free_ports
from tests.support.processes import CoordinatorSubprocess, Subprocess, _env, read_events

#: Below Linux's ephemeral port range (32768-60999), so no client connection holds them.
KAFKA_PORTS_FROM = 30_092
POSTGRES_PORTS_FROM = 30_532

ALO = "SoakAtLeastOnce"
AMO = "SoakAtMostOnce"
#: At-least-once, on a journal of its own: the one the soak deletes and makes again.
DOOMED = "SoakDeletedJournal"

#: The journal takes records up to this size; the coordinator's producer writes 1 MB at most,
#: so the poison record (1.5 MB) can be journaled and never delivered (`too_large`).
JOURNAL_MAX_BYTES = 3_000_000
POISON_BYTES = 1_500_000
#: Records on the doomed journal: some at the start, more just before it is deleted, some
#: after it is made again; and how many of its entries are leased (to a consumer that never
#: acks them) when it is deleted. Until it is deleted the queue has no other consumer, so every
#: entry is queued or leased then: each must expire with reason journal_deleted.
DOOMED_BEFORE, DOOMED_BURST, DOOMED_AFTER, DOOMED_HELD = 100, 400, 100, 10


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
    #: Poison records (each 1.5 MB, more than the delivery topics take) published to the
    #: journal, and deletions (each followed by making it again) of the third queue's journal.
    poison_records: int = 1
    journal_deletions: int = 1
    #: How long the broker or PostgreSQL stays down before it is started again (seconds).
    outage: float = 10.0
    lease_period: str = "10s"
    seed: int = 1
    #: After the last record and fault: how long every entry may take to be done (seconds).
    drain_timeout: float = 600.0
    core: str = "native"
    #: After the soak: `qlayer pipeline reconcile` (Spark) of both queues, its violations
    #: counted (a JVM and a Spark session per queue: minutes on 2 cores).
    audit: bool = True

    def faults(self) -> list[tuple[float, str]]:
        """(seconds after the first record, fault) for every fault, in time order: spread
        over the middle 80 % of the publishing time, jittered by the seed."""
        kinds = (["coordinator"] * self.coordinator_kills + ["consumer"] * self.consumer_kills
                 + ["broker"] * self.broker_kills + ["postgres"] * self.postgres_crashes
                 + ["poison"] * self.poison_records
                 + ["journal_deleted"] * self.journal_deletions)
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
    #: Poison records: their bookmarks, each queue's outcome events of them
    #: (``EXPIRED(too_large)``...), and the dead letters with reason too_large per queue.
    poison_bookmarks: list[str] = field(default_factory=list)
    poison_outcomes: dict[str, list[str]] = field(default_factory=dict)
    poison_dead_letters: dict[str, int] = field(default_factory=dict)
    #: The deleted journal: entries expired with reason journal_deleted, entries (admitted
    #: before it was made again) without exactly one outcome, records published after it was
    #: made again and those of them never processed.
    deleted_journal_published: int = 0
    deleted_journal_admitted: int = 0
    deleted_journal_expired: int = 0
    deleted_journal_entries_without_one_outcome: int = 0
    deleted_journal_recreated_published: int = 0
    deleted_journal_recreated_not_processed: int = 0
    #: Shard failures (each a rebuild from stored state) in the coordinators' logs: all of
    #: them, those after a poison record or a journal deletion (before the next fault), and
    #: runs of failures that never ended (a shard failing until the coordinator stopped).
    shard_failures: int = 0
    shard_failures_after_input_faults: int = 0
    shard_failures_unended: list[str] = field(default_factory=list)
    #: What followed each fault (tests/soak/report.py `FaultRow`).
    fault_table: list[dict[str, Any]] = field(default_factory=list)
    #: `qlayer pipeline reconcile` of each queue, and how many violations it found in all.
    audit: list[dict[str, Any]] = field(default_factory=list)
    audit_violations: int = 0
    audit_seconds: float = 0.0

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
        for queue, outcomes in self.poison_outcomes.items():
            if sum(o.startswith("EXPIRED(too_large)@") for o in outcomes) != len(
                    self.poison_bookmarks) or len(outcomes) != len(self.poison_bookmarks):
                found.append(f"{queue}: the poison records' outcomes are {outcomes}, not one "
                             "EXPIRED(too_large) each")
        # At least one each: the dead-letter topic is at-least-once (a crash between the
        # Kafka write and the PostgreSQL commit writes a letter twice, docs/coordinator.md);
        # the outcome (EXPIRED, above) is exactly once.
        if self.poison_bookmarks and (self.poison_dead_letters.get(ALO, 0)
                                      < len(self.poison_bookmarks)):
            found.append(f"{self.poison_dead_letters.get(ALO, 0)} dead letters with reason "
                         f"too_large in {ALO}'s dead-letter topic, for "
                         f"{len(self.poison_bookmarks)} poison records")
        if self.plan.get("journal_deletions") and not self.deleted_journal_expired:
            found.append("no entry of the deleted journal expired with reason journal_deleted")
        if self.deleted_journal_admitted != self.deleted_journal_published:
            found.append(f"{self.deleted_journal_admitted} entries of the deleted journal "
                         f"admitted, of {self.deleted_journal_published} records published")
        if self.deleted_journal_entries_without_one_outcome:
            found.append(f"{self.deleted_journal_entries_without_one_outcome} entries of the "
                         "deleted journal without exactly one outcome")
        if self.deleted_journal_recreated_not_processed:
            found.append(f"{self.deleted_journal_recreated_not_processed} records of the "
                         "journal made again never processed")
        if self.shard_failures_after_input_faults:
            found.append(f"{self.shard_failures_after_input_faults} shard failures (rebuilds) "
                         "after a poison record or a journal deletion")
        if self.shard_failures_unended:
            found.append("shards failing until their coordinator stopped (a rebuild loop): "
                         + "; ".join(self.shard_failures_unended))
        for verdict in self.audit:
            if verdict["error"]:
                found.append(f"the audit of {verdict['queue']} did not run: {verdict['error']}")
        if self.audit_violations:
            found.append(f"{self.audit_violations} violations found by `qlayer pipeline "
                         "reconcile`: " + "; ".join(
                             f"{v[0]} {v[1]}" for a in self.audit
                             for v in a["violations"][:10]))
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
        #: Each consumer process, its output and its queues.
        self.workers: dict[str, tuple[Subprocess, Path, tuple[str, ...]]] = {}
        self.outputs: list[Path] = []
        self.planned_exits: set[int] = set()
        self.result = SoakResult(plan=dataclasses.asdict(plan))
        self.rng = random.Random(plan.seed + 1)
        self._count = 0
        #: The epoch second of the first record: time 0 of the faults and the table.
        self.origin = 0.0
        self.poison: list[str] = []
        #: Values published to the doomed journal before each deletion, and after the last
        #: time it was made again; the epoch ms of each making again.
        self.doomed_before: list[str] = []
        self.doomed_after: list[str] = []
        self.recreated_ms: list[int] = []

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
        # JSON logs: their shard failures are counted (tests/soak/report.py).
        self.coordinators[name] = CoordinatorSubprocess(self.settings, self.logs, name,
                                                        "--core", self.plan.core,
                                                        "--log-format", "json")

    def _start_worker(self, queues: tuple[str, ...] = (ALO, AMO)) -> None:
        self._count += 1
        name = f"consumer{self._count}"
        out = self.logs / f"{name}.received"
        out.touch()
        self.outputs.append(out)
        proc = Subprocess([sys.executable, "-m", "tests.soak.worker", str(out), *queues],
                          self.settings, self.logs / f"{name}.log")
        self.workers[name] = (proc, out, queues)

    def _supervise(self) -> None:
        """Start again what exited without being killed by the soak, and count it."""
        for name, proc in list(self.coordinators.items()):
            code = proc.proc.poll()
            if code is not None and proc.pid not in self.planned_exits:
                self.result.coordinator_unplanned_exits.append(
                    f"{name} (pid {proc.pid}) exit {code}, log {proc.log}")
                self.say(f"coordinator {name} exited on its own ({code}); starting it again")
                self._start_coordinator(name)
        for name, (worker, _, queues) in list(self.workers.items()):
            code = worker.proc.poll()
            if code is not None and worker.pid not in self.planned_exits:
                self.result.consumer_unplanned_exits.append(f"{name} exit {code}")
                self.say(f"{name} exited on its own ({code}); starting another consumer")
                del self.workers[name]
                self._start_worker(queues)

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
            worker, _, queues = self.workers.pop(name)
            self.planned_exits.add(worker.pid)
            worker.kill()
            self._start_worker(queues)
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
        if kind == "poison":
            return self._poison()
        if kind == "journal_deleted":
            return self._delete_journal()
        raise ValueError(kind)

    def _poison(self) -> str:
        """A record the journal takes and the delivery topics do not: it must be
        dead-lettered (reason too_large) by both queues, and cost no shard a rebuild."""
        where: list[str] = []

        def report(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                where.append(f"{msg.topic()}/{msg.partition()}/{msg.offset()}")

        producer = Producer({"bootstrap.servers": self.settings.bootstrap_servers,
                             "message.max.bytes": JOURNAL_MAX_BYTES, "log_level": 2})
        producer.produce(self.journal, os.urandom(POISON_BYTES), key=b"poison",
                         on_delivery=report)
        producer.flush(60)
        if not where:
            return "poison record NOT published"
        self.poison.extend(where)
        return f"poison record of {POISON_BYTES} bytes published at {where[0]}"

    def _delete_journal(self) -> str:
        """The doomed queue's journal deleted once the coordinator admitted its records, with
        some of them leased (to a consumer that does not ack them) and the others queued;
        made again once the coordinator expired them, and published to. A consumer process
        for the queue is started then (the first time)."""
        bootstrap = self.settings.bootstrap_servers
        n = len(self.doomed_before) + len(self.doomed_after)
        burst = [f"d{i}" for i in range(n, n + DOOMED_BURST)]
        self._publish(self.doomed, burst)
        self.doomed_before += self.doomed_after + burst
        self.doomed_after = []
        # Deleted before the coordinator read it, the journal would leave nothing to expire.
        admitted = time.monotonic()
        while (self._doomed_counter("enqueued") < len(self.doomed_before)
               and time.monotonic() < admitted + 120):
            self._sleep_supervised(0.5)
        # At any time, also while the shard moves between processes after an earlier fault:
        # its next owner finds the journal gone, or made again (by the broker) shorter than
        # what the queue admitted of it, when it loads the queue.
        before = self._journal_deleted_count()
        holder = QueueConsumer(DOOMED, bootstrap, topic_prefix=self.settings.topic_prefix,
                               max_backlog=DOOMED_HELD, subscribe_timeout=60)
        held = 0
        try:
            until = time.monotonic() + 30
            while held < DOOMED_HELD and time.monotonic() < until:
                held += holder.receive(timeout=1.0) is not None
            admin = AdminClient({"bootstrap.servers": bootstrap})
            for future in admin.delete_topics([self.doomed]).values():
                future.result(60)
            deleted = time.monotonic()
            # Made again only once the coordinator saw it gone and expired its entries: made
            # again at once, the coordinator might never see the deletion (same name).
            while (self._journal_deleted_count() <= before
                   and time.monotonic() < deleted + 120):
                self._sleep_supervised(1.0)
        finally:
            holder.close()
        expired = self._journal_deleted_count() - before
        seen = time.monotonic() - deleted
        while True:
            try:
                # Made already when the broker creates topics on first use.
                create_topic(bootstrap, self.doomed, 1, exist_ok=True)
                break
            except KafkaException as exc:  # the deletion is still under way
                if time.monotonic() > deleted + 180:
                    raise
                self.say(f"making {self.doomed} again: {exc}; retried")
                self._sleep_supervised(1.0)
        self.recreated_ms.append(int(time.time() * 1000))
        self.doomed_after = [f"n{i}" for i in range(n + DOOMED_BURST,
                                                    n + DOOMED_BURST + DOOMED_AFTER)]
        self._publish(self.doomed, self.doomed_after)
        if not any(DOOMED in queues for _, _, queues in self.workers.values()):
            self._start_worker((DOOMED,))
        return (f"journal {self.doomed} deleted ({len(self.doomed_before)} records, {held} "
                f"entries leased); {expired} entries expired journal_deleted within "
                f"{seen:.0f}s; made again, {DOOMED_AFTER} records published")

    def _publish(self, topic: str, values: list[str]) -> None:
        producer = Producer({"bootstrap.servers": self.settings.bootstrap_servers,
                             "linger.ms": 5, "log_level": 2})
        for value in values:
            producer.produce(topic, value.encode())
        if producer.flush(120) != 0:
            raise RuntimeError(f"records to {topic} not published in 120 s")

    def _journal_deleted_count(self) -> int:
        return self._doomed_counter("journal_deleted")

    def _doomed_counter(self, name: str) -> int:
        try:
            with Store(self.settings.database_url) as store:
                found = store.load_counters(DOOMED).get(DOOMED)
        except Exception:  # PostgreSQL may be restarting: asked again
            return 0
        return 0 if found is None else int(getattr(found, name))

    def _sleep_supervised(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._supervise()
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))

    # --- the run ----------------------------------------------------------------------------

    def _journal_ends(self) -> dict[str, dict[int, int]]:
        """Each journal's end offset per partition, once everything is published; asked
        again while the broker, just started again, has no leader for a partition yet."""
        consumer = Consumer({"bootstrap.servers": self.settings.bootstrap_servers,
                             "group.id": f"soak-{uuid.uuid4().hex}"})
        deadline = time.monotonic() + 120
        try:
            while True:
                try:
                    ends: dict[str, dict[int, int]] = {}
                    for topic in (self.journal, self.doomed):
                        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
                        ends[topic] = {p: consumer.get_watermark_offsets(
                            TopicPartition(topic, p), timeout=30)[1] for p in parts}
                    return ends
                except KafkaException:
                    if time.monotonic() > deadline:
                        raise
                    self._sleep_supervised(1.0)
        finally:
            consumer.close()

    def _recovered(self, ends: dict[str, dict[int, int]]) -> bool:
        """Every queue's recovery point at its journal's end, partition by partition."""
        journals = {ALO: self.journal, AMO: self.journal, DOOMED: self.doomed}
        try:
            with Store(self.settings.database_url) as store:
                for queue, topic in journals.items():
                    points = store.load_recovery_points(queue)
                    if any(points.get(PartitionKey(queue, topic, p), 0) < end
                           for p, end in ends[topic].items()):
                        return False
                return True
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
            self.doomed = f"soak-doomed-{uuid.uuid4().hex[:6]}"
            admin = AdminClient({"bootstrap.servers": self.settings.bootstrap_servers})
            config = {"max.message.bytes": str(JOURNAL_MAX_BYTES)}
            for future in admin.create_topics([NewTopic(journal, self.plan.partitions, 1,
                                                        config=config)]).values():
                future.result(30)
            # Made already: this waits until every partition has a leader.
            create_topic(self.settings.bootstrap_servers, journal, self.plan.partitions,
                         exist_ok=True)
            create_topic(self.settings.bootstrap_servers, self.doomed, 1)
            put_queues(self.settings,
                       {"name": ALO, "underlying_topic": journal,
                        "lease_period": self.plan.lease_period},
                       {"name": AMO, "underlying_topic": journal, "semantics": "at-most-once",
                        "lease_period": self.plan.lease_period},
                       {"name": DOOMED, "underlying_topic": self.doomed,
                        "lease_period": self.plan.lease_period})
            self.doomed_after = [f"d{i}" for i in range(DOOMED_BEFORE)]
            self._publish(self.doomed, self.doomed_after)
            for i in range(self.plan.coordinators):
                self._start_coordinator(f"coordinator{i}")
            for _ in range(self.plan.consumers):
                self._start_worker()
            publisher = Publisher(self.settings.bootstrap_servers, journal, self.plan)
            publisher.start()
            while not publisher.started:
                time.sleep(0.01)
            self.origin = time.time() - (time.monotonic() - publisher.started)
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
            ends = self._journal_ends()
            deadline = time.monotonic() + self.plan.drain_timeout
            while time.monotonic() < deadline:
                self._supervise()
                if self._recovered(ends):
                    self.result.drained = True
                    break
                time.sleep(1.0)
            time.sleep(2.0)  # the last acks' events are published after their transaction
            self._stop_processes()
            self._check(publisher.delivered)
            if self.plan.audit:
                self._audit()
        finally:
            self._stop_processes()
            if not self.keep_stack:
                self.stack.down()
            self.result.seconds = round(time.monotonic() - began, 1)
        return self.result

    def _stop_processes(self) -> None:
        for worker, _, _ in self.workers.values():
            self.planned_exits.add(worker.pid)
            worker.stop()
        for proc in self.coordinators.values():
            self.planned_exits.add(proc.pid)
            proc.stop()

    def _check(self, published: set[int]) -> None:
        # Each line: queue, value, the epoch second it was processed (recorded).
        processed: dict[str, Counter[str]] = {ALO: Counter(), AMO: Counter(), DOOMED: Counter()}
        seconds: dict[tuple[str, str], list[float]] = {}
        for out in self.outputs:
            for line in out.read_text(encoding="utf-8").splitlines():
                queue, value, at = [*line.split("\t"), "", ""][:3]
                if queue in processed and value:
                    processed[queue][value] += 1
                    if at:
                        seconds.setdefault((queue, value), []).append(float(at) - self.origin)
        r = self.result
        alo = Counter({int(v): n for v, n in processed[ALO].items()})
        amo = Counter({int(v): n for v, n in processed[AMO].items()})
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
        events = read_events(self.settings, {ALO, AMO, DOOMED})
        history: dict[str, list[str]] = {}
        for e in events:
            if e.queue == ALO and e.bookmark is not None:
                history.setdefault(e.bookmark.format(), []).append(_said(e))
        for e in events:
            if e.bookmark is None or e.queue not in acked:
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
        where = self._bookmarks_of(published)
        if r.alo_lost or r.alo_entries_without_acked_event:
            lost = [where[v][0] for v in r.alo_lost[:8] if v in where]
            unacked = [b for b, _ in sorted(where.values()) if acked[ALO][b] == 0][:8]
            for b in dict.fromkeys(lost + unacked):
                record = next(v for v, w in where.items() if w[0] == b)
                r.histories[f"{b} (record {record})"] = history.get(b, [])
        self._check_poison(events)
        self._check_doomed(events, processed[DOOMED])
        failures = self._shard_failures()
        # The table: lost and not processed by when the record was journaled, duplicates by
        # when they were processed again.
        timeline = Timeline(
            acks=[e.timestamp_ms / 1000 - self.origin for e in events
                  if e.queue == ALO and e.type is EventType.ACKED],
            lost=[where[v][1] for v in r.alo_lost if v in where],
            duplicated=[sorted(seconds.get((ALO, str(v)), [0.0, 0.0]))[1]
                        for v, n in alo.items() if n > 1],
            amo_not_processed=[where[v][1] for v in published - set(amo) if v in where],
            amo_twice=[sorted(seconds.get((AMO, str(v)), [0.0, 0.0]))[1]
                       for v in r.amo_processed_twice],
            failures=failures)
        rows = fault_rows([(t, kind) for t, kind, _ in r.faults], timeline,
                          end=time.time() - self.origin)
        r.fault_table = [dataclasses.asdict(row) for row in rows]
        r.shard_failures = sum(f.failures for f in failures)
        r.shard_failures_after_input_faults = sum(
            row.shard_failures for row in rows if row.kind in ("poison", "journal_deleted"))
        r.shard_failures_unended = [f"shard {f.shard} from t={f.at:.1f}s" for f in failures
                                    if not f.ended]

    def _check_poison(self, events: list[Event]) -> None:
        r = self.result
        r.poison_bookmarks = list(self.poison)
        if not self.poison:
            return
        for queue in (ALO, AMO):
            r.poison_outcomes[queue] = [
                _said(e) for e in events if e.queue == queue and e.bookmark is not None
                and e.bookmark.format() in self.poison
                and e.type in (EventType.EXPIRED, EventType.ACKED,
                               EventType.DELIVERED_AT_MOST_ONCE)]
            r.poison_dead_letters[queue] = sum(
                1 for headers in self._read_headers(
                    TopicNames(self.settings.topic_prefix).dead_letter(queue))
                if headers.get(DLQ_REASON) == b"too_large")

    def _read_headers(self, topic: str) -> list[dict[str, bytes]]:
        """The headers of every record of a topic (none when it does not exist)."""
        consumer = Consumer({"bootstrap.servers": self.settings.bootstrap_servers,
                             "group.id": f"soak-{uuid.uuid4().hex}", "enable.auto.commit": False,
                             "isolation.level": "read_committed"})
        try:
            md = consumer.list_topics(topic, timeout=10).topics.get(topic)
            if md is None or md.error is not None:
                return []
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                    for p in md.partitions}
            consumer.assign([TopicPartition(topic, p, 0) for p in md.partitions])
            found: list[dict[str, bytes]] = []
            done = {p for p, end in ends.items() if end == 0}
            deadline = time.monotonic() + 30
            while len(done) < len(ends) and time.monotonic() < deadline:
                for m in consumer.consume(1000, 0.5):
                    if m.error() is None:
                        headers = m.headers() or []
                        found.append({k: bytes(v or b"") if not isinstance(v, str)
                                      else v.encode() for k, v in (
                                          headers.items() if isinstance(headers, dict)
                                          else headers)})
                        if (m.offset() or 0) >= ends[m.partition() or 0] - 1:
                            done.add(m.partition())
            return found
        finally:
            consumer.close()

    def _check_doomed(self, events: list[Event], processed: Counter[str]) -> None:
        """Entries admitted from a journal before it was deleted each have one outcome in
        the events written before it was made again (acked, or expired journal_deleted);
        every record published after the last making again was processed. Bookmarks repeat
        across the journal's lives (offsets start from 0 again), hence the split by time."""
        r = self.result
        lives = [0, *self.recreated_ms]
        outcomes: dict[tuple[int, str], int] = {}
        admitted: set[tuple[int, str]] = set()
        for e in events:
            if e.queue != DOOMED or e.bookmark is None:
                continue
            life = sum(1 for start in lives if e.timestamp_ms >= start) - 1
            if life >= len(self.recreated_ms):
                continue  # the journal made again: judged by its records, below
            key = (life, e.bookmark.format())
            if e.type is EventType.ENQUEUED:
                admitted.add(key)
            elif e.type in (EventType.ACKED, EventType.EXPIRED):
                outcomes[key] = outcomes.get(key, 0) + 1
                if e.type is EventType.EXPIRED and e.reason == "journal_deleted":
                    r.deleted_journal_expired += 1
        r.deleted_journal_entries_without_one_outcome = sum(
            1 for key in admitted if outcomes.get(key, 0) != 1)
        if self.recreated_ms:
            r.deleted_journal_published = len(self.doomed_before)
            r.deleted_journal_admitted = len(admitted)
        if self.recreated_ms:
            r.deleted_journal_recreated_published = len(self.doomed_after)
            r.deleted_journal_recreated_not_processed = sum(
                1 for v in self.doomed_after if not processed[v])

    def _shard_failures(self) -> list[ShardFailure]:
        found: list[ShardFailure] = []
        for name in self.coordinators:
            log = self.logs / f"{name}.log"
            if log.exists():
                found += shard_failures(log.read_text(encoding="utf-8",
                                                      errors="replace").splitlines(),
                                        self.origin)
        return sorted(found, key=lambda f: f.at)

    def _audit(self) -> None:
        """`qlayer pipeline reconcile` of both queues, as an operator would run it after the
        soak: the journal, the events and PostgreSQL compared entry by entry. The doomed
        queue is not audited: its journal was deleted, so its old entries' records are gone
        and their bookmarks name records of the journal made again (docs/development.md)."""
        began = time.monotonic()
        for queue in (ALO, AMO):
            done = subprocess.run(
                [sys.executable, "-m", "layer_cli.main", "pipeline", "reconcile", queue,
                 "--journal", self.journal, "--json"],
                env=_env(self.settings), capture_output=True, text=True, timeout=900,
                check=False)
            (self.logs / f"reconcile-{queue}.log").write_text(
                done.stdout + "\n" + done.stderr, encoding="utf-8")
            verdict = audit_verdict(queue, done.returncode, done.stdout, done.stderr)
            self.say(f"reconcile {queue}: {verdict.done} done, {verdict.pending} pending, "
                     f"{len(verdict.violations)} violations"
                     + (f" ({verdict.error})" if verdict.error else ""))
            self.result.audit.append(dataclasses.asdict(verdict))
            self.result.audit_violations += len(verdict.violations)
        self.result.audit_seconds = round(time.monotonic() - began, 1)

    def _bookmarks_of(self, published: set[int]) -> dict[int, tuple[str, float]]:
        """Each published record's bookmark and when it was journaled (seconds since the
        first record), read back from the journal; the poison records are passed over."""
        consumer = Consumer({"bootstrap.servers": self.settings.bootstrap_servers,
                             "group.id": f"soak-{uuid.uuid4().hex}",
                             "auto.offset.reset": "earliest", "enable.auto.commit": False})
        consumer.subscribe([self.journal])
        found: dict[int, tuple[str, float]] = {}
        deadline = time.monotonic() + 60
        while len(found) < len(published) and time.monotonic() < deadline:
            for m in consumer.consume(10_000, 0.5):
                value = m.value() if m.error() is None else None
                if value and value.isdigit():
                    found[int(value)] = (f"{m.topic()}/{m.partition()}/{m.offset()}",
                                         m.timestamp()[1] / 1000 - self.origin)
        consumer.close()
        return found


def _said(e: Event) -> str:
    """An event as the soak prints it: TYPE(reason)@ms consumer."""
    return (f"{e.type}{'(' + e.reason + ')' if e.reason else ''}@{e.timestamp_ms}"
            f"{' ' + e.consumer_id if e.consumer_id else ''}")


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
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help="(default: %(default)s)")
        else:
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
               if k not in ("plan", "faults", "alo_lost", "amo_processed_twice", "histories",
                            "fault_table", "audit")}
    for key, value in summary.items():
        say(f"{key:36} {value}")
    for verdict in result.audit:
        say(f"audit {verdict['queue']}: {verdict['done']} done, {verdict['pending']} pending, "
            f"{len(verdict['violations'])} violations")
    for line in table([FaultRow(**row) for row in result.fault_table]):
        say(line)
    problems = result.problems()
    for p in problems:
        say(f"PROBLEM: {p}")
    for entry, seen in result.histories.items():
        say(f"events of {entry}: {' '.join(seen) or 'none'}")
    say("passed" if not problems else f"FAILED ({len(problems)} problems); logs in {state_dir}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
