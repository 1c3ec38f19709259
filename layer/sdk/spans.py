"""A subscription whose queues are on several shards (protocol 8): its parts and its credit.

A Subscribe by key whose regex matches queues of several shards is refused with their list
(``qlayer.refusal: spans_shards``, ``qlayer.shards``); the consumer then subscribes on its
*home* shard first (the lowest of them), then on each other shard with the same session id
and secret; every such record carries ``qlayer.credit: <home>``
and its ``max_backlog`` is the credit granted to that shard (`layer.sdk.credit`). The shards
answer and send credit notices; this module keeps what they said and says which records to
send next. The consumer (`layer.sdk.consumer`) does the sending and reading.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from layer.protocol.headers import CREDIT
from layer.sdk.credit import CreditLedger, CreditReport

__all__ = ["Spans"]


@dataclass
class Spans:
    """The parts of one session over several shards."""

    home: int
    ledger: CreditLedger
    #: Subscribe and Replace request ids not answered yet -> the shard they went to.
    requests: dict[str, int] = field(default_factory=dict)
    #: Queue -> the shard that granted it (acks of its messages go to that shard's partition).
    queue_shard: dict[str, int] = field(default_factory=dict)
    #: Requests nobody waits for (parts joined later, the home made spanning): answered as
    #: they come.
    unawaited: set[str] = field(default_factory=set)
    #: Queues of several parts -> the shard of each part (docs/coordinator.md, "Partitioned
    #: queues"): a message's acks go to the shard of its journal partition's part.
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def header(self) -> tuple[str, bytes]:
        return (CREDIT, b"%d" % self.home)

    @property
    def shards(self) -> list[int]:
        """The shards holding a part of the session, home first."""
        return sorted(self.ledger.shards, key=lambda s: (s != self.home, s))

    def shard_of(self, queue: str, partition: int | None = None) -> int:
        """The shard a message of ``queue`` from journal ``partition`` is settled on."""
        if partition is not None:
            shards = self.parts.get(queue)
            if shards:
                return shards[partition % len(shards)]
        return self.queue_shard.get(queue, self.home)

    def sent(self, shard: int, request_id: str, grant: int) -> None:
        self.ledger.sent(shard, request_id, grant)
        self.requests[request_id] = shard

    def answered(self, request_id: str, ok: bool, queues: Iterable[str],
                 report: tuple[int, int, int] | None) -> int | None:
        """A SubscribeResult for one of the parts' requests; the shard it came from (None when
        the request is not one of them)."""
        shard = self.requests.pop(request_id, None)
        if shard is None:
            return None
        if not ok:
            self.ledger.refused(shard, request_id)
            if request_id in self.unawaited and shard != self.home:
                self.drop(shard)  # a part that did not join: tried again later
            self.unawaited.discard(request_id)
            return shard
        for queue in queues:
            self.queue_shard[queue] = shard
        if report is not None:
            self.ledger.confirmed(shard, request_id, CreditReport(*report))
        return shard

    def ready_to_join(self) -> bool:
        """Whether parts may join: the home part applies a grant (it holds the session as a
        spanning one, so the other shards accept parts of it)."""
        home = self.ledger.shards.get(self.home)
        return home is not None and home.applied is not None

    def reported(self, shard: int, report: tuple[int, int, int], delivered: int) -> None:
        self.ledger.reported(shard, CreditReport(*report), delivered)

    def delivered(self, queue: str, partition: int | None = None) -> None:
        """A message of ``queue`` came: its shard has taken its turn of the remainder."""
        credit = self.ledger.shards.get(self.shard_of(queue, partition))
        if credit is not None:
            credit.delivered += 1

    def drop(self, shard: int) -> None:
        """The shard's part ended (refused, timed out, its queues gone): its credit is free."""
        self.ledger.remove(shard)
        for request_id in [r for r, s in self.requests.items() if s == shard]:
            del self.requests[request_id]
        for queue in [q for q, s in self.queue_shard.items() if s == shard]:
            del self.queue_shard[queue]

