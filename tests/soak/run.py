"""The fault-injection soak (issue 15): `make soak`, or `python -m tests.soak.run [options]`.

It starts a stack of its own (a Kafka broker and a PostgreSQL server as local processes, in a
temporary state directory, on free ports) because it kills them; coordinators (`qlayer
coordinator run`, one owner and hot standbys) and SDK consumer processes
(`tests/soak/worker.py`). A producer publishes numbered records at a fixed rate to one journal
that two queues read: one at-least-once, one at-most-once. Meanwhile, at seeded random times,
it SIGKILLs coordinators (and starts them again), SIGKILLs consumers (and starts new ones),
SIGKILLs the broker and crashes PostgreSQL (`pg_ctl stop -m immediate`), each for a while, then
starts them again, as an operator's supervisor would. It also publishes a poison record (larger
than the delivery topics take) to the journal, deletes (and makes again) the journal of a
third, at-least-once queue while its entries are queued and leased, and lets a hostile tenant
write what it may to the control and ack topics (`tests/soak/hostile.py`) while the
at-least-once queue serves as the canary.

When every record is published and every fault done, it waits until both queues' recovery
points in PostgreSQL reach the journal's end, stops everything and checks what a user would,
as sets, naming what differs (`tests/soak/checks.py`; docs/development.md defines each):

- publishing: every value attempted, and every one the broker confirmed; the journal read
  back to its end. A confirmed value missing from the journal is a problem; an unconfirmed
  one is reported, and must be processed if it is in the journal anyway;
- at-least-once: every value that must be processed (confirmed, or journaled) was processed
  (recorded by a consumer) at least once; every entry of a published value has exactly one
  ACKED event, every ACKED event names such an entry, and none is leased again after it;
- at-most-once: no record was processed twice, and none delivered twice (LEASED events);
- both queues admitted (ENQUEUED) every record of the journal;
- no coordinator exited on its own (consumers that did are counted, and replaced);
- the poison record left both queues dead-lettered with reason ``too_large``; every entry of
  the deleted journal expired with reason ``journal_deleted``, every record of the journal
  made again was processed; no shard failure (a rebuild) is charged to either, none falls
  outside every fault's window, and no shard failed until the end (a rebuild loop);
- the hostile tenant's phase: the canary's worst gap in its window at most 1 s, every hostile
  record refused and counted by the shards, none changing a soak consumer's session, nothing
  of it in the journal or the events but refusals, no shard failure charged to it
  (checks.py `hostile_problems`);
- `qlayer pipeline reconcile` (Spark) finds no violation in either queue, nothing pending,
  and exactly the journal's entries done: its count and its per-entry output.

It prints a table per fault (unconfirmed, lost, duplicated, the pause in acks and the recovery
time, the shard failures charged to it by its window, the canary's worst gap:
`tests/soak/report.py`).

The figures and the fault log go to ``--output`` (JSON); the exit status is 1 when a check
failed. The integration test `tests/integration/test_soak.py` runs a short plan of it in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from layer.kafka.logs import logged
from layer.localstack import StackConfig
from layer.localstack.process import LocalStackError
from layer.localstack.stack import Endpoints, LocalStack
from layer.protocol import Codec, Event, EventType, ProtocolError, SchemaKind, TopicNames
from layer.protocol.headers import DLQ_REASON
from layer.sdk import QueueConsumer
from layer.services.principals import PrincipalService
from layer.settings import Settings
from layer.store import migrate
from layer.store.rows import PartitionKey
from layer.store.store import Store
from tests.soak.checks import (
    HostileOutcome,
    Seen,
    audit_check,
    canary_gap,
    hostile_events,
    hostile_problems,
    increments,
    lost,
    match_acked,
    not_published,
    processed_lines,
    publish_figures,
    refusals_missing,
)
from tests.soak.hostile import HostileTenant, Victim
from tests.soak.report import (
    FAULT_KINDS,
    KINDS,
    Fault,
    FaultRow,
    ShardFailure,
    Timeline,
    audit_verdict,
    charged_to,
    fault_rows,
    quiet_from,
    shard_failures,
    table,
    unexplained,
    worst_gap,
)
from tests.support.coordinator import put_queues
from tests.support.kafka import create_topic
from tests.support.ports import PortReservation, reserve_ports
from tests.support.processes import CoordinatorSubprocess, Subprocess, _env

#: Below Linux's ephemeral port range (32768-60999), so no client connection holds them.
KAFKA_PORTS_FROM = 30_092
POSTGRES_PORTS_FROM = 30_532

ALO = "SoakAtLeastOnce"
AMO = "SoakAtMostOnce"
#: At-least-once, on a journal of its own: the one the soak deletes and makes again.
DOOMED = "SoakDeletedJournal"
#: For the hostile tenant, on an empty journal of their own: a queue granted to a principal
#: (closed to anonymous consumers, so never one of the soak's own queues) and an open queue
#: on a shard the soak's queues are not on (all three hash to shard 0 of 4).
GRANTED, ELSEWHERE, PRINCIPAL = "SoakGranted", "SoakElsewhere", "soaktenant"
SHARDS = 4
#: How long the hostile phase waits for the shards to count every record it wrote (seconds).
HOSTILE_WAIT = 60.0

#: The journal takes records up to this size; the coordinator's producer writes 1 MB at most,
#: so the poison record (1.5 MB) can be journaled and never delivered (`too_large`).
JOURNAL_MAX_BYTES = 3_000_000
POISON_BYTES = 1_500_000
#: Records on the doomed journal: some at the start, more just before it is deleted, some
#: after it is made again; and how many of its entries are leased (to a consumer that never
#: acks them) when it is deleted. Until it is deleted the queue has no other consumer, so every
#: entry is queued or leased then: each must expire with reason journal_deleted.
DOOMED_BEFORE, DOOMED_BURST, DOOMED_AFTER, DOOMED_HELD = 100, 400, 100, 10
#: How long a poison record's action waits for both queues to dead-letter it, and the deleted
#: journal's for the coordinator to admit the records of the journal made again (seconds):
#: the action, and so the fault's window, lasts until the coordinators have dealt with it.
POISON_WAIT, RECREATED_WAIT = 180.0, 60.0


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
    #: Hostile tenant phases (tests/soak/hostile.py): filters over the limits, an ack flood,
    #: forged, malformed and oversized records and wrong credentials, within seconds, while
    #: the at-least-once queue is the canary.
    hostile_phases: int = 1
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
    #: Instead of the above: the exactly-once scenario (issue 34, tests/soak/exactly_once.py):
    #: ``messages`` inputs (give 20000) through transactional consume-transform-produce
    #: workers SIGKILLed at every point of their processing, one paused past its lease, the
    #: coordinator SIGKILLed ``coordinator_kills`` times; every result must be there once.
    exactly_once: bool = False

    def faults(self) -> list[tuple[float, str]]:
        """(seconds after the first record, fault) for every fault, in time order: spread
        over the middle 80 % of the publishing time, jittered by the seed. A fault starts at
        its time or, after an input fault or an outage, once `quiet_from` allows it."""
        kinds = [k.name for k in FAULT_KINDS for _ in range(getattr(self, k.plan_field))]
        rng = random.Random(self.seed)
        rng.shuffle(kinds)
        span = self.messages / self.rate
        slot = 0.8 * span / max(1, len(kinds))
        return [(0.1 * span + (i + rng.random() * 0.5) * slot, kind)
                for i, kind in enumerate(kinds)]


@dataclass
class SoakResult:
    plan: dict[str, Any]
    #: Publishing (tests/soak/checks.py `PublishFigures`): values attempted and confirmed,
    #: delivery reports with an error by error name, and the differences with the journal.
    attempted: int = 0
    confirmed: int = 0
    publish_errors: dict[str, int] = field(default_factory=dict)
    unconfirmed_journaled: list[int] = field(default_factory=list)
    unconfirmed_not_journaled: list[int] = field(default_factory=list)
    confirmed_not_journaled: list[int] = field(default_factory=list)
    journaled_not_attempted: list[int] = field(default_factory=list)
    #: Values at two places in the journal (the idempotent producer should make none):
    #: reported; each place is an entry and is checked as one.
    journaled_twice: list[int] = field(default_factory=list)
    #: Whether the journal and the events topic were read to their ends (a check made on a
    #: part of them would pass on what it did not read).
    journal_read_complete: bool = False
    events_read_complete: bool = False
    #: Each fault as it happened (`Fault`: exact start and end, seconds since the first record).
    faults: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    drained: bool = False
    #: At-least-once: the values that had to be processed, those processed (times), the
    #: values lost, processed more than once, and processed though never journaled.
    alo_must_process: int = 0
    alo_processed: int = 0
    alo_lost: list[int] = field(default_factory=list)
    alo_processed_twice: int = 0
    alo_processed_not_journaled: list[int] = field(default_factory=list)
    amo_processed: int = 0
    amo_processed_twice: list[int] = field(default_factory=list)
    amo_not_processed: int = 0
    amo_processed_not_journaled: list[int] = field(default_factory=list)
    #: Consumer output lines passed over (cut short by a SIGKILL).
    partial_lines: list[str] = field(default_factory=list)
    #: The at-least-once entries (bookmarks) of published values, and the ACKED events
    #: matched to them: entries without one, with two or more, and ACKED events naming no
    #: such entry.
    alo_entries: int = 0
    alo_entries_without_acked_event: list[str] = field(default_factory=list)
    alo_entries_acked_twice: list[str] = field(default_factory=list)
    acked_events_unknown: list[str] = field(default_factory=list)
    entries_leased_after_acked: list[str] = field(default_factory=list)
    amo_entries_leased_twice: list[str] = field(default_factory=list)
    #: Per queue: journal records (published values and poison) without an ENQUEUED event.
    not_admitted: dict[str, list[str]] = field(default_factory=dict)
    coordinator_unplanned_exits: list[str] = field(default_factory=list)
    consumer_unplanned_exits: list[str] = field(default_factory=list)
    #: For a few records that fail a check: their events, in order.
    histories: dict[str, list[str]] = field(default_factory=dict)
    #: Poison records: their bookmarks (the journal's records that are not numbers), those the
    #: producer reported and the journal lacks, each queue's outcome events of them
    #: (``EXPIRED(too_large)``...), and the dead letters with reason too_large per queue.
    poison_bookmarks: list[str] = field(default_factory=list)
    poison_reported_not_journaled: list[str] = field(default_factory=list)
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
    #: Per deletion: seconds until the coordinator admitted every record of the journal made
    #: again, None when it had not after RECREATED_WAIT. Processed at the end is not enough:
    #: a journal made again that only a later shard takeover reads (a coordinator SIGKILL
    #: after the deletion) passed that check while the queue's owner never read it.
    deleted_journal_recreated_admitted_after: list[float | None] = field(default_factory=list)
    #: Shard failures (each a rebuild from stored state) in the coordinators' logs: how many
    #: in all; the runs charged to an input fault, and those no fault's window holds
    #: (report.py `charged_to`), and runs that never ended (a shard failing until the
    #: coordinator stopped), each said with its time, reason and log.
    shard_failures: int = 0
    shard_failures_after_input_faults: list[str] = field(default_factory=list)
    shard_failures_unexplained: list[str] = field(default_factory=list)
    shard_failures_unended: list[str] = field(default_factory=list)
    #: What followed each fault (tests/soak/report.py `FaultRow`).
    fault_table: list[dict[str, Any]] = field(default_factory=list)
    #: `qlayer pipeline reconcile` of each queue against the journal's entries
    #: (tests/soak/checks.py `AuditCheck`), and how many violations it found in all.
    audit: list[dict[str, Any]] = field(default_factory=list)
    audit_violations: int = 0
    audit_seconds: float = 0.0
    #: Each hostile phase and what it changed (tests/soak/checks.py `HostileOutcome`).
    hostile: list[dict[str, Any]] = field(default_factory=list)

    def problems(self) -> list[str]:
        found = []

        def some(values: list[Any]) -> str:
            return f"{len(values)}, e.g. {values[:10]}"

        if not self.drained:
            found.append("the queues were not drained in time (recovery points short of the "
                         "journal's end)")
        if not self.journal_read_complete:
            found.append("the journal was not read back to its end: the checks against it "
                         "are incomplete")
        if not self.events_read_complete:
            found.append("the events topic was not read to its end: the checks against it "
                         "are incomplete")
        if self.confirmed_not_journaled:
            found.append("values the broker confirmed and the journal lacks: "
                         + some(self.confirmed_not_journaled))
        if self.journaled_not_attempted:
            found.append("values in the journal never attempted: "
                         + some(self.journaled_not_attempted))
        if self.alo_lost:
            found.append("at-least-once values never processed (lost): " + some(self.alo_lost))
        if self.alo_processed_not_journaled:
            found.append("at-least-once values processed that are not in the journal: "
                         + some(self.alo_processed_not_journaled))
        if self.amo_processed_twice:
            found.append("at-most-once values processed twice: "
                         + some(self.amo_processed_twice))
        if self.amo_processed_not_journaled:
            found.append("at-most-once values processed that are not in the journal: "
                         + some(self.amo_processed_not_journaled))
        for queue, missing in self.not_admitted.items():
            if missing:
                found.append(f"{queue}: journal records without an ENQUEUED event: "
                             + some(missing))
        if self.alo_entries_without_acked_event:
            found.append("at-least-once entries without an ACKED event: "
                         + some(self.alo_entries_without_acked_event))
        if self.alo_entries_acked_twice:
            found.append("at-least-once entries with two or more ACKED events: "
                         + some(self.alo_entries_acked_twice))
        if self.acked_events_unknown:
            found.append("ACKED events for a bookmark that is no entry of a published value: "
                         + some(self.acked_events_unknown))
        if self.entries_leased_after_acked:
            found.append("entries leased after their ACKED: "
                         + some(self.entries_leased_after_acked))
        if self.amo_entries_leased_twice:
            found.append("at-most-once entries leased twice: "
                         + some(self.amo_entries_leased_twice))
        if self.coordinator_unplanned_exits:
            found.append("coordinators exited on their own: "
                         + "; ".join(self.coordinator_unplanned_exits))
        if self.plan.get("poison_records") and not self.poison_bookmarks:
            found.append("no poison record is in the journal: its checks did not run")
        if self.poison_reported_not_journaled:
            found.append("poison records the producer reported and the journal lacks: "
                         + some(self.poison_reported_not_journaled))
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
        if None in self.deleted_journal_recreated_admitted_after:
            found.append(f"the journal made again was not read: its records were not all "
                         f"admitted within {RECREATED_WAIT:.0f}s of being published (each "
                         f"deletion, seconds: {self.deleted_journal_recreated_admitted_after})")
        if self.deleted_journal_recreated_not_processed:
            found.append(f"{self.deleted_journal_recreated_not_processed} records of the "
                         "journal made again never processed")
        if self.shard_failures_after_input_faults:
            found.append("shard failures (rebuilds) charged to a poison record, a journal "
                         "deletion or the hostile tenant: "
                         + "; ".join(self.shard_failures_after_input_faults))
        if self.shard_failures_unexplained:
            found.append("shard failures (rebuilds) outside every fault's window: "
                         + "; ".join(self.shard_failures_unexplained))
        if self.shard_failures_unended:
            found.append("shards failing until their coordinator stopped (a rebuild loop): "
                         + "; ".join(self.shard_failures_unended))
        if len(self.hostile) < (self.plan.get("hostile_phases") or 0):
            found.append(f"{len(self.hostile)} hostile phases ran, of "
                         f"{self.plan.get('hostile_phases')} planned")
        for outcome in self.hostile:
            found.extend(hostile_problems(HostileOutcome(**outcome)))
        if self.plan.get("audit") and not self.audit:
            found.append("the audit was asked for and did not run")
        for check in self.audit:
            found.extend(check["problems"])
        return found


class Publisher(threading.Thread):
    """Publishes 0..n-1 at a fixed rate; librdkafka keeps retrying through a broker outage.

    It records every value it hands to the producer (``attempted_at``: value → seconds after
    its start) and the broker's answer for each: confirmed (a delivery report without an
    error) or failed (its error's name); a value neither is one whose report never came."""

    def __init__(self, bootstrap: str, topic: str, plan: SoakPlan) -> None:
        super().__init__(daemon=True, name="soak-publisher")
        self.topic, self.plan = topic, plan
        self.producer = Producer(logged({"bootstrap.servers": bootstrap, "linger.ms": 5,
                                  "enable.idempotence": True,
                                  "message.timeout.ms": 900_000,
                                  # The outages are on purpose: not a line per retry.
                                  "log_level": 2}))
        self.attempted_at: list[float] = []
        self.confirmed: set[int] = set()
        self.failed: dict[int, str] = {}
        self.started = 0.0

    @property
    def errors(self) -> Counter[str]:
        return Counter(self.failed.values())

    def _report(self, err: KafkaError | None, msg: Message) -> None:
        value = int(msg.value() or b"-1")
        if err is None:
            self.confirmed.add(value)
        else:
            self.failed[value] = err.name()

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
            # Attempted once the producer holds it: from here it may reach the journal.
            self.attempted_at.append(time.monotonic() - self.started)
            self.producer.poll(0)
        while self.producer.flush(5) > 0:
            pass


class Soak:
    def __init__(self, plan: SoakPlan, state_dir: Path, say: Callable[[str], None],
                 keep_stack: bool = False) -> None:
        self.plan, self.state_dir, self.say, self.keep_stack = plan, state_dir, say, keep_stack
        #: The stack's ports, reserved while it runs: the soak kills its broker and PostgreSQL,
        #: and while they are down nothing else may take their ports (tests/support/ports.py).
        self.reserved: list[PortReservation] = []
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
        #: The faults done so far, with their exact start and end (seconds since the first
        #: record, on the soak's monotonic clock: `_now`).
        self.done_faults: list[Fault] = []
        self.started = 0.0
        #: Each hostile phase's outcome as its action left it; the final check adds what
        #: only the end can show (the canary, the events, the journal).
        self.hostile_outcomes: list[HostileOutcome] = []
        #: The hostile tenant's consumer ids and sessions (its events must be refusals), and
        #: the principal's credential it is refused without.
        self.hostile_ids: list[str] = []
        self.hostile_sessions: list[str] = []
        self.victims: list[Victim] = []
        self.credential = ""

    def _stack(self, kafka_from: int, postgres_from: int) -> LocalStack:
        for reservation in self.reserved:
            reservation.release()
        self.reserved = [reserve_ports(kafka_from, 2), reserve_ports(postgres_from, 1)]
        kafka_port, pg_port = (r.first for r in self.reserved)
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

    #: What each kind of fault (report.py `FAULT_KINDS`) does: the method that does it,
    #: returns when it is over and says what it did. A new kind is a method and a line here.
    ACTIONS: ClassVar[dict[str, str]] = {
        "coordinator": "_kill_coordinator", "consumer": "_kill_consumer",
        "broker": "_kill_broker", "postgres": "_crash_postgres", "poison": "_poison",
        "journal_deleted": "_delete_journal", "hostile": "_hostile"}
    #: What must hold before a fault of a kind starts, its window with it: a method that waits
    #: for it (the soak's consumers subscribed, for a phase judged by the canary: their
    #: start-up is no gap of its).
    PREPARE: ClassVar[dict[str, str]] = {"hostile": "_await_victims"}

    def _now(self) -> float:
        """Seconds since the first record, exact (the faults' and the logs' time axis)."""
        return time.monotonic() - self.started

    def _fault(self, kind: str) -> Fault:
        """Does one fault and says when it began and ended, exactly: the start is taken just
        before its action, the end just after it (the process or server started again, the
        poison record dead-lettered, the journal made again and read)."""
        if kind in self.PREPARE:
            getattr(self, self.PREPARE[kind])()
        at = self._now()
        what: str = getattr(self, self.ACTIONS[kind])()
        return Fault(at, self._now(), kind, what)

    def _kill_coordinator(self) -> str:
        name = self.rng.choice(sorted(self.coordinators))
        proc = self.coordinators[name]
        self.planned_exits.add(proc.pid)
        proc.kill()
        time.sleep(1.0)
        self._start_coordinator(name)
        return f"SIGKILL coordinator {name} (pid {proc.pid}), started again"

    def _kill_consumer(self) -> str:
        name = self.rng.choice(sorted(self.workers))
        worker, _, queues = self.workers.pop(name)
        self.planned_exits.add(worker.pid)
        worker.kill()
        self._start_worker(queues)
        return f"SIGKILL {name} (pid {worker.pid}), a new consumer started"

    def _kill_broker(self) -> str:
        pid = self.stack.kafka.kill()
        self._sleep_supervised(self.plan.outage)
        self.stack.kafka.up()
        return f"SIGKILL broker (pid {pid}), down {self.plan.outage:.0f}s, started again"

    def _crash_postgres(self) -> str:
        self.stack.postgres.crash()
        self._sleep_supervised(self.plan.outage)
        self.stack.postgres.up()
        return f"PostgreSQL stopped -m immediate, down {self.plan.outage:.0f}s, started again"

    def _poison(self) -> str:
        """A record the journal takes and the delivery topics do not: it must be
        dead-lettered (reason too_large) by both queues, and cost no shard a rebuild. Over
        once both queues counted it dead-lettered (POISON_WAIT at most): a coordinator behind
        the journal (after an outage) meets it late, and a failure it causes then must still
        be in its window."""
        where: list[str] = []

        def report(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                where.append(f"{msg.topic()}/{msg.partition()}/{msg.offset()}")

        before = {q: self._counter_now(q, "dead_lettered") for q in (ALO, AMO)}
        producer = Producer(logged({"bootstrap.servers": self.settings.bootstrap_servers,
                             "message.max.bytes": JOURNAL_MAX_BYTES, "log_level": 2}))
        producer.produce(self.journal, os.urandom(POISON_BYTES), key=b"poison",
                         on_delivery=report)
        producer.flush(60)
        published = time.monotonic()
        left = dict(before)
        while left and time.monotonic() < published + POISON_WAIT:
            self._sleep_supervised(0.5)
            left = {q: n for q, n in left.items()
                    if (self._counter(q, "dead_lettered") or 0) <= n}
        self.poison.extend(where)
        took = time.monotonic() - published
        dealt = (f"dead-lettered by both queues within {took:.1f}s" if not left else
                 f"NOT dead-lettered by {', '.join(sorted(left))} within {POISON_WAIT:.0f}s")
        if not where:
            return f"poison record NOT confirmed by the broker; {dealt}"
        return f"poison record of {POISON_BYTES} bytes published at {where[0]}; {dealt}"

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
            admin = AdminClient(logged({"bootstrap.servers": bootstrap}))
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
        # Over once the journal made again is read (its records admitted): a failure reading
        # it is this fault's, so its window must reach that far.
        recreated = time.monotonic()
        want = len(self.doomed_before) + len(self.doomed_after)
        while (self._doomed_counter("enqueued") < want
               and time.monotonic() < recreated + RECREATED_WAIT):
            self._sleep_supervised(0.5)
        admitted = self._doomed_counter("enqueued") >= want
        self.result.deleted_journal_recreated_admitted_after.append(
            round(time.monotonic() - recreated, 1) if admitted else None)
        return (f"journal {self.doomed} deleted ({len(self.doomed_before)} records, {held} "
                f"entries leased); {expired} entries expired journal_deleted within "
                f"{seen:.0f}s; made again, {DOOMED_AFTER} records published, "
                + (f"admitted within {time.monotonic() - recreated:.1f}s" if admitted
                   else f"NOT all admitted within {RECREATED_WAIT:.0f}s"))

    def _hostile(self) -> str:
        """A hostile tenant's records (tests/soak/hostile.py) against every live session of
        the soak's consumers, within seconds; over once the shards counted every one as
        refused (`HOSTILE_WAIT` at most), so that the window covers their reading them."""
        load = [round(os.getloadavg()[0], 2)]
        victims = self.victims
        before = self._shard_counters_now()
        tenant = HostileTenant(self.settings.bootstrap_servers, self.settings.topic_prefix,
                               SHARDS, journal=self.journal, queue=ALO, granted=GRANTED,
                               elsewhere=ELSEWHERE, principal=PRINCIPAL,
                               credential=self.credential, say=self.say)
        attack = tenant.run(victims)
        wrote = time.monotonic()
        counted: dict[str, int] = {}
        while True:
            now = self._shard_counters()
            if now is not None:
                counted = increments(before, now)
                if not refusals_missing(attack.expected, counted):
                    break
            if time.monotonic() > wrote + HOSTILE_WAIT:
                break
            self._sleep_supervised(0.5)
        took = time.monotonic() - wrote
        missing = refusals_missing(attack.expected, counted)
        live = {(r.consumer_id, r.session_id) for r in self._consumers()}
        load.append(round(os.getloadavg()[0], 2))
        self.hostile_outcomes.append(HostileOutcome(
            at=0.0, end=0.0, closes=0.0, expected=attack.expected, counted=counted,
            answers=attack.answers, replies=attack.replies,
            broker_refused=attack.broker_refused, records=attack.records,
            wrote_for=attack.wrote_for,
            victims=[[v.consumer_id, v.session_id] for v in victims],
            victims_gone=[f"{v.consumer_id}/{v.session_id}" for v in victims
                          if (v.consumer_id, v.session_id) not in live],
            load=load))
        self.hostile_ids += attack.consumer_ids
        self.hostile_sessions += attack.sessions
        refused = sum(1 for rid, (_, status) in attack.answers.items()
                      if attack.replies.get(rid) == status)
        return (f"hostile tenant: {attack.records} records in {attack.wrote_for:.1f}s against "
                f"{len(victims)} live sessions; {refused} of its {len(attack.answers)} own "
                "Subscribes answered as they must be; "
                + (f"every record counted refused within {took:.1f}s" if not missing else
                   f"NOT all counted within {HOSTILE_WAIT:.0f}s: {missing}"))

    def _await_victims(self) -> None:
        """The victims of the next hostile phase, once the soak's consumers subscribed."""
        began = time.monotonic()
        self.victims = self._victims()
        self.say(f"hostile tenant: {len(self.victims)} live sessions of soak consumers after "
                 f"{time.monotonic() - began:.1f}s")

    def _victims(self, wait: float = 30.0) -> list[Victim]:
        """Every live, proven session of a running soak consumer (the consumer ids its
        worker wrote, the sessions the store has); waiting (``wait`` seconds at most) for
        workers started a moment ago (after a consumer SIGKILL) to subscribe."""
        until = time.monotonic() + wait
        while True:
            ids: set[str] = set()
            starting = 0
            for worker, out, _ in self.workers.values():
                path = out.with_suffix(".ids")
                if worker.proc.poll() is not None:
                    continue
                if not path.exists():
                    starting += 1
                    continue
                ids.update(line.split("\t")[1] for line in
                           path.read_text(encoding="utf-8").splitlines() if "\t" in line)
            found = [Victim(r.consumer_id, r.session_id, r.queue, r.shard)
                     for r in self._consumers() if r.consumer_id in ids
                     and r.secret_hash is not None and r.shard is not None]
            if (not starting and len(found) == len(ids)) or time.monotonic() > until:
                return found
            self._sleep_supervised(0.5)

    def _consumers(self) -> list[Any]:
        try:
            with Store(self.settings.database_url) as store:
                return list(store.load_consumers())
        except Exception:  # PostgreSQL may be restarting: none known now
            return []

    def _shard_counters(self) -> dict[str, int] | None:
        """The shards' stored counters added up (refusals included: `refused:KIND:REASON:
        PRINCIPAL`); None when PostgreSQL does not answer now."""
        try:
            with Store(self.settings.database_url) as store:
                stored = store.all_shard_counters()
        except Exception:  # PostgreSQL may be restarting: asked again
            return None
        total: Counter[str] = Counter()
        for counters in stored.values():
            total.update(counters)
        return dict(total)

    def _shard_counters_now(self) -> dict[str, int]:
        """`_shard_counters`, asked again (60 s at most) while PostgreSQL does not answer."""
        until = time.monotonic() + 60
        while True:
            found = self._shard_counters()
            if found is not None or time.monotonic() > until:
                return found or {}
            self._sleep_supervised(1.0)

    def _publish(self, topic: str, values: list[str]) -> None:
        """Published and confirmed, every one: the deleted journal's checks count on it."""
        failed: list[str] = []

        def report(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                failed.append(f"{(msg.value() or b'').decode()}: {err.name()}")

        producer = Producer(logged({"bootstrap.servers": self.settings.bootstrap_servers,
                             "linger.ms": 5, "log_level": 2}))
        for value in values:
            producer.produce(topic, value.encode(), on_delivery=report)
        if producer.flush(120) != 0:
            raise RuntimeError(f"records to {topic} not published in 120 s")
        if failed:
            raise RuntimeError(f"{len(failed)} records to {topic} not confirmed: {failed[:5]}")

    def _journal_deleted_count(self) -> int:
        return self._doomed_counter("journal_deleted")

    def _doomed_counter(self, name: str) -> int:
        return self._counter(DOOMED, name) or 0

    def _counter(self, queue: str, name: str) -> int | None:
        """A queue's counter in PostgreSQL; None when it cannot be read now (restarting)."""
        try:
            with Store(self.settings.database_url) as store:
                found = store.load_counters(queue).get(queue)
        except Exception:  # PostgreSQL may be restarting: asked again
            return None
        return 0 if found is None else int(getattr(found, name))

    def _counter_now(self, queue: str, name: str) -> int:
        """A queue's counter, asked again (60 s at most) while PostgreSQL does not answer: a
        0 read in an outage would make any later value look like a change."""
        until = time.monotonic() + 60
        while True:
            found = self._counter(queue, name)
            if found is not None or time.monotonic() > until:
                return found or 0
            self._sleep_supervised(1.0)

    def _sleep_supervised(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._supervise()
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))

    # --- the run ----------------------------------------------------------------------------

    def _journal_ends(self) -> dict[str, dict[int, int]]:
        """Each journal's end offset per partition, once everything is published; asked
        again while the broker, just started again, has no leader for a partition yet."""
        consumer = Consumer(logged({"bootstrap.servers": self.settings.bootstrap_servers,
                             "group.id": f"soak-{uuid.uuid4().hex}"}))
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
            migrate.upgrade(self.settings.database_url, shard_count=SHARDS)
            journal = self.journal = f"soak-journal-{uuid.uuid4().hex[:6]}"
            self.doomed = f"soak-doomed-{uuid.uuid4().hex[:6]}"
            admin = AdminClient(logged({"bootstrap.servers": self.settings.bootstrap_servers}))
            config = {"max.message.bytes": str(JOURNAL_MAX_BYTES)}
            for future in admin.create_topics([NewTopic(journal, self.plan.partitions, 1,
                                                        config=config)]).values():
                future.result(30)
            # Gone now: kept for the whole run, its client wrote 31 raw librdkafka lines
            # ("%3|...|FAIL|rdkafka#producer-2|... Connection refused") into the soak's
            # output during the broker's outage.
            del admin
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
            if self.plan.hostile_phases:
                self._hostile_setup()
            self.doomed_after = [f"d{i}" for i in range(DOOMED_BEFORE)]
            self._publish(self.doomed, self.doomed_after)
            for i in range(self.plan.coordinators):
                self._start_coordinator(f"coordinator{i}")
            for _ in range(self.plan.consumers):
                self._start_worker()
            self._wait_for_settled_shards()
            publisher = Publisher(self.settings.bootstrap_servers, journal, self.plan)
            publisher.start()
            while not publisher.started:
                time.sleep(0.01)
            self.started = publisher.started
            # The epoch second of time 0: the coordinators' log lines are placed on the
            # soak's clock through it (the two readings are microseconds apart).
            self.origin = time.time() - (time.monotonic() - publisher.started)
            for at, kind in self.plan.faults():
                quiet = quiet_from(kind, self.done_faults)
                held = quiet - max(at, self._now())
                while self._now() < max(at, quiet):
                    self._supervise()
                    time.sleep(min(0.5, max(0.0, max(at, quiet) - self._now())))
                fault = self._fault(kind)
                if held > 0:
                    fault = dataclasses.replace(
                        fault, what=f"{fault.what} (held {held:.1f}s for an earlier fault's "
                                    "window)")
                self.done_faults.append(fault)
                self.result.faults.append(dataclasses.asdict(fault))
                self.say(f"t={fault.at:7.3f}s-{fault.end:7.3f}s {fault.what}")
            while publisher.is_alive():
                self._supervise()
                publisher.join(0.5)
            self.result.attempted = len(publisher.attempted_at)
            self.result.confirmed = len(publisher.confirmed)
            self.result.publish_errors = dict(publisher.errors)
            self.say(f"attempted {self.result.attempted} records, {self.result.confirmed} "
                     f"confirmed ({dict(publisher.errors) or 'no'} errors); draining")
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
            self._check(publisher)
            if self.plan.audit:
                self._audit()
        finally:
            self._stop_processes()
            if not self.keep_stack:
                self.stack.down()
                for reservation in self.reserved:
                    reservation.release()
            self.result.seconds = round(time.monotonic() - began, 1)
        return self.result

    def _wait_for_settled_shards(self, timeout: float = 90.0) -> None:
        """Time 0 once the coordinators' group has settled: every shard held, by as many
        processes as can hold one. The group's first rebalance (a second coordinator joining
        takes half the shards from the first: seconds without service for their queues) is
        start-up, not a fault; a CI run (stop 41) measured the hostile tenant's canary across
        it and charged the tenant with a 1.35 s gap the shard's move made."""
        assert self.settings is not None
        holders = min(self.plan.coordinators, SHARDS)
        deadline = time.monotonic() + timeout
        with Store(self.settings.database_url) as store:
            while True:
                owners = {o.shard: o.owner_id for o in store.owners() if o.shard.isdigit()}
                if len(owners) == SHARDS and len(set(owners.values())) == holders:
                    self.say(f"shards settled: {dict(sorted(owners.items()))}")
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the coordinators' group did not settle within {timeout:.0f}s: "
                        f"shard owners {owners}, {holders} processes expected to hold shards")
                self._supervise()
                time.sleep(0.2)

    def _hostile_setup(self) -> None:
        """The hostile tenant's targets: a queue granted to a principal (as `qlayer security
        principal add` makes one) and an open queue on another shard than the soak's, on an
        empty journal of their own (nothing is ever leased from them)."""
        side = f"soak-side-{uuid.uuid4().hex[:6]}"
        create_topic(self.settings.bootstrap_servers, side, 1)
        put_queues(self.settings,
                   {"name": GRANTED, "underlying_topic": side, "shard": 2},
                   {"name": ELSEWHERE, "underlying_topic": side, "shard": 1})
        with Store(self.settings.database_url) as store:
            self.credential = str(PrincipalService(store=store).add(PRINCIPAL, [GRANTED]))

    def _stop_processes(self) -> None:
        for worker, _, _ in self.workers.values():
            self.planned_exits.add(worker.pid)
            worker.stop()
        for proc in self.coordinators.values():
            self.planned_exits.add(proc.pid)
            proc.stop()

    def _check(self, publisher: Publisher) -> None:
        """Every check of tests/soak/checks.py on what the soak recorded, the journal read
        back and the events."""
        r = self.result
        journal = self._read_journal()
        # Every queue's events, the hostile tenant's targets' too; each check below takes
        # its queue's.
        events, r.events_read_complete, foreign = self._read_events()
        r.journal_read_complete = journal.complete
        processed = processed_lines(
            [out.read_text(encoding="utf-8", errors="replace") for out in self.outputs],
            (ALO, AMO, DOOMED))
        r.partial_lines = processed.partial
        figures = publish_figures(range(len(publisher.attempted_at)), publisher.confirmed,
                                  journal.values)
        r.unconfirmed_journaled = figures.unconfirmed_journaled
        r.unconfirmed_not_journaled = figures.unconfirmed_not_journaled
        r.confirmed_not_journaled = figures.confirmed_not_journaled
        r.journaled_not_attempted = figures.journaled_not_attempted
        r.journaled_twice = sorted(v for v, places in journal.values.items() if len(places) > 1)
        alo = Counter({int(v): n for v, n in processed.counts[ALO].items() if v.isdigit()})
        amo = Counter({int(v): n for v, n in processed.counts[AMO].items() if v.isdigit()})
        r.alo_must_process = len(figures.must_process)
        r.alo_processed = sum(alo.values())
        r.alo_lost = lost(figures.must_process, alo)
        r.alo_processed_twice = sum(1 for n in alo.values() if n > 1)
        r.alo_processed_not_journaled = not_published(alo, figures.journaled)
        r.amo_processed = sum(amo.values())
        r.amo_processed_twice = sorted(v for v, n in amo.items() if n > 1)
        amo_missed = sorted(figures.must_process - set(amo))
        r.amo_not_processed = len(amo_missed)
        r.amo_processed_not_journaled = not_published(amo, figures.journaled)
        # The entries of published values (a value journaled twice is two entries).
        entries = {b for places in journal.values.values() for b, _ in places}
        r.alo_entries = len(entries)
        poison = {b for b, _ in journal.others}
        r.poison_bookmarks = sorted(poison)
        #: What the audit must find done: every entry of the journal.
        self.expected_entries = entries | poison
        r.poison_reported_not_journaled = sorted(set(self.poison) - poison)
        history: dict[str, list[str]] = {}
        acked: Counter[str] = Counter()
        acked_at: dict[str, int] = {}
        leased_after: set[str] = set()
        amo_leased: Counter[str] = Counter()
        enqueued: dict[str, set[str]] = {ALO: set(), AMO: set()}
        for e in events:
            if e.bookmark is None or e.queue not in enqueued:
                continue
            key = e.bookmark.format()
            if e.queue == ALO:
                history.setdefault(key, []).append(_said(e))
            if e.type is EventType.ENQUEUED:
                enqueued[e.queue].add(key)
            elif e.queue == ALO and e.type is EventType.ACKED:
                acked[key] += 1
                acked_at[key] = min(acked_at.get(key, e.timestamp_ms), e.timestamp_ms)
            elif e.queue == AMO and e.type is EventType.LEASED:
                amo_leased[key] += 1
        # Leased after its first ACKED, by time, whatever order the events were read in.
        for e in events:
            if (e.queue == ALO and e.type is EventType.LEASED and e.bookmark is not None
                    and e.timestamp_ms > acked_at.get(e.bookmark.format(), e.timestamp_ms)):
                leased_after.add(e.bookmark.format())
        matched = match_acked(entries, acked)
        r.alo_entries_without_acked_event = matched.without
        r.alo_entries_acked_twice = matched.twice
        r.acked_events_unknown = matched.unknown
        r.entries_leased_after_acked = sorted(leased_after)
        r.amo_entries_leased_twice = sorted(b for b, n in amo_leased.items() if n > 1)
        r.not_admitted = {q: sorted((entries | poison) - seen) for q, seen in enqueued.items()}
        where = {v: places[0] for v, places in journal.values.items()}
        shown = ([where[v][0] for v in r.alo_lost if v in where][:8]
                 + matched.without[:8] + matched.twice[:4] + matched.unknown[:4]
                 + r.entries_leased_after_acked[:4])
        value_of = {b: v for v, places in journal.values.items() for b, _ in places}
        for b in dict.fromkeys(shown):
            r.histories[f"{b} (record {value_of.get(b, '?')})"] = history.get(b, [])
        self._check_poison(events, poison)
        self._check_doomed(events, processed.counts[DOOMED])
        failures = self._shard_failures()

        def journaled_or_attempted(v: int) -> float:
            # A value missing from the journal is placed by when it was attempted.
            return where[v][1] if v in where else publisher.attempted_at[v]

        def second(queue: str, v: int) -> float:
            return sorted(processed.seconds.get((queue, str(v)), [0.0, 0.0]))[1] - self.origin

        # The canary: whenever a consumer processed a record of the at-least-once queue.
        canary = sorted(t - self.origin for (queue, _), times in processed.seconds.items()
                        if queue == ALO for t in times)
        # The table: unconfirmed by when they were attempted, lost and not processed by when
        # the record was journaled, duplicates by when they were processed again.
        timeline = Timeline(
            processed=canary,
            acks=[e.timestamp_ms / 1000 - self.origin for e in events
                  if e.queue == ALO and e.type is EventType.ACKED],
            unconfirmed=[publisher.attempted_at[v] for v in figures.unconfirmed],
            lost=[journaled_or_attempted(v) for v in r.alo_lost],
            duplicated=[second(ALO, v) for v, n in alo.items() if n > 1],
            amo_not_processed=[journaled_or_attempted(v) for v in amo_missed],
            amo_twice=[second(AMO, v) for v in r.amo_processed_twice],
            failures=failures)
        faults = self.done_faults
        rows = fault_rows(faults, timeline, end=self._now())
        r.fault_table = [dataclasses.asdict(row) for row in rows]
        r.shard_failures = sum(f.failures for f in failures)
        r.shard_failures_after_input_faults = [
            f"{f.said()}, charged to {faults[i].kind} at t={faults[i].at:.3f}s"
            for f in failures
            if (i := charged_to(faults, f.at)) is not None and KINDS[faults[i].kind].input]
        r.shard_failures_unexplained = [f.said() for f in unexplained(faults, failures)]
        r.shard_failures_unended = [f.said() for f in failures if not f.ended]
        self._check_hostile(events, canary, publisher, journal, foreign)

    def _check_hostile(self, events: list[Event], canary: list[float], publisher: Publisher,
                       journal: JournalRead, foreign: int) -> None:
        """Each hostile phase's outcome completed with what only the end shows: its exact
        window, the canary's worst gap in it (and in as long a span before it), the events
        of the tenant's records and of the victims' sessions, the journal's and the events
        topic's records that no one should have written (checks.py `hostile_problems`)."""
        phases = [f for f in self.done_faults if f.kind == "hostile"]
        seen = [Seen(e.timestamp_ms / 1000 - self.origin, e.type.value, e.consumer_id,
                     e.session_id) for e in events]
        ended = publisher.attempted_at[-1] if publisher.attempted_at else 0.0
        for fault, outcome in zip(phases, self.hostile_outcomes, strict=False):
            closes = fault.closes if fault.closes is not None else fault.end
            o = dataclasses.replace(outcome, at=fault.at, end=fault.end, closes=closes,
                                    publishing_ended=round(ended, 3))
            gap = canary_gap(canary, fault.at, closes, ended)
            o.canary_gap = None if gap is None else round(gap, 3)
            o.canary_before = round(
                worst_gap(canary, max(0.0, 2 * fault.at - closes), fault.at), 3)
            o.hostile_events, o.sessions_ended, o.refused_events = hostile_events(
                seen, self.hostile_ids, self.hostile_sessions, o.victims, fault.at, closes)
            o.journal_records = journal.stamped
            o.events_foreign = foreign
            self.result.hostile.append(dataclasses.asdict(o))

    def _check_poison(self, events: list[Event], poison: set[str]) -> None:
        """Each queue's outcome events of the poison records (the journal's records that are
        not the publisher's numbers), and the dead letters with reason too_large."""
        r = self.result
        if not poison:
            return
        for queue in (ALO, AMO):
            r.poison_outcomes[queue] = [
                _said(e) for e in events if e.queue == queue and e.bookmark is not None
                and e.bookmark.format() in poison
                and e.type in (EventType.EXPIRED, EventType.ACKED,
                               EventType.DELIVERED_AT_MOST_ONCE)]
            r.poison_dead_letters[queue] = sum(
                1 for headers in self._read_headers(
                    TopicNames(self.settings.topic_prefix).dead_letter(queue))
                if headers.get(DLQ_REASON) == b"too_large")

    def _read_headers(self, topic: str) -> list[dict[str, bytes]]:
        """The headers of every record of a topic (none when it does not exist)."""
        consumer = Consumer(logged({"bootstrap.servers": self.settings.bootstrap_servers,
                             "group.id": f"soak-{uuid.uuid4().hex}", "enable.auto.commit": False,
                             "isolation.level": "read_committed"}))
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
                                        self.origin, source=log.name)
        return sorted(found, key=lambda f: f.at)

    def _audit(self) -> None:
        """`qlayer pipeline reconcile` of both queues, as an operator would run it after the
        soak: the journal, the events and PostgreSQL compared entry by entry. Its verdict is
        checked against the journal's entries (checks.py `audit_check`): its ``done`` count,
        its ``pending``, and the status of each entry it wrote with ``--output`` (Parquet).
        The doomed queue is not audited: its journal was deleted, so its old entries' records
        are gone and their bookmarks name records of the journal made again
        (docs/development.md)."""
        began = time.monotonic()
        for queue in (ALO, AMO):
            statuses_dir = self.logs / f"reconcile-{queue}.parquet"
            done = subprocess.run(
                [sys.executable, "-m", "layer_cli.main", "pipeline", "reconcile", queue,
                 "--journal", self.journal, "--json", "--output", str(statuses_dir)],
                env=_env(self.settings), capture_output=True, text=True, timeout=900,
                check=False)
            (self.logs / f"reconcile-{queue}.log").write_text(
                done.stdout + "\n" + done.stderr, encoding="utf-8")
            verdict = audit_verdict(queue, done.returncode, done.stdout, done.stderr)
            statuses = None if verdict.error else self._read_statuses(statuses_dir)
            check = audit_check(verdict, self.expected_entries, statuses)
            self.say(f"reconcile {queue}: {verdict.done} done (of {check.expected} "
                     f"expected), {verdict.pending} pending, {len(verdict.violations)} "
                     "violations" + (f" ({verdict.error})" if verdict.error else ""))
            self.result.audit.append(dataclasses.asdict(check))
            self.result.audit_violations += len(verdict.violations)
        self.result.audit_seconds = round(time.monotonic() - began, 1)

    def _read_statuses(self, path: Path) -> dict[str, str] | None:
        """bookmark → status from reconcile's per-entry output; None when it cannot be read
        (the audit then fails: its count alone does not show which entries it judged)."""
        import pyarrow.parquet as pq  # a test dependency, as pyspark is: only the audit needs it

        try:
            read = pq.read_table(path, columns=["bookmark", "status"]).to_pydict()
        except Exception as exc:  # the check fails on it, with the reason said
            self.say(f"reconcile's output {path} not read: {exc}")
            return None
        return {str(b): str(st) for b, st in zip(read["bookmark"], read["status"], strict=True)}

    def _read_journal(self) -> JournalRead:
        """The journal read back to its end: each numbered value's places (bookmark, and when
        it was journaled, seconds since the first record), the other records (poison), and
        those with a qlayer header, which no producer of the soak writes (a delivery or a
        reply the coordinator was made to write there)."""
        read = JournalRead()
        for m in self._read_topic(self.journal, read, isolation="read_uncommitted"):
            value = m.value() or b""
            place = (f"{m.topic()}/{m.partition()}/{m.offset()}",
                     m.timestamp()[1] / 1000 - self.origin)
            if any(k.startswith("qlayer.") for k, _ in m.headers() or []):
                read.stamped.append(place[0])
            if value.isdigit():
                read.values.setdefault(int(value), []).append(place)
            else:
                read.others.append(place)
        return read

    def _read_events(self) -> tuple[list[Event], bool, int]:
        """Every committed event, whether the topic was read to its end, and how many of its
        records are no event (a delivery or reply the coordinator was made to write there).
        An event batch published twice (docs/protocol.md §4.4b) counts once, as readers must
        (as tests/support/processes.py `read_events`, which raises rather than say it did not
        read to the end)."""
        codec = Codec()
        fingerprint = codec.schema(SchemaKind.EVENT_BATCH).fingerprint
        batches: set[int] = set()
        found: list[Event] = []
        foreign = 0
        progress = JournalRead()
        for m in self._read_topic(TopicNames(self.settings.topic_prefix).events, progress,
                                  isolation="read_committed"):
            value = m.value()
            try:
                if value is not None and value[2:10] == fingerprint:
                    batch = codec.decode_event_batch(value)
                    if batch.batch_id in batches:
                        continue
                    batches.add(batch.batch_id)
                    found.extend(batch.events)
                else:
                    found.append(codec.decode_event(value))
            except ProtocolError:
                foreign += 1
        return found, progress.complete, foreign

    def _read_topic(self, topic: str, progress: JournalRead,
                    isolation: str) -> Iterable[Message]:
        """Every record of a topic from its start to its end as of now; ``progress.complete``
        says whether every partition's position reached its end (a transaction marker at the
        end is no record, so the position is compared, not the last offset seen)."""
        consumer = Consumer(logged({"bootstrap.servers": self.settings.bootstrap_servers,
                             "group.id": f"soak-{uuid.uuid4().hex}", "enable.auto.commit": False,
                             "isolation.level": isolation}))
        try:
            md = consumer.list_topics(topic, timeout=30).topics[topic]
            parts = [TopicPartition(topic, p, 0) for p in md.partitions]
            ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=30)[1]
                    for tp in parts}
            consumer.assign(parts)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                for m in consumer.consume(10_000, 0.5):
                    if m.error() is None:
                        yield m
                at = {tp.partition: tp.offset for tp in consumer.position(parts)}
                if all(at[p] >= end for p, end in ends.items() if end > 0):
                    progress.complete = True
                    return
        finally:
            consumer.close()


@dataclass
class JournalRead:
    """A topic read back: the journal's numbered values (value → places, normally one) and
    its other records (the poison), each place a bookmark and a time; ``complete`` when
    every partition was read to its end."""

    values: dict[int, list[tuple[str, float]]] = field(default_factory=dict)
    others: list[tuple[str, float]] = field(default_factory=list)
    complete: bool = False
    #: Bookmarks of records with a qlayer header (the publisher's and the poison have none).
    stamped: list[str] = field(default_factory=list)


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


def summary(result: SoakResult) -> list[str]:
    """The figures, one a line: a list as its length and its first values (the JSON output
    has them all)."""
    lines = []
    for key, value in dataclasses.asdict(result).items():
        if key in ("plan", "faults", "histories", "fault_table", "audit", "hostile"):
            continue
        if isinstance(value, list):
            value = f"{len(value)}" + (f" {value[:5]}" if value else "")
        elif isinstance(value, dict):
            value = {k: (f"{len(v)} values" if isinstance(v, list) and len(v) > 5 else v)
                     for k, v in value.items()}
        lines.append(f"{key:40} {value}")
    for check in result.audit:
        lines.append(f"audit {check['queue']}: {check['done']} done of {check['expected']} "
                     f"expected ({len(check['expected_not_done'])} expected not done, "
                     f"{len(check['done_not_expected'])} done not expected, statuses read: "
                     f"{check['statuses_read']}), {check['pending']} pending, "
                     f"{len(check['violations'])} violations")
    for h in result.hostile:
        short = refusals_missing(h["expected"], h["counted"])
        lines.append(
            f"hostile phase t={h['at']:.1f}-{h['closes']:.1f}s: canary's worst gap "
            f"{h['canary_gap']}s (before it: {h['canary_before']}s; load {h['load']}); "
            f"{h['records']} records in {h['wrote_for']}s, "
            f"{sum(int(n) for _, n, _ in h['expected'])} refusals expected, "
            f"{len(short)} kinds of record short of them, broker refused "
            f"{sum(len(v) for v in h['broker_refused'].values())}; "
            f"{sum(h['replies'].get(r) == want for r, (_, want) in h['answers'].items())} of "
            f"{len(h['answers'])} own Subscribes answered as they must be; "
            f"{len(h['victims'])} sessions forged against, {len(h['sessions_ended'])} ended; "
            f"{h['refused_events']} SUBSCRIBE_REFUSED events, {len(h['hostile_events'])} "
            f"other events of its own, {len(h['journal_records'])} records in the journal, "
            f"{h['events_foreign']} non-events on the events topic")
    return lines


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
    # The harness's own Kafka clients log through `layer.kafka.logs.logged`: into a file of
    # the state directory, never between the soak's lines (the broker is killed on purpose).
    state_dir.mkdir(parents=True, exist_ok=True)
    harness_log = logging.FileHandler(state_dir / "harness.log")
    harness_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    client_lines = logging.getLogger("layer.kafka.client")
    client_lines.addHandler(harness_log)
    client_lines.propagate = False
    if plan.exactly_once:
        from tests.soak.exactly_once import run_exactly_once

        figures = run_exactly_once(plan, state_dir, say)
        args.output.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
        for p in figures["problems"]:
            say(f"PROBLEM: {p}")
        say(f"{figures.get('results', 0):,} results of {plan.messages:,} inputs, "
            f"{figures.get('duplicates', 0)} duplicates; {figures.get('worker_restarts', 0)} "
            f"worker restarts, {figures.get('coordinator_kills', 0)} coordinator SIGKILLs, "
            f"{figures.get('pauses', 0)} pauses past a lease")
        say("passed" if not figures["problems"] else "FAILED")
        return 1 if figures["problems"] else 0
    result = Soak(plan, state_dir, say, keep_stack=args.keep_stack).run()
    args.output.write_text(json.dumps(dataclasses.asdict(result), indent=2) + "\n",
                           encoding="utf-8")
    for line in summary(result):
        say(line)
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
