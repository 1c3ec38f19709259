"""`qlayer queue ...`: apply, create, list, describe, delete, purge, ack and reset queues.

Queue definitions live in PostgreSQL (DESIGN §3); the coordinator picks changes up within its
refresh interval. The store keeps ``QueueDefinition.model_dump(mode="json")``: every field
spelled out with defaults resolved, which ``QueueDefinition.from_mapping`` reads back as is.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar

from layer.domain.errors import ExpressionError, QlayerError, QueueConfigError, UnknownQueueError
from layer.domain.likepattern import name_matcher
from layer.domain.positions import ResetTarget, parse_target, resolve_target
from layer.domain.shards import part_of
from layer.protocol.topics import TopicNames
from layer.services.coordinators import STALE_AFTER
from layer.settings import Settings
from layer.store.errors import QueueVersionConflictError, StoreError
from layer.store.rows import ConsumerRow, QueueCounters, QueueRecord
from layer.store.store import Store

if TYPE_CHECKING:
    # The Kafka client, and the definitions' pydantic models and filter grammar, cost `qlayer
    # queue list` (which needs neither) a quarter of its second: loaded where used.
    from layer.domain.definitions import QueueDefinition
    from layer.kafka.admin import KafkaAdmin
    from layer.services.views import MatchCount

__all__ = [
    "AckResult",
    "ApplyConflictError",
    "ApplyPlan",
    "ApplyResult",
    "ConsumersAttachedError",
    "FieldChange",
    "InvalidFilterError",
    "InvalidQueueFileError",
    "NoSuchQueueError",
    "PartFigures",
    "PartitionFigures",
    "PartitionedQueueError",
    "PurgeResult",
    "QueueChange",
    "QueueDescription",
    "QueueExistsError",
    "QueueService",
    "QueueSummary",
    "ResetPartition",
    "ResetResult",
    "WaitTimedOutError",
    "attached_consumers",
    "plan_apply",
    "with_store_hints",
]

# Seconds describe waits for Kafka before showing the PostgreSQL figures without the backlog.
KAFKA_TIMEOUT = 5.0

Action = Literal["create", "change", "delete", "unchanged"]


class NoSuchQueueError(UnknownQueueError):
    """The operator named a queue that is not defined."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.args = (f"no queue named {name}; see `qlayer queue list`",)


class PartitionedQueueError(QlayerError, ValueError):
    """An operation a queue of several parts does not have yet."""

    def __init__(self, name: str, parts: int, what: str) -> None:
        super().__init__(
            f"queue {name} has {parts} parts: {what} of a queue of several parts is not "
            "supported yet (each part's shard would have to carry it out and report it; "
            "docs/coordinator.md, 'Partitioned queues'). Acknowledge or reject its messages "
            "from a consumer, or create the queue again")
        self.name, self.parts = name, parts


class QueueExistsError(QlayerError):
    def __init__(self, name: str, version: int) -> None:
        super().__init__(
            f"queue {name} already exists (version {version}); change it with "
            "`qlayer queue apply -f FILE`, or delete it first with `qlayer queue delete`"
        )
        self.name = name


class InvalidQueueFileError(QlayerError):
    """The queue file (or the flags of `queue create`) did not validate; nothing was changed."""

    def __init__(self, source: str, cause: QueueConfigError) -> None:
        super().__init__(f"{source}: {cause}\nnothing was changed; fix the above and run again")
        self.problems = cause.problems


class ConsumersAttachedError(QlayerError):
    """A delete would pull a queue from under live consumers."""

    def __init__(self, attached: Mapping[str, Sequence[str]]) -> None:
        listed = "; ".join(
            f"{queue}: {', '.join(sorted(ids))}" for queue, ids in sorted(attached.items())
        )
        super().__init__(
            f"consumers are attached ({listed}); stop or evict them "
            "(`qlayer consumers evict ID`) or repeat with --force; nothing was changed"
        )
        self.attached = {queue: list(ids) for queue, ids in attached.items()}


class ApplyConflictError(QueueVersionConflictError):
    """A queue changed between apply's diff and its write; says what the operator does next."""

    def __init__(self, name: str, expected: int, actual: int | None, *, hint: str) -> None:
        super().__init__(name, expected, actual)
        self.args = (f"{self.args[0]}; {hint}",)


class WaitTimedOutError(QlayerError):
    """A requested change was recorded but did not take effect within the wait."""


class InvalidFilterError(QlayerError):
    """An ack filter that does not compile; nothing was requested."""

    def __init__(self, filter: str, cause: ExpressionError) -> None:
        super().__init__(f"--filter {filter!r} is not a valid expression: {cause}; nothing was "
                         "requested (see docs/expressions.md)")


P = ParamSpec("P")
R = TypeVar("R")


def with_store_hints(method: Callable[P, R]) -> Callable[P, R]:
    """Add the operator's next step to the store errors people meet first (no schema yet,
    PostgreSQL not reachable); the store's own message stays in front."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except StoreError as exc:
            text = str(exc)
            if "relation" in text and "does not exist" in text:
                hint = "the database has no qlayer schema yet; run `qlayer db upgrade`"
            elif exc.retryable:
                hint = ("is PostgreSQL running there? check --database-url or "
                        "QLAYER_DATABASE_URL")
            else:
                raise
            raise StoreError(f"{text}; {hint}", retryable=exc.retryable) from exc

    return wrapper


# --- the diff ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FieldChange:
    field: str
    old: Any
    new: Any


@dataclass(frozen=True, slots=True)
class QueueChange:
    """What `apply` does (or would do) to one queue."""

    name: str
    action: Action
    version: int | None
    """The stored version before the change (None for a create)."""
    fields: tuple[FieldChange, ...] = ()
    definition: Mapping[str, Any] | None = None
    """The definition to store (None for a delete)."""


@dataclass(frozen=True, slots=True)
class ApplyPlan:
    changes: tuple[QueueChange, ...]
    prune: bool
    kept: tuple[str, ...] = ()
    """Without ``prune``: the stored queues the file does not name, left as they are."""

    @property
    def has_changes(self) -> bool:
        return any(change.action != "unchanged" for change in self.changes)

    def of(self, action: Action) -> list[QueueChange]:
        return [change for change in self.changes if change.action == action]


@dataclass(frozen=True, slots=True)
class ApplyResult:
    plan: ApplyPlan
    dry_run: bool
    versions: dict[str, int]
    """The version of every queue in the file after the apply (the stored one on a dry run)."""
    refused: dict[str, list[str]] = field(default_factory=dict)
    """On a dry run: the deletes the apply would refuse, with the consumers attached."""


def stored_form(definition: QueueDefinition) -> dict[str, Any]:
    """The JSON document the store keeps for a definition."""
    return definition.model_dump(mode="json")


def _normalised(record: QueueRecord) -> dict[str, Any] | None:
    """A stored definition in the stored form, or None when it no longer validates."""
    from layer.domain.definitions import QueueDefinition

    try:
        return stored_form(QueueDefinition.from_mapping(record.definition))
    except QueueConfigError:
        return None


def plan_apply(
    desired: Sequence[QueueDefinition], stored: Iterable[QueueRecord], *, prune: bool
) -> ApplyPlan:
    """Compare the file with the stored queues: create, change, delete (when pruning), keep.

    Definitions are compared in their stored form, so a queue written by another tool with
    defaults left out still counts as unchanged when it means the same.
    """
    current = {record.name: record for record in stored}
    changes: list[QueueChange] = []
    for definition in desired:
        wanted = stored_form(definition)
        record = current.get(definition.name)
        if record is None:
            changes.append(QueueChange(definition.name, "create", None, (), wanted))
            continue
        # A stored definition that no longer validates is compared as it was written, so the
        # diff shows what the operator will see replaced.
        have = _normalised(record) or dict(record.definition)
        fields = tuple(
            FieldChange(name, have.get(name), value)
            for name, value in wanted.items()
            if have.get(name) != value
        )
        action: Action = "change" if fields else "unchanged"
        changes.append(QueueChange(definition.name, action, record.version, fields, wanted))
    named = {definition.name for definition in desired}
    others = sorted(name for name in current if name not in named)
    if prune:
        changes.extend(QueueChange(name, "delete", current[name].version) for name in others)
        return ApplyPlan(tuple(changes), prune)
    return ApplyPlan(tuple(changes), prune, tuple(others))


def attached_consumers(name: str, consumers: Iterable[ConsumerRow]) -> list[ConsumerRow]:
    """The consumers subscribed to a queue, by its name or by a regex over queue names.

    A regex subscription must match the whole queue name, as the coordinator matches it.
    """
    found = []
    for row in consumers:
        if row.is_regex:
            try:
                matched = name_matcher(row.queue)(name)
            except re.error:
                matched = False
        else:
            matched = row.queue == name
        if matched:
            found.append(row)
    return found


# --- read models ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueSummary:
    name: str
    underlying_topic: str
    semantics: str
    version: int
    consumers: int


@dataclass(frozen=True, slots=True)
class PartitionFigures:
    """One journal partition as the queue sees it."""

    topic: str
    partition: int
    recovery_point: int | None
    """None until the coordinator recorded one (it reads the queue within a refresh)."""
    end_offset: int | None
    """None when Kafka was not asked or did not answer."""

    @property
    def backlog(self) -> int | None:
        """Journal records at or past the recovery point: not yet done by this queue."""
        if self.recovery_point is None or self.end_offset is None:
            return None
        return max(self.end_offset - self.recovery_point, 0)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a queue is served: its shard, the shard's holder (epoch) and whether that
    process still reports (`qlayer coordinators`)."""

    shard: int
    owner_id: str | None
    epoch: int | None
    host: str | None
    pid: int | None
    running: bool


@dataclass(frozen=True, slots=True)
class PartFigures:
    """One part of a queue of several parts (docs/coordinator.md, "Partitioned queues"):
    the shard serving it, that shard's holder, and its journal partitions."""

    part: int
    placement: Placement
    partitions: list[PartitionFigures]

    @property
    def journal_backlog(self) -> int | None:
        known = [p.backlog for p in self.partitions]
        if any(b is None for b in known):
            return None
        return sum(b for b in known if b is not None)


@dataclass(frozen=True, slots=True)
class QueueDescription:
    record: QueueRecord
    definition: dict[str, Any]
    counters: QueueCounters | None
    partitions: list[PartitionFigures]
    consumers: list[ConsumerRow]
    kafka_problem: str | None = None
    """Why the journal's end offsets are missing (Kafka unreachable), or None."""
    definition_problem: str | None = None
    """Why the stored definition no longer validates (the coordinator does not serve the
    queue until a valid one is applied), or None."""
    placement: Placement | None = None
    """The shard serving the queue and the process that runs it (None: not read)."""
    parts: list[PartFigures] = field(default_factory=list)
    """A queue of several parts: each part's shard, holder and partitions (empty for one)."""

    @property
    def owner(self) -> str | None:
        """The coordinator process running the queue's shard now, or None."""
        p = self.placement
        return p.owner_id if p is not None and p.running else None

    @property
    def journal_backlog(self) -> int | None:
        known = [p.backlog for p in self.partitions]
        if not known or any(b is None for b in known):
            return None
        return sum(b for b in known if b is not None)


@dataclass(frozen=True, slots=True)
class PurgeResult:
    name: str
    version: int
    requested_at: float
    purged_at: float | None = None
    """Set when the caller waited and the coordinator completed the purge."""


@dataclass(frozen=True, slots=True)
class AckResult:
    """`qlayer queue ack`: the request, or (``dry_run``) what it would take."""

    name: str
    filter: str
    dry_run: bool
    version: int | None = None
    requested_at: float | None = None
    #: Set when the caller waited: when the coordinator carried it out, and how many entries
    #: it acknowledged (None when another request it was joined with cannot be told apart).
    done_at: float | None = None
    acked: int | None = None
    #: Dry run: the entries matching now (a snapshot).
    matching: MatchCount | None = None


@dataclass(frozen=True, slots=True)
class ResetPartition:
    """One journal partition of a reset: its position before and after."""

    topic: str
    partition: int
    before: int | None
    """The stored recovery point; None when the coordinator has not recorded one yet."""
    after: int

    @property
    def passed(self) -> int:
        """Records the new position skips (forward): at most this many entries leave."""
        return 0 if self.before is None else max(self.after - self.before, 0)

    @property
    def replayed(self) -> int:
        """Records the new position goes back over (rewind): they enter the queue again."""
        return 0 if self.before is None else max(self.before - self.after, 0)


@dataclass(frozen=True, slots=True)
class ResetResult:
    name: str
    target: str
    dry_run: bool
    partitions: list[ResetPartition]
    consumers: list[str]
    version: int | None = None
    requested_at: float | None = None
    done_at: float | None = None

    @property
    def changes(self) -> list[ResetPartition]:
        return [p for p in self.partitions if p.before != p.after]


# --- the service ---------------------------------------------------------------------------------


@dataclass
class QueueService:
    """Queue definitions for operators. ``admin`` is made from settings when first needed."""

    store: Store
    settings: Settings | None = None
    admin: KafkaAdmin | None = None
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    poll_interval: float = 0.25
    _owned: list[Store] = field(default_factory=list, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> QueueService:
        store = Store(settings.database_url)
        return cls(store=store, settings=settings, _owned=[store])

    def close(self) -> None:
        for store in self._owned:
            store.close()

    def __enter__(self) -> QueueService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- apply -------------------------------------------------------------------------------------

    @with_store_hints
    def apply(
        self,
        text: str,
        *,
        source: str = "queue file",
        prune: bool = False,
        dry_run: bool = False,
        force: bool = False,
    ) -> ApplyResult:
        """Make the stored queues match a YAML queue file.

        Stored queues the file does not name are deleted only with ``prune`` (opt-in: on a
        shared database the file is rarely the whole truth). Nothing is written unless the
        whole file validates, and (without ``force``) no queue with consumers attached is
        deleted; a ``dry_run`` reports such deletes in ``refused`` instead of failing. Each
        queue is written with the version it was planned against, so a concurrent change
        makes the apply stop instead of overwrite it; running the same file again finishes
        the job (an identical definition keeps its version).
        """
        from layer.domain.definitions import load_queue_file

        try:
            desired = load_queue_file(text)
        except QueueConfigError as exc:
            raise InvalidQueueFileError(source, exc) from None
        plan = plan_apply(desired, self.store.list_queues(), prune=prune)
        deletes = plan.of("delete")
        if deletes and not force:
            consumers = self.store.load_consumers()
            attached = {
                change.name: [row.consumer_id for row in attached_consumers(change.name, consumers)]
                for change in deletes
            }
            attached = {name: ids for name, ids in attached.items() if ids}
            if attached and not dry_run:
                raise ConsumersAttachedError(attached)
        else:
            attached = {}
        versions = {c.name: c.version for c in plan.changes
                    if c.version is not None and c.action != "delete"}
        if dry_run:
            # A dry run answers the question "what would this do?"; a refusal is part of the
            # answer, not a reason to give none.
            return ApplyResult(plan, True, versions, attached)
        now = self.clock()
        for change in plan.changes:
            try:
                if change.action in ("create", "change"):
                    assert change.definition is not None
                    versions[change.name] = self.store.put_queue(
                        change.name, change.definition, now, expected_version=change.version
                    )
                elif change.action == "delete":
                    assert change.version is not None
                    self.store.delete_queue(change.name, now, expected_version=change.version)
            except UnknownQueueError:
                continue  # deleted by someone else meanwhile: what the file wants anyway
            except QueueVersionConflictError as exc:
                raise ApplyConflictError(
                    exc.name, exc.expected, exc.actual,
                    hint="someone changed it during this apply; see the new diff with "
                    "`qlayer queue apply --dry-run` and apply again",
                ) from exc
        return ApplyResult(plan, False, versions)

    # -- create ------------------------------------------------------------------------------------

    @with_store_hints
    def create(self, values: Mapping[str, object]) -> tuple[QueueDefinition, int]:
        """Create one queue from field values (snake_case, AMPS or kebab-case names).

        Refuses a name that is already defined: changing a queue is `apply`'s job, where the
        diff is shown.
        """
        from layer.domain.definitions import QueueDefinition

        try:
            definition = QueueDefinition.from_mapping(values)
        except QueueConfigError as exc:
            raise InvalidQueueFileError("queue create", exc) from None
        existing = self.store.get_queue(definition.name)
        if existing is not None:
            raise QueueExistsError(definition.name, existing.version)
        # Two operators creating one name at the same moment: the later write wins, as with
        # two applies; the store keeps both as versions.
        version = self.store.put_queue(definition.name, stored_form(definition), self.clock())
        return definition, version

    # -- read --------------------------------------------------------------------------------------

    @with_store_hints
    def list_queues(self) -> list[QueueSummary]:
        consumers = self.store.load_consumers()
        summaries = []
        for record in sorted(self.store.list_queues(), key=lambda r: r.name):
            definition = record.definition
            summaries.append(
                QueueSummary(
                    name=record.name,
                    underlying_topic=str(definition.get("underlying_topic") or record.name),
                    semantics=str(definition.get("semantics") or "at-least-once"),
                    version=record.version,
                    consumers=len(attached_consumers(record.name, consumers)),
                )
            )
        return summaries

    @with_store_hints
    def journal_of(self, name: str) -> str:
        """The queue's stored ``underlying_topic`` (a name or a regex): where its payloads are,
        for the pipeline jobs that read them."""
        record = self._live(name)
        return str(record.definition.get("underlying_topic") or record.name)

    @with_store_hints
    def describe(self, name: str, *, with_kafka: bool = True) -> QueueDescription:
        """The definition plus live figures: counters, recovery points, consumers, backlog.

        The journal backlog needs Kafka (end offsets); when Kafka does not answer, the rest is
        still returned and ``kafka_problem`` says why the backlog is missing.
        """
        from layer.domain.definitions import QueueDefinition

        record = self._live(name)
        definition_problem: str | None = None
        try:
            definition = stored_form(QueueDefinition.from_mapping(record.definition))
        except QueueConfigError as exc:
            definition = dict(record.definition)
            definition_problem = str(exc)
        points = {
            (key.topic, key.partition): offset
            for key, offset in self.store.load_recovery_points(name).items()
        }
        counters = self.store.load_counters(name).get(name)
        consumers = attached_consumers(name, self.store.load_consumers())
        ends: dict[tuple[str, int], int] = {}
        kafka_problem: str | None = None
        pairs = set(points)
        if with_kafka:
            try:
                pairs |= set(self._journal_partitions(record))
                ends = self._admin().end_offsets(sorted(pairs), timeout=KAFKA_TIMEOUT)
            except QlayerError as exc:
                # The figures from PostgreSQL are still worth showing.
                servers = (self.settings or Settings.load()).bootstrap_servers
                kafka_problem = (f"Kafka at {servers} did not answer ({exc}); check "
                                 "--bootstrap-servers or QLAYER_BOOTSTRAP_SERVERS")
        partitions = [
            PartitionFigures(topic, partition, points.get((topic, partition)),
                             ends.get((topic, partition)))
            for topic, partition in sorted(pairs)
        ]
        return QueueDescription(record, definition, counters, partitions, consumers,
                                kafka_problem, definition_problem, self._placement(record),
                                self._parts(record, partitions))

    def _parts(self, record: QueueRecord, partitions: list[PartitionFigures]
               ) -> list[PartFigures]:
        if record.parts == 1:
            return []
        shards = record.part_shards(self.store.shard_count())
        return [PartFigures(k, self._placement(record, shard),
                            [p for p in partitions if part_of(p.partition, record.parts) == k])
                for k, shard in enumerate(shards)]

    def _placement(self, record: QueueRecord, shard: int | None = None) -> Placement:
        shard = record.shard if shard is None else shard
        owner = self.store.owner(str(shard))
        if owner is None:
            return Placement(shard, None, None, None, None, False)
        process = next((p for p in self.store.processes() if p.owner_id == owner.owner_id),
                       None)
        running = process is not None and time.time() - process.seen_at <= STALE_AFTER
        return Placement(shard, owner.owner_id, owner.epoch,
                         process.host if process else None, process.pid if process else None,
                         running)

    # -- delete / purge ----------------------------------------------------------------------------

    @with_store_hints
    def delete(self, name: str, *, force: bool = False) -> int:
        """Delete a queue; refuses while consumers are attached unless ``force``.

        Returns the version the deletion wrote. The coordinator stops serving the queue and
        forgets its state within its refresh interval; its journals are untouched.
        """
        record = self._live(name)
        if not force:
            attached = attached_consumers(name, self.store.load_consumers())
            if attached:
                raise ConsumersAttachedError({name: [row.consumer_id for row in attached]})
        try:
            return self.store.delete_queue(name, self.clock(), expected_version=record.version)
        except UnknownQueueError:
            raise NoSuchQueueError(name) from None

    @with_store_hints
    def purge(self, name: str, *, wait: float | None = None) -> PurgeResult:
        """Ask the owning coordinator to empty the queue (every entry up to the journal's end).

        With ``wait`` (seconds), poll until the coordinator reports it done; raises
        `WaitTimedOutError` when it has not by then (the request stays recorded).
        """
        self._whole(name, "a purge")
        requested_at = self.clock()
        try:
            version = self.store.request_purge(name, requested_at)
        except UnknownQueueError:
            raise NoSuchQueueError(name) from None
        if wait is None:
            return PurgeResult(name, version, requested_at)
        record = self._wait(name, wait, lambda r: r.purged_at is not None
                            and not r.purge_pending, "the purge", "purge")
        assert record.purged_at is not None
        return PurgeResult(name, version, requested_at, record.purged_at)

    @with_store_hints
    def ack(self, name: str, filter: str, *, dry_run: bool = False,
            wait: float | None = None) -> AckResult:
        """Ask the owning coordinator to acknowledge the entries matching ``filter`` (AMPS: a
        sow_delete with a filter), whether leased or not; each gets its ACKED event.

        ``dry_run`` counts the matching entries from the stored state and the journals (a
        snapshot; see `layer.services.views`) and requests nothing. With ``wait`` (seconds),
        poll until the coordinator reports it done (`WaitTimedOutError` otherwise).
        """
        from layer.domain.expressions import compile_expression

        try:
            compile_expression(filter)
        except ExpressionError as exc:
            raise InvalidFilterError(filter, exc) from None
        self._whole(name, "an ack by filter")
        if dry_run:
            settings = self.settings or Settings.load()
            from layer.services.views import count_matching

            matching = count_matching(settings, name, now=self.clock(), filter=filter)
            return AckResult(name, filter, True, matching=matching)
        requested_at = self.clock()
        try:
            version = self.store.request_purge(name, requested_at, filter)
        except UnknownQueueError:
            raise NoSuchQueueError(name) from None
        if wait is None:
            return AckResult(name, filter, False, version, requested_at)
        record = self._wait(name, wait, lambda r: r.purged_at is not None
                            and not r.purge_pending, f"the ack by filter {filter!r}",
                            "acknowledge them")
        return AckResult(name, filter, False, version, requested_at, record.purged_at,
                         record.purge_acked if record.purge_filter == filter else None)

    @with_store_hints
    def reset(self, name: str, to: str, *, dry_run: bool = False, force: bool = False,
              wait: float | None = None) -> ResetResult:
        """Move the queue's positions (`qlayer queue reset`): the owning coordinator rebuilds
        the queue from ``to`` (beginning, end, an ISO timestamp, or PARTITION:OFFSET,...).

        Refused while consumers are attached unless ``force``: entries they hold before a new
        position are acknowledged under them, and a rewind delivers again what they processed.
        ``dry_run`` says per partition what would move (positions as the broker resolves the
        target now; the coordinator resolves it again when it carries the reset out).
        """
        target = parse_target(to)
        record = self._whole(name, "a reset")
        attached = [row.consumer_id for row in attached_consumers(name,
                                                                   self.store.load_consumers())]
        partitions = self._reset_plan(record, target)
        if dry_run:
            return ResetResult(name, target.text, True, partitions, attached)
        if attached and not force:
            raise ConsumersAttachedError({name: attached})
        requested_at = self.clock()
        try:
            version = self.store.request_reset(name, target.text, requested_at)
        except UnknownQueueError:
            raise NoSuchQueueError(name) from None
        if wait is None:
            return ResetResult(name, target.text, False, partitions, attached, version,
                               requested_at)
        done = self._wait(name, wait, lambda r: not r.reset_pending, "the reset",
                          "reset it")
        return ResetResult(name, target.text, False, partitions, attached, version,
                           requested_at, done.reset_done_at)

    def _whole(self, name: str, what: str) -> QueueRecord:
        """The live queue, refused (`PartitionedQueueError`) when it has several parts."""
        record = self._live(name)
        if record.parts > 1:
            raise PartitionedQueueError(name, record.parts, what)
        return record

    def _reset_plan(self, record: QueueRecord, target: ResetTarget) -> list[ResetPartition]:
        pairs = self._journal_partitions(record)
        after = resolve_target(target, pairs, self._admin())
        before = {(key.topic, key.partition): offset
                  for key, offset in self.store.load_recovery_points(record.name).items()}
        return [ResetPartition(topic, partition, before.get((topic, partition)), offset)
                for (topic, partition), offset in sorted(after.items())]

    def _wait(self, name: str, wait: float, done: Callable[[QueueRecord], bool], what: str,
              does: str) -> QueueRecord:
        deadline = time.monotonic() + wait
        while True:
            record = self.store.get_queue(name)
            if record is None:
                raise NoSuchQueueError(name)
            if done(record):
                return record
            if time.monotonic() >= deadline:
                raise WaitTimedOutError(
                    f"{what} of {name} is requested but no coordinator completed it within "
                    f"{wait:g}s; check that one runs (`qlayer coordinator run`) — it will "
                    f"{does} when it does"
                )
            self.sleep(self.poll_interval)

    # -- helpers -----------------------------------------------------------------------------------

    def _live(self, name: str) -> QueueRecord:
        record = self.store.get_queue(name)
        if record is None:
            raise NoSuchQueueError(name)
        return record

    def _admin(self) -> KafkaAdmin:
        if self.admin is None:
            settings = self.settings or Settings.load()
            # librdkafka would print every failed connection attempt to stderr; describe says
            # once, in its answer, that the journal offsets are unavailable and why.
            from layer.kafka.admin import KafkaAdmin

            self.admin = KafkaAdmin(settings.kafka_config(log_level=0))
        return self.admin

    def _journal_partitions(self, record: QueueRecord) -> list[tuple[str, int]]:
        """The journal partitions the queue reads: topics its underlying_topic matches."""
        from layer.domain.definitions import QueueDefinition

        try:
            definition = QueueDefinition.from_mapping(record.definition)
        except QueueConfigError:
            return []
        topics = TopicNames((self.settings or Settings.load()).topic_prefix)
        return [
            (topic, partition)
            for topic, count in sorted(self._admin().topics(timeout=KAFKA_TIMEOUT).items())
            if not topics.is_internal(topic) and definition.matches_topic(topic)
            for partition in range(count)
        ]
