"""What a coordinator process shows its metrics endpoint: a snapshot its loop takes.

The loop is single-threaded and hot, so nothing here runs per message. The process takes one
`Snapshot` per report period (`CoordinatorProcess._report`, every ``report_interval``), on its
own thread, from figures its parts already keep: each loop's counters and phase times, each
queue engine's ``stats()``, ``consumers()`` and ``recovery_points()``, the readers' cached end
offsets and the queues' stored totals. The HTTP thread only reads the latest snapshot (one
reference, replaced whole), so it never touches the loop's objects.

Pure: no I/O, no Prometheus; `layer.coordinator.metrics` turns a snapshot into metric families.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from layer.coordinator.phases import PhaseTimes
from layer.domain.engine import ConsumerInfo, QueueStats

__all__ = [
    "ConsumerFigures",
    "EngineView",
    "PartitionLag",
    "QueueFigures",
    "Readiness",
    "ShardFigures",
    "Snapshot",
    "loop_figures",
]


@dataclass(frozen=True, slots=True)
class QueueFigures:
    """One queue served by this process, from its engine's ``stats()``."""

    queue: str
    shard: int
    available: int
    leased: int
    delayed: int
    #: INACTIVE entries in memory plus the offsets deferred past ``target_queue_depth`` and
    #: not read back yet (an upper bound: the engine's ``not_read``).
    inactive: int
    consumers: int
    #: Seconds since the first AVAILABLE entry (in delivery order) was enqueued; None: none.
    oldest_available_age: float | None

    @property
    def depth(self) -> int:
        """Entries in the queue that are not done: available, leased, delayed or inactive."""
        return self.available + self.leased + self.delayed + self.inactive


@dataclass(frozen=True, slots=True)
class ConsumerFigures:
    queue: str
    consumer_id: str
    backlog: int
    max_backlog: int


def by_queue(queues: Iterable[QueueFigures]) -> list[QueueFigures]:
    """One figure per queue: the parts of a queue of several parts this process serves
    (docs/coordinator.md, "Partitioned queues") summed, so a metric has one series per
    queue. Consumers are subscribed to every part: the most any part counts; the oldest
    entry is the oldest of any part; the shard is the lowest of the parts here."""
    merged: dict[str, QueueFigures] = {}
    for q in queues:
        seen = merged.get(q.queue)
        if seen is None:
            merged[q.queue] = q
            continue
        ages = [a for a in (seen.oldest_available_age, q.oldest_available_age) if a is not None]
        merged[q.queue] = QueueFigures(
            q.queue, min(seen.shard, q.shard), seen.available + q.available,
            seen.leased + q.leased, seen.delayed + q.delayed, seen.inactive + q.inactive,
            max(seen.consumers, q.consumers), max(ages) if ages else None)
    return list(merged.values())


def by_consumer(consumers: Iterable[ConsumerFigures]) -> list[ConsumerFigures]:
    """One figure per queue and consumer: a consumer's leases and grants in the parts of a
    queue of several parts summed (its one backlog is spread over them as credit)."""
    merged: dict[tuple[str, str], ConsumerFigures] = {}
    for c in consumers:
        key = (c.queue, c.consumer_id)
        seen = merged.get(key)
        merged[key] = c if seen is None else ConsumerFigures(
            c.queue, c.consumer_id, seen.backlog + c.backlog, seen.max_backlog + c.max_backlog)
    return list(merged.values())


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """How far a queue's recovery point is behind the end of one journal partition."""

    queue: str
    topic: str
    partition: int
    recovery_point: int
    end_offset: int

    @property
    def lag(self) -> int:
        return max(self.end_offset - self.recovery_point, 0)


@dataclass(frozen=True, slots=True)
class ShardFigures:
    """One shard loop of this process: running (``epoch`` set) or revoked (counters kept)."""

    shard: int
    epoch: int | None
    input_lag: int | None
    counters: Mapping[str, int]
    #: Per phase (`layer.coordinator.phases.PHASES`): cumulative bucket counts, µs summed.
    phase_buckets: tuple[tuple[int, ...], ...]
    phase_sums_us: tuple[int, ...]
    #: The shard's stored totals of faults and refusals (`layer.coordinator.faults`): exact
    #: across restarts and owners; empty for a shard this process does not run.
    stored: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the process does its job now, and if not, why (``/readyz``)."""

    ready: bool
    #: Shards it runs; an empty tuple with ``ready``: a healthy hot standby.
    shards: tuple[int, ...] = ()
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    taken_at: float
    owner_id: str
    core: str
    readiness: Readiness
    queues: tuple[QueueFigures, ...] = ()
    #: Per queue, its stored running totals (`layer.store.tables.COUNTER_NAMES`): the same
    #: figures as `qlayer stats`, since the queue was created, whichever process served it.
    totals: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    partitions: tuple[PartitionLag, ...] = ()
    consumers: tuple[ConsumerFigures, ...] = ()
    #: Ack items read per consumer id since this process started (live sessions only).
    consumer_acks: Mapping[str, int] = field(default_factory=dict)
    shards: tuple[ShardFigures, ...] = ()
    process_counters: Mapping[str, int] = field(default_factory=dict)


def _phase_figures(phases: PhaseTimes) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    return (tuple(tuple(phases.cumulative(i)) for i in range(len(phases.buckets))),
            tuple(phases.sums))


class EngineView(Protocol):
    """What `loop_figures` reads from a queue engine (the Python and the native one)."""

    def stats(self) -> QueueStats: ...

    def consumers(self) -> list[ConsumerInfo]: ...

    def recovery_points(self) -> dict[tuple[str, int], int]: ...


def loop_figures(
    shard: int,
    epoch: int | None,
    engines: Mapping[str, EngineView],
    sessions: Iterable[str],
    consumer_acks: dict[str, int],
    counters: Mapping[str, int],
    phases: PhaseTimes,
    input_lag: int | None,
    end_offsets: Mapping[tuple[str, int], int],
    now: float,
    stored: Mapping[str, int] | None = None,
) -> tuple[ShardFigures, list[QueueFigures], list[ConsumerFigures], list[PartitionLag]]:
    """One loop's figures. ``consumer_acks`` is pruned to ``sessions`` here (on the loop's
    thread): a consumer that left is not shown, and its count is not kept forever."""
    live = set(sessions)
    for gone in [c for c in consumer_acks if c not in live]:
        del consumer_acks[gone]
    queues: list[QueueFigures] = []
    consumers: list[ConsumerFigures] = []
    partitions: list[PartitionLag] = []
    for name, engine in sorted(engines.items()):
        stats = engine.stats()
        oldest = stats.oldest_available_at
        queues.append(QueueFigures(
            queue=name, shard=shard, available=stats.available, leased=stats.leased,
            delayed=stats.delayed, inactive=stats.inactive + stats.not_read,
            consumers=stats.consumers,
            oldest_available_age=None if oldest is None else max(now - oldest, 0.0)))
        consumers.extend(ConsumerFigures(name, c.consumer_id, c.backlog, c.max_backlog)
                         for c in engine.consumers())
        for (topic, partition), point in sorted(engine.recovery_points().items()):
            end = end_offsets.get((topic, partition))
            if end is not None:
                partitions.append(PartitionLag(name, topic, partition, point, end))
    buckets, sums = _phase_figures(phases)
    figures = ShardFigures(shard=shard, epoch=epoch, input_lag=input_lag,
                           counters=dict(counters), phase_buckets=buckets, phase_sums_us=sums,
                           stored=dict(stored or {}))
    return figures, queues, consumers, partitions
