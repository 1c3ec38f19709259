"""What a coordinator process knows of every queue, consumer and principal (all shards), from
PostgreSQL.

Loaded once per refresh by the process and shared by its shard loops: each serves the queues
of its own shard and uses the rest to pass records on to the shard that serves them. A shard
that is asked about something the catalog does not know yet (a queue applied a moment ago, a
principal just added) asks for a load before it refuses (`Control`, "held" records).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from layer.domain.authorization import Entitlements
from layer.domain.likepattern import name_matcher
from layer.domain.shards import part_of
from layer.store.rows import ConsumerRow, QueueRecord

__all__ = ["Catalog"]


@dataclass(frozen=True)
class Catalog:
    shard_count: int
    queues: dict[str, QueueRecord] = field(default_factory=dict)
    consumers: dict[str, ConsumerRow] = field(default_factory=dict)
    loaded_at: float = 0.0
    entitlements: Entitlements = field(default_factory=Entitlements)
    #: Parts of sessions on shards other than their home (protocol 8), by (consumer id, shard).
    spans: dict[tuple[str, int], ConsumerRow] = field(default_factory=dict)

    @classmethod
    def of(cls, shard_count: int, queues: Iterable[QueueRecord],
           consumers: Iterable[ConsumerRow], now: float,
           entitlements: Entitlements | None = None,
           spans: Iterable[ConsumerRow] = ()) -> Catalog:
        return cls(shard_count, {q.name: q for q in queues},
                   {c.consumer_id: c for c in consumers}, now,
                   entitlements if entitlements is not None else Entitlements(),
                   {(c.consumer_id, c.shard if c.shard is not None else -1): c for c in spans})

    @property
    def session_rows(self) -> list[ConsumerRow]:
        """Every stored session part: the consumers' rows, then the parts on other shards."""
        return [*self.consumers.values(), *self.spans.values()]

    def home_holds(self, consumer_id: str, session_id: str, home: int,
                   secret_hash: bytes | None) -> bool:
        """Whether the stored home row of ``consumer_id`` is on shard ``home`` and holds that
        session with that secret (a part on another shard may join it; protocol 8)."""
        row = self.consumers.get(consumer_id)
        return (row is not None and row.session_id == session_id and row.shard == home
                and row.credit_home == home and row.secret_hash == secret_hash)

    def live_elsewhere(self, consumer_id: str, shard: int, now: float) -> ConsumerRow | None:
        """The stored session of ``consumer_id`` another shard holds, if it is live (a
        heartbeat within its session timeout): one consumer id has one session."""
        row = self.consumers.get(consumer_id)
        if row is None or row.shard is None or row.shard == shard:
            return None
        if row.last_heartbeat_at + row.session_timeout_ms / 1000.0 < now:
            return None
        return row

    def shard_of(self, queue: str, partition: int | None = None) -> int | None:
        """The shard serving the queue (its first part), or, given a journal partition, the
        part of the queue that partition is in."""
        record = self.queues.get(queue)
        if record is None:
            return None
        if partition is None or record.parts == 1:
            return record.shard
        return record.part_shards(self.shard_count)[part_of(partition, record.parts)]

    def shards_of(self, record: QueueRecord) -> tuple[int, ...]:
        """The shards serving the queue's parts (one for a queue of one part)."""
        return record.part_shards(self.shard_count)

    def on_shard(self, shard: int) -> dict[str, QueueRecord]:
        """The queues with a part on the shard."""
        return {n: q for n, q in self.queues.items()
                if q.shard == shard or (q.parts > 1 and shard in self.shards_of(q))}

    def parts_on(self, record: QueueRecord, shard: int) -> frozenset[int] | None:
        """The parts of a queue of several parts the shard serves; None for a queue of one."""
        if record.parts == 1:
            return None
        return frozenset(k for k, s in enumerate(self.shards_of(record)) if s == shard)

    def shards_matching(self, queue: str, is_regex: bool) -> set[int]:
        """The shards of the queues a subscription names (a name, or a regex over names).
        Raises ``re.error`` for an invalid regex."""
        if not is_regex:
            found = self.queues.get(queue)
            return set() if found is None else set(self.shards_of(found))
        matches = name_matcher(queue)
        return {s for n, q in self.queues.items() if matches(n) for s in self.shards_of(q)}

    def consumer_shards(self, consumer_id: str, session_id: str) -> set[int]:
        """The shards serving a known session's queues (empty when the session is unknown)."""
        row = self.consumers.get(consumer_id)
        if row is None or row.session_id != session_id:
            return set()
        try:
            return self.shards_matching(row.queue, row.is_regex)
        except re.error:
            return set()
