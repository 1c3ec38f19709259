"""A coordinator process: group membership, one shard loop per assigned shard, lifecycle.

Every process of an installation joins the consumer group ``P`` + ``coordinators`` on the
topic ``P`` + ``shards`` (one partition per shard, `layer.kafka.shards`). The partitions Kafka
assigns it are the shards it runs, each in a `ShardLoop`, all on this one thread, round after
round; a process with none is a hot standby. Kafka's group protocol does the election, the
failure detection (``group_session_timeout``) and the balancing; PostgreSQL's epochs still
fence: a loop takes its shard (a new epoch) before it starts, so a process that lost a shard
without noticing cannot write for it any more.

A failure in one shard (Kafka or PostgreSQL refusing a write, a fenced commit) rebuilds that
shard alone, after a back-off; the others go on. A failure of Kafka's is also a reason to
check that Kafka answers at all before any shard is taken again: while it does not (a broker
outage), the process waits, checking with a back-off, instead of rebuilding its shards over
and over against a dead broker; it says so once when that starts and once when it ends, and
takes its shards again as soon as Kafka answers. Nothing is acknowledged meanwhile: acks are
applied only as they are read from the ack topic.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from layer.coordinator.acks import ACK_RECORD_LIMIT
from layer.coordinator.catalog import Catalog
from layer.coordinator.control import CONTROL_RECORD_LIMIT
from layer.coordinator.figures import (
    ConsumerFigures,
    PartitionLag,
    QueueFigures,
    Readiness,
    ShardFigures,
    Snapshot,
    loop_figures,
)
from layer.coordinator.logformat import fields
from layer.coordinator.options import CoordinatorOptions, LeaseTokens, LoopStats
from layer.coordinator.payloads import MemoryPool
from layer.coordinator.shard import ShardLoop
from layer.domain.definitions import QueueDefinition
from layer.domain.errors import QlayerError, QueueConfigError
from layer.domain.shards import shard_key
from layer.kafka import KafkaAdapterError, KafkaAdmin, TopicSpec
from layer.kafka.directory import DirectoryWriter
from layer.kafka.logs import ClientLog
from layer.kafka.shards import ShardMembership
from layer.protocol import TopicNames
from layer.settings import Settings
from layer.store.errors import FencedError, StoreError
from layer.store.principals import Principals
from layer.store.store import Store
from layer.store.tables import COUNTER_NAMES

if TYPE_CHECKING:
    from layer.coordinator.metrics import MetricsServer

log = logging.getLogger(__name__)

#: A registry row not refreshed for this long belongs to a process that is gone (killed).
FORGET_PROCESSES_AFTER = 60.0
#: How long (s) a shard counts as busy after its last input (see `CoordinatorProcess._idle`).
BUSY_FOR = 2.0
#: The longest wait (s) between two retries of a failing shard.
MAX_BACKOFF = 10.0
#: The longest wait (s) between two checks whether Kafka answers again, during an outage:
#: a check is one small metadata request, so Kafka's return is noticed within seconds.
MAX_PROBE_INTERVAL = 2.0
#: How long (s) a check whether Kafka answers may wait for the answer.
PROBE_TIMEOUT = 2.0
#: An iteration that takes this long (s) is logged with where its time went: every shard of
#: the process waited for it.
SLOW_ITERATION = 1.0
#: The shortest time (s) between two catalog loads asked for by a shard (a Subscribe to a
#: queue applied a moment ago waits at most about this long; one to a queue that does not
#: exist cannot make the process load the catalog more often than this).
FORCED_CATALOG_GAP = 0.25


@dataclass
class _Trouble:
    """A failure that repeats: logged when it starts, when its kind changes and when it
    ends, not at every retry (a broker outage would otherwise log at every back-off)."""

    since: float
    kind: str
    count: int = 1


def _kind(exc: BaseException) -> str:
    """Failures of one kind are logged once in a row: Kafka's, or each other class."""
    return "Kafka" if isinstance(exc, KafkaAdapterError) else type(exc).__name__


def _source(exc: BaseException) -> str:
    """Whom a failure came from, for /readyz: "Kafka: ", "PostgreSQL: " or nothing."""
    if isinstance(exc, KafkaAdapterError):
        return "Kafka: "
    return "PostgreSQL: " if isinstance(exc, StoreError) else ""


@dataclass
class _KafkaOutage:
    """Kafka failed a shard: no shard is taken again before Kafka answers a check."""

    since: float
    error: str
    next_check: float
    backoff: float = 0.0
    checks: int = 0
    #: Whether a check failed, and so the outage was logged.
    reported: bool = False


@dataclass
class _Slot:
    """A shard the group assigned this process, and how its loop is doing."""

    loop: ShardLoop
    #: Not before this time: the next take after a failure (back-off).
    next_try: float = 0.0
    backoff: float = 0.0
    #: Another process holds the epoch although the group gave us the shard (a revocation
    #: on its way to us): wait for the group rather than fence each other in turn.
    parked: bool = False
    #: Until when the shard counts as busy (it had input lately): an idle round waits on
    #: the input of busy shards, so their next records are served the moment they come.
    busy_until: float = 0.0
    #: When its last iteration ran, and whether it had input (`CoordinatorProcess._due`).
    ran_at: float = float("-inf")
    had_input: bool = True
    #: The failures since the shard last ran an iteration (None: it runs).
    trouble: _Trouble | None = None
    #: Why the shard is (to be) taken, for the log line that says so.
    why: str = "assigned by the coordinators' group"


class CoordinatorProcess:
    """Runs the shards Kafka's group protocol assigns this process."""

    def __init__(
        self,
        settings: Settings,
        options: CoordinatorOptions | None = None,
        *,
        store: Store | None = None,
        tokens: Callable[[], str] | None = None,
        loop_class: type[ShardLoop] = ShardLoop,
    ) -> None:
        self.settings = settings
        self.options = options or CoordinatorOptions()
        self.store = store if store is not None else Store(settings.database_url)
        self.topics = TopicNames(settings.topic_prefix)
        self._tokens = tokens or LeaseTokens()
        self._loop_class = loop_class
        self._memory = MemoryPool(self.options.payload_budget)
        self._slots: dict[int, _Slot] = {}
        # Loops stay after their shard is revoked, so their counters keep counting.
        self._loops: dict[int, ShardLoop] = {}
        self._membership: ShardMembership | None = None
        self._admin: KafkaAdmin | None = None
        self._catalog = Catalog(0)
        self._next_catalog = 0.0
        self._catalog_loaded_at = float("-inf")
        self._next_report = 0.0
        self._directory_versions: dict[str, tuple[int, int]] | None = None
        self._stop = threading.Event()
        self._process_counters: Counter[str] = Counter()
        # Set when Kafka failed a shard, cleared once Kafka answers a check.
        self._outage: _KafkaOutage | None = None
        # A start-up or a round failing again and again (logged once, see _Trouble).
        self._trouble: _Trouble | None = None
        self._client_log = ClientLog()
        self.started_at = time.time()
        # The metrics endpoint (--metrics-port), fed one snapshot per report period.
        self._metrics: MetricsServer | None = None
        self._started = False
        # Shards taken this round, (shard, epoch, why): said in one line per reason.
        self._taken: list[tuple[int, int, str]] = []

    # ------------------------------------------------------------------ what tests and tools see
    @property
    def counters(self) -> Counter[str]:
        """Every loop's counters added up, with the process's own."""
        total: Counter[str] = Counter(self._process_counters)
        for loop in tuple(self._loops.values()):  # read from other threads: a copy (see shards)
            total.update(dict(loop.counters))
        return total

    @property
    def catalog(self) -> Catalog:
        """The latest catalog (queues, consumers, principals and grants) the process loaded."""
        return self._catalog

    @property
    def refusals(self) -> Counter[tuple[str, str, str]]:
        """Records and sessions this process refused, by (kind, reason, principal), added up
        over its loops (since it started; the stored totals are the shards')."""
        total: Counter[tuple[str, str, str]] = Counter()
        for loop in tuple(self._loops.values()):
            total.update(dict(loop.refusals.counts))
        return total

    @property
    def loops(self) -> dict[int, ShardLoop]:
        return dict(self._loops)

    @property
    def shards(self) -> list[int]:
        """The shards this process runs now (holds the epoch of)."""
        # Read from other threads (tests, tools) while the process's thread takes and drops
        # shards: a copy first, made in one step (iterating the dict itself raised "dictionary
        # changed size during iteration" once, on a loaded machine).
        return sorted(s for s, slot in tuple(self._slots.items()) if slot.loop.epoch is not None)

    @property
    def is_owner(self) -> bool:
        return bool(self.shards)

    @property
    def shard_count(self) -> int:
        return self._catalog.shard_count

    @property
    def metrics_port(self) -> int | None:
        """The port of the metrics endpoint, once `run` started it."""
        return self._metrics.port if self._metrics is not None else None

    def loop_for(self, queue: str) -> ShardLoop | None:
        """The running loop that serves ``queue`` in this process, if any."""
        for slot in tuple(self._slots.values()):
            if queue in slot.loop.engines:
                return slot.loop
        return None

    # ------------------------------------------------------------------ start and stop
    def start(self, now: float) -> None:
        """Make the shared topics, load the catalog and join the coordinators' group."""
        self._admin = admin = KafkaAdmin(self._kafka_config())
        count = self.store.shard_count()
        topics = self.topics
        limits = {topics.control: {"max.message.bytes": str(CONTROL_RECORD_LIMIT)},
                  topics.ack: {"max.message.bytes": str(ACK_RECORD_LIMIT)}}
        admin.ensure_topics([
            TopicSpec(topics.control, count, limits[topics.control]),
            TopicSpec(topics.ack, count, limits[topics.ack]),
            TopicSpec(topics.events, 6),
            TopicSpec(topics.shards, count),
        ])
        # Topics made by version 1 (3 control and 6 ack partitions) grow to one partition per
        # shard; their old partitions are read by shard p mod N, so nothing is left unread.
        for topic in (topics.control, topics.ack, topics.shards):
            admin.ensure_partitions(topic, count)
        # The broker refuses records over a consumer-written topic's limit before any
        # coordinator reads them (the coordinators drop larger ones unread too). Topics made
        # before issue 36 get the limit here; without the right to change it (ALTER_CONFIGS),
        # the coordinators' own check still holds.
        for topic, config in limits.items():
            try:
                admin.ensure_topic_config(topic, config)
            except KafkaAdapterError as exc:
                log.warning("could not set %s on %s (records over it are still dropped "
                            "unread): %s", ", ".join(f"{k}={v}" for k, v in config.items()),
                            topic, exc)
        self._load_catalog(now)
        self._join()
        self._started = True
        self._report(now)
        log.info("coordinator %s joined %s (%d shards in the installation)",
                 self.options.owner_id, topics.coordinators_group, count)

    def _kafka_config(self) -> dict[str, Any]:
        """The Kafka settings, with librdkafka's log lines through `ClientLog` (a line that
        repeats, such as every failed connection to a broker that is away, once a minute)."""
        return {**self.settings.kafka_config(), "logger": self._client_log}

    def _join(self) -> None:
        """Join the coordinators' group (again, after a fatal error of the group's client)."""
        topics = self.topics
        self._membership = ShardMembership(
            self._kafka_config(), group_id=topics.coordinators_group,
            topic=topics.shards, session_timeout=self.options.group_session_timeout,
            on_revoke=self._on_revoke, instance_id=self.options.owner_id,
            static_id=self.options.instance_id)

    def shutdown(self, now: float) -> None:
        """Stop every shard cleanly (events written, epochs released), leave the group so the
        other processes take the shards at once, and leave the registry."""
        for shard in list(self._slots):
            self._stop_shard(shard, now, lost=False)
        if self._membership is not None:
            self._membership.close()
            self._membership = None
        try:
            self.store.forget_process(self.options.owner_id)
        except QlayerError as exc:
            log.warning("leaving the process registry failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ the loop
    def run_once(self, now: float, wait: float | None = None) -> LoopStats:
        """One round: serve the group protocol, then one iteration of every shard loop.
        Waits up to ``wait`` (default: the poll timeout) only when no shard had input."""
        assert self._admin is not None, "call start first"
        if self._membership is None:
            self._join()
        assert self._membership is not None
        try:
            changes = self._membership.poll(0)
        except KafkaAdapterError as exc:
            if not exc.fatal:
                raise
            self._rejoin(now, exc)
            return LoopStats()
        for shard in changes.assigned:
            self._assign(shard)
        if self._outage is not None:
            self._check_kafka(now)
        if now >= self._next_catalog:
            self._load_catalog(now)
        total = LoopStats()
        for shard in sorted(self._slots):
            slot = self._slots.get(shard)
            if slot is None or not self._due(slot, now):
                continue
            stats = self._run_shard(slot, now)
            slot.ran_at = now
            core = slot.loop.core
            slot.had_input = core.waiting or (stats is not None and bool(
                stats.journal_records or stats.control_records or stats.ack_items))
            if core.control.wants_catalog:
                # A record waits for a fresher catalog (a queue or principal the shard does
                # not know yet): load it soon, but at most every FORCED_CATALOG_GAP, so that a
                # flood of Subscribes to queues that do not exist costs a bounded share of
                # the thread.
                core.control.wants_catalog = False
                self._next_catalog = min(self._next_catalog,
                                         self._catalog_loaded_at + FORCED_CATALOG_GAP)
            if slot.had_input:
                slot.busy_until = now + BUSY_FOR
            if stats is not None:
                total.journal_records += stats.journal_records
                total.control_records += stats.control_records
                total.ack_items += stats.ack_items
                total.deliveries += stats.deliveries
                total.replies += stats.replies
                total.events += stats.events
        if self._taken:
            self._say_taken()
        if now >= self._next_report:
            self._report(now)
        busy = total.journal_records or total.control_records or total.ack_items or any(
            slot.loop.core.waiting for slot in self._slots.values())
        if not busy:
            timeout = self.options.poll_timeout if wait is None else wait
            if timeout > 0:
                self._idle(now, timeout)
        return total

    def _due(self, slot: _Slot, now: float) -> bool:
        """Whether the shard runs in this round: always after an iteration that had input,
        and when it is not running yet (taking it); else when its inputs have a record (a
        look without waiting, kept for the iteration) or ``idle_shard_interval`` has passed,
        so its timers are at most that late, as in an idle process's rounds."""
        interval = self.options.idle_shard_interval
        if slot.had_input or not interval or slot.loop.epoch is None \
                or now - slot.ran_at >= interval:
            return True
        try:
            return slot.loop.wait(0.0)
        except QlayerError:
            return True  # its iteration meets the failure and deals with it

    def _idle(self, now: float, timeout: float) -> None:
        """Nothing came in this round: wait up to ``timeout`` for the next input. A process
        whose shards serve queues (or had input lately) waits on their inputs, a slice of the
        timeout each, and goes on as soon as one has a record: a journal record or a
        consumer's ack is served the moment it comes, where a fixed nap added up to the whole
        timeout to every delivery after a quiet spell and to every ack round trip. A process
        with no such shard waits on the group protocol."""
        assert self._membership is not None
        busy = [slot.loop for slot in self._slots.values()
                if slot.loop.epoch is not None
                and (slot.busy_until > now or slot.loop.core.engines)]
        if not busy:
            for shard in self._membership.poll(timeout).assigned:
                self._assign(shard)
            return
        share = timeout / len(busy)
        for loop in busy:
            try:
                if loop.wait(share):
                    return
            except QlayerError as exc:
                # The shard's next iteration meets the same failure and rebuilds it.
                log.debug("waiting on shard %d: %s", loop.shard, exc)
                return

    def run(self, clock: Callable[[], float] = time.time, install_signals: bool = True) -> None:
        """Run until stopped (SIGTERM / SIGINT); hands every shard over on the way out."""
        if install_signals:
            def handler(signum: int, frame: FrameType | None) -> None:
                log.info("signal %d: stopping", signum)
                self._stop.set()

            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)
        if self.options.gc_threshold:
            # Every iteration allocates a few objects per message (records, rows, events), and
            # the default threshold (700) ran the cyclic collector every few dozen messages,
            # re-walking the queues' long-lived objects each time. Nothing in the loop makes
            # reference cycles, so collecting less often costs no memory.
            gc.set_threshold(self.options.gc_threshold, 50, 100)
        if self.options.metrics_port is not None and self._metrics is None:
            # Imported here: prometheus-client is loaded only by processes that serve it.
            from layer.coordinator.metrics import MetricsServer

            self._metrics = MetricsServer(
                self.options.metrics_host, self.options.metrics_port,
                stale_after=max(15.0, 5 * self.options.report_interval), clock=clock)
            self._metrics.start()
        backoff = 0.0
        while not self._stop.is_set():
            try:
                self.start(clock())
                if self.options.gc_freeze:
                    self._freeze_start_up()
                self._ok(clock(), "the coordinator started")
                break
            except QlayerError as exc:
                backoff = min(max(backoff * 2, 0.5), MAX_BACKOFF)
                self._repeating(clock(), exc, f"coordinator start-up failed ({exc}); retrying "
                                f"with back-off up to {MAX_BACKOFF:.0f}s")
                self._publish(clock(), [f"starting: {_source(exc)}{exc}"])
                self._stop.wait(backoff)
        try:
            while not self._stop.is_set():
                try:
                    self.run_once(clock())
                    self._ok(clock(), "coordinator rounds run")
                except QlayerError as exc:
                    # The group protocol or the catalog failed (a shard's own failures are
                    # handled per shard): wait, and go on.
                    self._process_counters["round_failures"] += 1
                    self._repeating(clock(), exc, f"coordinator round failed ({exc}); "
                                    "retrying every second")
                    self._publish(clock(), [f"a round failed: {_source(exc)}{exc}"])
                    self._stop.wait(1.0)
        finally:
            self.shutdown(clock())
            if self._metrics is not None:
                self._metrics.close()
                self._metrics = None

    @staticmethod
    def _freeze_start_up() -> None:
        """Collect the start-up's garbage and move what is left (modules, classes, clients:
        alive for the process's life) out of the collector's sight. The first full collection
        after start-up otherwise walked all ~105,000 of them: a 64 ms pause of the loop
        (78 ms in a throughput cell), so every record that came meanwhile waited for it;
        after the freeze it walks ~13,000 (5 ms). Measured with gc.callbacks in a latency
        cell (docs/coordinator.md, "Garbage collection")."""
        gc.collect()
        gc.freeze()

    def _repeating(self, now: float, exc: BaseException, message: str) -> None:
        """Log a start-up or round failure when it starts or changes kind, not every time."""
        trouble = self._trouble
        if trouble is None or trouble.kind != _kind(exc):
            self._trouble = _Trouble(now, _kind(exc))
            log.error("%s; logged again when it changes or passes", message)
        else:
            trouble.count += 1
            log.debug(message)

    def _ok(self, now: float, what: str) -> None:
        trouble, self._trouble = self._trouble, None
        if trouble is not None:
            log.warning("%s again, after %d failures in %.1fs", what, trouble.count,
                        now - trouble.since)

    # ------------------------------------------------------------------ shards
    def _assign(self, shard: int) -> None:
        slot = self._slots.get(shard)
        if slot is not None:
            slot.parked = False
            return
        loop = self._loops.get(shard)
        if loop is None:
            why = "assigned by the coordinators' group"
            loop = self._loop_class(
                self.settings, self.options, shard, catalog=lambda: self._catalog,
                store=self.store, admin=self._admin_client(), memory=self._memory,
                tokens=self._tokens, client_log=self._client_log)
            self._loops[shard] = loop
        else:
            why = "assigned again by the coordinators' group"
        self._slots[shard] = _Slot(loop, why=why)

    def _on_revoke(self, shards: list[int], lost: bool) -> None:
        """Called inside the group protocol: stop writing for these shards before Kafka
        hands them to another process."""
        now = time.time()
        for shard in shards:
            self._stop_shard(shard, now, lost=lost)

    def _stop_shard(self, shard: int, now: float, *, lost: bool) -> None:
        slot = self._slots.pop(shard, None)
        if slot is None:
            return
        if lost:
            slot.loop.abandon("the coordinators' group gave the shard to another process")
        else:
            # Kafka known to be away: the clean stop writes nothing more to it (each write
            # would only wait for its timeout).
            slot.loop.release(now, kafka=self._outage is None)
            slot.loop.abandon("revoked")

    def _rejoin(self, now: float, exc: KafkaAdapterError) -> None:
        """The group's client failed for good (librdkafka's fatal error): stop every shard
        without writing (the group may have given them away already) and join again."""
        log.error("the coordinators' group failed (%s): stopping every shard and joining "
                  "the group again", exc)
        self._process_counters["group_rejoins"] += 1
        for shard in list(self._slots):
            self._stop_shard(shard, now, lost=True)
        membership, self._membership = self._membership, None
        if membership is not None:
            membership.close()
        self._join()

    def _run_shard(self, slot: _Slot, now: float) -> LoopStats | None:
        loop = slot.loop
        if loop.epoch is None:
            if slot.parked or now < slot.next_try or self._outage is not None:
                return None
            try:
                if self._catalog.loaded_at < now:
                    # Restored from what PostgreSQL has now: a catalog loaded before a
                    # consumer's latest Subscribe would not restore its session (its
                    # heartbeats then answered UNKNOWN_SESSION, its leases broken).
                    self._load_catalog(now)
                self._taken.append((loop.shard, loop.take(now), slot.why))
            except QlayerError as exc:
                self._failed(slot, now, exc, f"taking shard {loop.shard} failed")
                return None
        started = time.perf_counter()
        try:
            stats = loop.run_once(now, poll_timeout=0)
        except FencedError:
            self._fenced(slot, now)
            return None
        except QlayerError as exc:
            # Kafka or PostgreSQL failed mid-iteration: what the engines decided may not be
            # persisted, so the shard's in-memory state is not trusted. Crash-only recovery:
            # rebuild it from PostgreSQL and the journals, exactly as after a restart. After
            # a Kafka failure that may pass (a timeout, a broker away), nothing more is
            # written to Kafka on the way out: each write would only wait for its timeout.
            self._failed(slot, now, exc, f"an iteration of shard {loop.shard} failed")
            loop.counters["iteration_failures"] += 1
            loop.rebuild(now, kafka=not (isinstance(exc, KafkaAdapterError) and exc.retriable))
            return None
        took = time.perf_counter() - started
        if took >= SLOW_ITERATION:
            self._slow(loop, took)
        slot.backoff = 0.0
        trouble, slot.trouble = slot.trouble, None
        if trouble is not None:
            log.warning("shard %d runs again, %.1fs and %d failures after it first failed",
                        loop.shard, now - trouble.since, trouble.count)
        return stats

    def _slow(self, loop: ShardLoop, took: float) -> None:
        """An iteration held the process's one thread for ``took`` seconds: every other shard
        waited. Say which and where the time went, and give the others the cause for their
        own "did not run" line (`ShardLoop._forgive`)."""
        cause = (f"shard {loop.shard}'s iteration took {took:.1f}s "
                 f"({loop.phase_breakdown()})")
        self._process_counters["slow_iterations"] += 1
        log.warning("%s; the process's other shards waited for it", cause,
                    extra=fields(shard=loop.shard, reason="slow iteration"))
        for other in self._loops.values():
            if other is not loop:
                other.stall_hint = cause

    def _say_taken(self) -> None:
        """Say which shards this process took in this round, and why: one line per reason
        (a process starting takes all its shards in one round)."""
        taken, self._taken = self._taken, []
        by_why: dict[str, list[tuple[int, int]]] = {}
        for shard, epoch, why in taken:
            by_why.setdefault(why, []).append((shard, epoch))
        for why, pairs in by_why.items():
            shards, epochs = [s for s, _ in pairs], [e for _, e in pairs]
            log.info("coordinator %s took shard%s %s at epoch%s %s: %s", self.options.owner_id,
                     "s" if len(pairs) > 1 else "", ", ".join(map(str, shards)),
                     "s" if len(set(epochs)) > 1 else "",
                     ", ".join(map(str, epochs)) if len(set(epochs)) > 1 else epochs[0], why,
                     extra=fields(owner=self.options.owner_id, shards=shards, epochs=epochs,
                                  reason=why))

    def _failed(self, slot: _Slot, now: float, exc: QlayerError, why: str) -> None:
        """A shard failed: retried after a back-off (0.5 s doubling to MAX_BACKOFF), from
        stored state. Logged when its failures start or change kind, not at every retry."""
        self._process_counters["shard_failures"] += 1
        slot.why = f"taken again after a failure ({why}: {exc}), rebuilt from stored state"
        slot.backoff = min(max(slot.backoff * 2, 0.5), MAX_BACKOFF)
        slot.next_try = now + slot.backoff
        if isinstance(exc, KafkaAdapterError) and self._outage is None:
            # Whether Kafka answers at all is checked before any shard is taken again.
            self._outage = _KafkaOutage(since=now, error=str(exc), next_check=now)
        trouble = slot.trouble
        if trouble is None or trouble.kind != _kind(exc):
            slot.trouble = _Trouble(now, _kind(exc))
            log.error("%s: %s; rebuilding from stored state, retried with back-off up to "
                      "%.0fs (logged again when it runs or fails otherwise)", why, exc,
                      MAX_BACKOFF, extra=fields(shard=slot.loop.shard, reason=_kind(exc)))
        else:
            trouble.count += 1
            log.debug("%s again (%d in a row): %s", why, trouble.count, exc)

    def _check_kafka(self, now: float) -> None:
        """During an outage (a shard failed because of Kafka): check, with a back-off, that
        Kafka answers; once it does, the shards are taken again at once."""
        outage = self._outage
        if outage is None or now < outage.next_check:
            return
        outage.checks += 1
        try:
            self._admin_client().ping(self.topics.shards, timeout=PROBE_TIMEOUT)
        except QlayerError as exc:
            outage.backoff = min(max(outage.backoff * 2, 0.25), MAX_PROBE_INTERVAL)
            outage.next_check = now + outage.backoff
            if not outage.reported:
                outage.reported = True
                self._process_counters["kafka_outages"] += 1
                log.error("Kafka does not answer (%s; the first failure: %s). The shards of "
                          "this process wait for it, checked every %.0fs at most, and start "
                          "again from stored state once it answers; logged again then",
                          exc, outage.error, MAX_PROBE_INTERVAL)
            return
        self._outage = None
        if outage.reported:
            # The shards waited for Kafka, not for their back-off: they start at once.
            log.warning("Kafka answers again, %.1fs after the first failure; the shards "
                        "start again from stored state", now - outage.since)
            for slot in self._slots.values():
                slot.next_try = min(slot.next_try, now)
                slot.why = (f"taken again: Kafka answers again after "
                            f"{now - outage.since:.1f}s away")

    def _fenced(self, slot: _Slot, now: float) -> None:
        """A newer epoch: a queue moved off the shard (this process is still the owner) or
        another process took the shard (the group will revoke it from us)."""
        loop = slot.loop
        try:
            owner = self.store.owner(loop.key)
        except QlayerError as exc:
            self._failed(slot, now, exc, f"reading the owner of shard {loop.shard} failed")
            return
        if owner is None or owner.owner_id == self.options.owner_id:
            # Rebuilt at once, without the queues that left (and their sessions).
            self._load_catalog(now)
            slot.next_try = now
            slot.why = "taken again at a new epoch: a queue moved to or from it"
            return
        log.warning("shard %d is held by %s although the group assigned it here: waiting "
                    "for the group", loop.shard, owner.owner_id,
                    extra=fields(shard=loop.shard, reason="held by another process"))
        slot.parked = True

    def _admin_client(self) -> KafkaAdmin:
        assert self._admin is not None, "call start first"
        return self._admin

    # ------------------------------------------------------------------ catalog, directory, report
    def _load_catalog(self, now: float) -> None:
        self._catalog = Catalog.of(self.store.shard_count(), self.store.list_queues(),
                                   self.store.load_consumers(), now,
                                   Principals(self.store.engine).load_entitlements(),
                                   self.store.load_spans())
        self._next_catalog = now + self.options.refresh_interval
        self._catalog_loaded_at = now
        if 0 in self._slots and self._slots[0].loop.epoch is not None:
            self._sync_directory()

    def _sync_directory(self) -> None:
        """Publish every queue definition, with its shard, to the compacted directory topic
        (publishers route by it without PostgreSQL). The process running shard 0 does it, so
        one writer keeps it; retried at the next catalog load when Kafka refuses."""
        versions = {n: (q.version, q.shard) for n, q in self._catalog.queues.items()}
        if versions == self._directory_versions:
            return
        placed: dict[str, tuple[dict[str, object], int]] = {}
        for record in self._catalog.queues.values():
            try:
                definition = QueueDefinition.from_mapping(record.definition)
            except QueueConfigError:
                continue  # counted and logged by the loop that serves it
            placed[record.name] = (definition.model_dump(mode="json"), record.shard)
        try:
            DirectoryWriter(self._kafka_config(), self.topics.queues).sync(
                placed, self._catalog.shard_count)
        except QlayerError as exc:
            log.warning("publishing the queue directory failed (retrying): %s", exc)
            return
        self._directory_versions = versions

    def _report(self, now: float) -> None:
        """Say which shards this process runs and how far behind each is."""
        self._next_report = now + self.options.report_interval
        lags: dict[str, tuple[int, int | None]] = {}
        for slot in self._slots.values():
            loop = slot.loop
            if loop.epoch is not None:
                try:
                    lag = loop.lag()
                except QlayerError:
                    lag = None
                lags[shard_key(loop.shard)] = (loop.epoch, lag)
        problems: list[str] = []
        try:
            self.store.report(self.options.owner_id, socket.gethostname(), os.getpid(),
                              self.started_at, self.shards, lags, now,
                              now - FORGET_PROCESSES_AFTER)
        except QlayerError as exc:
            self._process_counters["report_failures"] += 1
            log.warning("reporting to the process registry failed: %s", exc)
            problems.append(f"PostgreSQL: {exc}")
        if self._metrics is not None:
            self._publish(now, problems)

    # ------------------------------------------------------------------ metrics
    def _publish(self, now: float, problems: list[str]) -> None:
        """Hand the metrics endpoint a snapshot of this process (once per report period;
        `layer.coordinator.figures`). ``problems``: why it is not ready, found so far."""
        if self._metrics is None:
            return
        reasons = list(problems)
        totals: dict[str, dict[str, int]] = {}
        queues: list[QueueFigures] = []
        consumers: list[ConsumerFigures] = []
        partitions: list[PartitionLag] = []
        shards: list[ShardFigures] = []
        if self._started:
            for shard, loop in sorted(self._loops.items()):
                running = loop.epoch is not None
                try:
                    lag = loop.lag() if running else None
                    ends = loop.end_offsets() if running else {}
                except QlayerError:
                    lag, ends = None, {}
                figures, q, c, p = loop_figures(
                    shard, loop.epoch, loop.core.engines if running else {},
                    loop.core.sessions, loop.core.consumer_acks, loop.counters, loop.phases,
                    lag, ends, now, loop.fault_counters() if running else None)
                shards.append(figures)
                queues += q
                consumers += c
                partitions += p
            if queues and not problems:
                try:
                    stored = self.store.load_counters()
                except QlayerError as exc:
                    reasons.append(f"PostgreSQL: {exc}")
                else:
                    served = {q.queue for q in queues}
                    totals = {name: {n: getattr(c, n) for n in COUNTER_NAMES}
                              for name, c in stored.items() if name in served}
            if self._membership is None or not self._membership.joined:
                reasons.append("waiting for the coordinators' group to assign shards")
            if self._outage is not None:
                reasons.append(f"Kafka: {self._outage.error}")
            for shard, slot in sorted(self._slots.items()):
                if slot.loop.epoch is None:
                    why = ("held by another process" if slot.parked
                           else "failing" if slot.trouble is not None else "not taken yet")
                    reasons.append(f"shard {shard} is assigned here but does not run ({why})")
        elif not reasons:
            reasons.append("starting")
        acks: dict[str, int] = {}
        for loop in tuple(self._loops.values()):
            for consumer, n in tuple(loop.core.consumer_acks.items()):
                acks[consumer] = acks.get(consumer, 0) + n
        self._metrics.publish(Snapshot(
            taken_at=now, owner_id=self.options.owner_id,
            core="native" if self.options.native_core else "python",
            readiness=Readiness(not reasons, tuple(self.shards), tuple(reasons)),
            queues=tuple(queues), totals=totals, partitions=tuple(partitions),
            consumers=tuple(consumers), consumer_acks=acks, shards=tuple(shards),
            process_counters=dict(self._process_counters)))
