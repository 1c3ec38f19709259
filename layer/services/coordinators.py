"""What `qlayer coordinators` and `qlayer stats` say about the coordinator processes and
shards: who runs which shard, under which epoch, how far behind, and which shards nobody runs.

Read from PostgreSQL only: every process reports itself and its shards' lag every few
seconds (`CoordinatorOptions.report_interval`).
"""

from __future__ import annotations

from dataclasses import dataclass

from layer.domain.shards import part_shards
from layer.store.rows import Ownership, ProcessRow, QueueMove
from layer.store.store import Store

__all__ = ["STALE_AFTER", "CoordinatorStatus", "ShardStatus", "coordinator_status", "move_queue"]

#: A process that has not reported for this long is shown as silent (it reports every 2 s;
#: a killed one keeps its row until the others drop it after a minute).
STALE_AFTER = 10.0


@dataclass(frozen=True)
class ShardStatus:
    shard: int
    owner_id: str | None
    epoch: int | None
    queues: int
    lag: int | None
    reported_at: float | None
    #: The owner is a process that reports (not a killed one whose shard awaits the group).
    running: bool
    #: Parts of queues of several parts served here, as ``queue[part]`` (the first part of
    #: such a queue is counted in ``queues`` too; docs/coordinator.md "Partitioned queues").
    parts: tuple[str, ...] = ()


@dataclass(frozen=True)
class CoordinatorStatus:
    shard_count: int
    processes: list[ProcessRow]
    shards: list[ShardStatus]
    now: float

    def live(self, process: ProcessRow) -> bool:
        return self.now - process.seen_at <= STALE_AFTER

    @property
    def unowned(self) -> list[ShardStatus]:
        """Shards with queues and no running owner: their queues are not being served."""
        return [s for s in self.shards if s.queues and not s.running]


def coordinator_status(store: Store, now: float) -> CoordinatorStatus:
    count = store.shard_count()
    processes = store.processes()
    owners: dict[int, Ownership] = {int(o.shard): o for o in store.owners()
                                    if o.shard.isdigit()}
    queues = store.queues_per_shard()
    parts: dict[int, list[str]] = {}
    for name, first, n in store.partitioned_queues():
        for k, shard in enumerate(part_shards(first, n, count)):
            parts.setdefault(shard, []).append(f"{name}[{k}]")
            if k:
                queues[shard] = queues.get(shard, 0) + 1  # its first part is counted already
    live = {p.owner_id for p in processes if now - p.seen_at <= STALE_AFTER}
    shards = []
    for shard in range(count):
        owner = owners.get(shard)
        shards.append(ShardStatus(
            shard=shard, owner_id=owner.owner_id if owner else None,
            epoch=owner.epoch if owner else None, queues=queues.get(shard, 0),
            lag=owner.lag if owner else None, reported_at=owner.reported_at if owner else None,
            running=owner is not None and owner.owner_id in live,
            parts=tuple(parts.get(shard, ()))))
    return CoordinatorStatus(count, processes, shards, now)


def move_queue(store: Store, name: str, shard: int, now: float) -> QueueMove:
    """`qlayer queue move`: see `Store.move_queue`."""
    return store.move_queue(name, shard, now)
