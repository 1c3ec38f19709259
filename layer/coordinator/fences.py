"""Fencing a transactional session before any of its leases is broken (exactly-once
processing, protocol 9; docs/sdk.md "Exactly-once processing").

A transactional consumer settles a message inside its own Kafka transaction, with the
output that message produced: the ACCEPT reaches the ack topic only when that transaction
commits, and the coordinator reads acks ``read_committed``. So a lease that ran out may still
have a committed ACCEPT on its way, or an open transaction that would commit later, after the
message was given to another consumer: its output twice. Before a transactional session
loses a lease (its lease ran out, its session timed out, an operator evicted it, its consumer
id subscribed again), the shard

1. fences the session's ``transactional.id``: initialising a producer with it aborts any open
   transaction of it and bars the old producer from writing again (Kafka's InitProducerId);
2. takes the end (high watermark) of its ack partition, then reads on until every record
   below it is read ``read_committed`` (every transaction open then has ended) and applied;
3. only then ends the session: what was committed is settled, the rest is broken and goes to
   other consumers.

This module is the bookkeeping of those steps (`Fences`, pure, ``now`` passed in) and the
core's part in them (`want_fences`, `finish_fences`: no I/O); the shard makes the Kafka calls
off its loop (`layer.kafka.fence.Fencer`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from layer.protocol import SessionEndReason

if TYPE_CHECKING:
    from layer.coordinator.core import ShardCore
    from layer.coordinator.sessions import Session
    from layer.kafka import OutgoingRecord
    from layer.store.batch import WriteBatch

log = logging.getLogger(__name__)

__all__ = ["Fence", "Fences", "finish_fences", "want_fences"]

#: The first pause after a fence that failed (a broker away, a coordinator of transactions
#: moving); doubled each time up to `MAX_RETRY_PAUSE`. The session's leases stay held.
RETRY_PAUSE = 0.5
MAX_RETRY_PAUSE = 10.0


@dataclass
class Fence:
    """One session to fence and end."""

    consumer_id: str
    session_id: str
    transactional_id: str
    #: What the consumer is told when its session ends, and why.
    end: SessionEndReason
    message: str
    #: The high watermark of the shard's ack partition taken after the producer was fenced:
    #: the session ends once the shard has read and applied everything below it.
    ack_end: int | None = None
    failures: int = 0
    next_try: float = 0.0
    #: The fence is being made (off the shard's loop, `layer.coordinator.shard`).
    in_flight: bool = False


class Fences:
    """The sessions of one shard waiting for a fence, by consumer id."""

    def __init__(self) -> None:
        self.pending: dict[str, Fence] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def want(self, consumer_id: str, session_id: str, transactional_id: str,
             end: SessionEndReason, message: str) -> bool:
        """Ask for the session to be fenced and ended; False when it already waits (the
        first reason is kept: a session that timed out and is then evicted ends once)."""
        found = self.pending.get(consumer_id)
        if found is not None and found.session_id == session_id:
            return False
        self.pending[consumer_id] = Fence(consumer_id, session_id, transactional_id, end,
                                          message)
        return True

    def to_fence(self, now: float) -> list[Fence]:
        """Sessions whose producer is not fenced yet and may be tried now."""
        return [f for f in self.pending.values()
                if f.ack_end is None and not f.in_flight and f.next_try <= now]

    def fenced(self, fence: Fence, ack_end: int) -> None:
        """The producer is fenced; the ack partition ended at ``ack_end`` afterwards."""
        fence.in_flight = False
        if self.pending.get(fence.consumer_id) is fence:
            fence.ack_end = ack_end

    def failed(self, fence: Fence, now: float) -> float:
        """The fence could not be made now: tried again after a pause (returned)."""
        fence.in_flight = False
        fence.failures += 1
        pause: float = min(RETRY_PAUSE * 2.0 ** (fence.failures - 1), MAX_RETRY_PAUSE)
        fence.next_try = now + pause
        return pause

    def ready(self, read_to: int | None) -> list[Fence]:
        """Fenced sessions whose committed settlements are all read: the shard's ack
        partition is read (``read_committed``) to ``read_to``, at or past their ack end.
        Taken out of the pending ones."""
        if read_to is None:
            return []
        done = [f for f in self.pending.values()
                if f.ack_end is not None and read_to >= f.ack_end]
        for fence in done:
            del self.pending[fence.consumer_id]
        return done

    def forget(self, consumer_id: str, session_id: str | None = None) -> None:
        """The session ended otherwise (its consumer unsubscribed): no fence is needed."""
        found = self.pending.get(consumer_id)
        if found is not None and (session_id is None or found.session_id == session_id):
            del self.pending[consumer_id]


def want_fences(core: ShardCore, now: float) -> None:
    """Transactional sessions the engines hold (a lease ran out, the session timed out):
    fenced before anything of theirs is broken."""
    for engine in core.engines.values():
        for consumer_id in engine.take_fences():
            session = core.sessions.get(consumer_id)
            if session is None or session.transactional_id is None:
                # No session here to fence (it cannot happen: the engine is told by the
                # session); held forever would be worse than breaking the leases.
                engine.fenced(consumer_id, now)
                continue
            timed_out = now >= _last_seen(core, session) + session.session_timeout
            core.fence_first(session, SessionEndReason.TIMED_OUT, (
                "no heartbeat within the session timeout" if timed_out else
                "a lease of this transactional session ran out") + "; its producer was "
                "fenced and what it committed was applied")


def _last_seen(core: ShardCore, session: Session) -> float:
    seen = [c.last_seen for name in session.every_queue if name in core.engines
            for c in core.engines[name].consumers() if c.consumer_id == session.consumer_id]
    return max(seen, default=float("-inf"))


def finish_fences(core: ShardCore, now: float, batch: WriteBatch,
                  replies: list[OutgoingRecord]) -> None:
    """End the fenced sessions whose committed settlements are all applied: every ack record
    below the fence's ack end was read (`ShardCore.ack_read_to`) and none waits."""
    if core.acks_waiting():
        return
    for fence in core.fences.ready(core.ack_read_to):
        session = core.sessions.get(fence.consumer_id)
        if session is None or session.session_id != fence.session_id:
            continue  # ended meanwhile (its consumer unsubscribed)
        for name in session.every_queue:
            engine = core.engines.get(name)
            if engine is not None:
                engine.fenced(fence.consumer_id, now)
        core.counters["sessions_fenced"] += 1
        core.control.end_session(fence.consumer_id, now, batch, replies, fence.message,
                                 end=fence.end, fenced=True)
