"""Pure translations between the queue engine, the store and the wire protocol.

The engine speaks seconds, its own enums and NamedTuple bookmarks; the store speaks rows; the
wire speaks milliseconds and the protocol's spellings. Keeping every mapping here keeps the
coordinator loop about order of operations only.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Final, NamedTuple, cast

from layer.domain import events as ev
from layer.domain.entries import EntryRecord
from layer.domain.states import Bookmark, EntryState, ExpiryReason, LeaveReason
from layer.protocol import Bookmark as WireBookmark
from layer.protocol import Event, EventType, LeaseEndReason
from layer.store.batch import WriteBatch
from layer.store.rows import EntryRow

_new: Final = tuple.__new__
_STORE_STATE = {
    EntryState.AVAILABLE: "AVAILABLE",
    # DELAYED and INACTIVE are AVAILABLE entries that may not be delivered yet; the store
    # keeps the time they become deliverable (available_at), the rest is rebuilt on restart.
    EntryState.DELAYED: "AVAILABLE",
    EntryState.INACTIVE: "AVAILABLE",
    EntryState.LEASED: "LEASED",
    EntryState.ACKED: "ACKED",
    EntryState.EXPIRED: "EXPIRED",
}

_ENGINE_STATE = {"AVAILABLE": EntryState.AVAILABLE, "LEASED": EntryState.LEASED,
                 "ACKED": EntryState.ACKED, "EXPIRED": EntryState.EXPIRED}

# Why a lease was broken, as docs/protocol.md §11 spells it on LEASE_EXPIRED events. A new
# session of the same consumer id ends the old session as an unsubscribe would.
_LEASE_END = {
    LeaveReason.UNSUBSCRIBED: LeaseEndReason.UNSUBSCRIBED,
    LeaveReason.SESSION_TIMEOUT: LeaseEndReason.SESSION_TIMED_OUT,
    LeaveReason.SESSION_REPLACED: LeaseEndReason.UNSUBSCRIBED,
    LeaveReason.EVICTED: LeaseEndReason.EVICTED,
    LeaveReason.REPLACED: LeaseEndReason.UNSUBSCRIBED,  # none: it leaves holding no lease
}

_LEAVE_EVENT = {
    LeaveReason.UNSUBSCRIBED: EventType.CONSUMER_UNSUBSCRIBED,
    LeaveReason.SESSION_TIMEOUT: EventType.CONSUMER_TIMED_OUT,
    LeaveReason.SESSION_REPLACED: EventType.CONSUMER_UNSUBSCRIBED,
    LeaveReason.EVICTED: EventType.CONSUMER_EVICTED,
    LeaveReason.REPLACED: EventType.CONSUMER_UNSUBSCRIBED,
}


def ms(seconds: float) -> int:
    return int(seconds * 1000)


def wire_bookmark(b: Bookmark) -> WireBookmark:
    return WireBookmark(b.topic, b.partition, b.offset)


def engine_bookmark(b: WireBookmark) -> Bookmark:
    return Bookmark(b.topic, b.partition, b.offset)


def wire_reason(reason: str) -> str:
    """Engine reasons use dashes (max-deliveries); the wire uses underscores."""
    return reason.replace("-", "_")


def entry_row(queue: str, r: EntryRecord) -> EntryRow:
    topic, partition, offset = r.bookmark
    reason = r.reason
    # Built positionally (tuple.__new__, in EntryRow's field order): one or two rows per
    # message, and keyword construction of a named tuple cost a microsecond each.
    if r.state is EntryState.LEASED:
        row: EntryRow = _new(EntryRow, (
            queue, topic, partition, offset, _STORE_STATE[r.state], r.delivery_count,
            r.cancel_count, r.consumer_id, r.token, r.deadline, r.available_at,
            str(reason) if reason is not None else None))
    else:
        row = _new(EntryRow, (queue, topic, partition, offset, _STORE_STATE[r.state],
                              r.delivery_count, r.cancel_count, None, None, None,
                              r.available_at, str(reason) if reason is not None else None))
    return row


def entry_record(row: EntryRow, session_of: dict[str, str]) -> EntryRecord:
    """A stored row back as the engine's restore input. The store does not keep the lease's
    session id: the consumer's current session (if it is still subscribed) is assumed."""
    reason = None
    if row.reason:
        try:
            reason = ExpiryReason(row.reason)
        except ValueError:
            reason = None
    return EntryRecord(
        Bookmark(row.topic, row.partition, row.offset),
        _ENGINE_STATE[row.state],
        row.delivery_count,
        row.cancel_count,
        row.lease_consumer,
        session_of.get(row.lease_consumer or "") if row.lease_consumer else None,
        row.lease_token,
        row.lease_deadline,
        row.available_at,
        reason,
    )


def lost_to_retention(queue: str, topic: str, partition: int, start: int, first: int,
                      stored: Mapping[Bookmark, EntryRecord], now: float
                      ) -> list[ev.EntryExpired]:
    """One EXPIRED (reason retention) per offset in ``[start, first)`` the queue had not
    finished: Kafka deleted those records before the queue was done with them.

    ``stored`` is the queue's persisted entries; those ACKED or EXPIRED are not lost. An
    offset that never became an entry (refused by the queue's filter, or a transaction marker)
    cannot be told apart once its record is gone, so it is reported too: over-reporting a
    loss is safer than hiding one.
    """
    lost: list[ev.EntryExpired] = []
    for offset in range(start, first):
        bookmark = Bookmark(topic, partition, offset)
        known = stored.get(bookmark)
        if known is not None and known.state.done:
            continue
        lost.append(ev.EntryExpired(
            queue, bookmark, ExpiryReason.RETENTION, False,
            known.delivery_count if known is not None else 0,
            known.cancel_count if known is not None else 0,
            None, None, now))
    return lost


def add_outbox(batch: WriteBatch, queue: str, outbox: ev.Outbox,
               counted_from: Mapping[tuple[str, int], int] | None = None,
               passed: Mapping[tuple[str, int], int] | None = None) -> None:
    """The engine's changed entries and its counters into the loop's write batch.

    ``counted_from`` (per journal partition) is where a previous incarnation of the queue had
    admitted up to: entries below it are re-admitted after a restart, not newly enqueued.
    ``passed`` holds the recovery points this batch writes (per journal partition): a done
    entry below one needs no row, since the store prunes every row below a recovery point.
    """
    if passed:
        for record in outbox.entries:
            if record.state.done:
                bookmark = record.bookmark
                point = passed.get((bookmark.topic, bookmark.partition))
                if point is not None and bookmark.offset < point:
                    continue
            batch.put_entry(entry_row(queue, record))
    else:
        for record in outbox.entries:
            batch.put_entry(entry_row(queue, record))
    enqueued = delivered = acked = released = ended = expired = dead = redelivered = 0
    rejected = 0
    for e in outbox.events:
        kind = type(e)
        if kind is ev.EntriesEnqueued:
            admitted = cast(ev.EntriesEnqueued, e)
            offsets = admitted.offsets
            start = (counted_from.get((admitted.topic, admitted.partition))
                     if counted_from else None)
            # Offsets come in journal order: those re-admitted are a prefix.
            enqueued += len(offsets) - (bisect_left(offsets, start) if start else 0)
        elif kind is ev.EntryLeased:
            delivered += 1
            if cast(ev.EntryLeased, e).delivery_count > 1:
                redelivered += 1
        elif kind is ev.EntryAcked:
            acked += 1
        elif kind is ev.EntryReleased:
            released += 1
        elif kind is ev.LeaseExpired or kind is ev.LeaseBroken:
            # Both end a lease without a settlement: one LEASE_EXPIRED event each.
            ended += 1
        elif kind is ev.DeliveryRefused:
            dead += 1  # already counted delivered and acked; only the dead letter is new
        elif kind is ev.EntryExpired:
            # A consumer's rejection is counted apart: `expired` is every other way out.
            if e.reason is ExpiryReason.REJECTED:  # type: ignore[union-attr]
                rejected += 1
            else:
                expired += 1
            if e.dead_letter:  # type: ignore[union-attr]
                dead += 1
    for name, n in (("enqueued", enqueued), ("delivered", delivered), ("acked", acked),
                    ("released", released), ("lease_expired", ended), ("expired", expired),
                    ("dead_lettered", dead), ("redelivered", redelivered),
                    ("rejected", rejected)):
        if n:
            batch.count(queue, name, n)


def _unknown(_: object) -> None:
    return None


class EventFields(NamedTuple):
    """One events-topic record before it is encoded: an `Event` without the coordinator's id
    and epoch, holding the engine's bookmark (a plain tuple; building the protocol's validated
    `Bookmark` for each of three events per message cost more than encoding them)."""

    type: EventType
    timestamp_ms: int
    queue: str | None
    bookmark: Bookmark | None = None
    consumer_id: str | None = None
    session_id: str | None = None
    delivery_count: int | None = None
    reason: str | None = None
    lease_expires_ms: int | None = None
    available_at_ms: int | None = None
    record_timestamp_ms: int | None = None


def wire_events(events: Iterable[ev.Event], coordinator_id: str, epoch: int, *,
                session_of: Callable[[str], str | None] = _unknown,
                record_time_of: Callable[[Bookmark], int | None] = _unknown) -> list[Event]:
    """Engine events as events-topic records (one per entry change, docs/protocol.md §11)."""
    return [Event(type=f.type, timestamp_ms=f.timestamp_ms, coordinator_id=coordinator_id,
                  coordinator_epoch=epoch, queue=f.queue,
                  bookmark=None if f.bookmark is None else wire_bookmark(f.bookmark),
                  consumer_id=f.consumer_id, session_id=f.session_id,
                  delivery_count=f.delivery_count, reason=f.reason,
                  lease_expires_ms=f.lease_expires_ms, available_at_ms=f.available_at_ms,
                  record_timestamp_ms=f.record_timestamp_ms)
            for f in event_fields(events, session_of=session_of, record_time_of=record_time_of)]


def event_fields(events: Iterable[ev.Event], *,
                 session_of: Callable[[str], str | None] = _unknown,
                 record_time_of: Callable[[Bookmark], int | None] = _unknown
                 ) -> Iterator[EventFields]:
    """The events-topic records of engine events, as fields (docs/protocol.md §11).

    The engine's events do not carry what only the coordinator knows: the session a lease
    was granted to (``session_of`` a consumer id) and the journal record's own timestamp
    (``record_time_of`` a bookmark, in ms), both part of the documented event fields.
    """
    F = EventFields
    for e in events:
        kind = type(e)
        queue = e.queue
        at = int(e.at * 1000)
        # The commonest kinds first, told apart by exact type (cheaper than isinstance).
        if kind is ev.EntryLeased:
            leased = cast(ev.EntryLeased, e)
            yield F(EventType.LEASED, at, queue, leased.bookmark, leased.consumer_id,
                    session_of(leased.consumer_id), leased.delivery_count, None,
                    int(leased.deadline * 1000))
        elif kind is ev.EntriesEnqueued:
            enqueued = cast(ev.EntriesEnqueued, e)
            topic, partition = enqueued.topic, enqueued.partition
            for o in enqueued.offsets:
                bookmark = Bookmark(topic, partition, o)
                yield F(EventType.ENQUEUED, at, queue, bookmark,
                        record_timestamp_ms=record_time_of(bookmark))
        elif kind is ev.EntryAcked:
            acked = cast(ev.EntryAcked, e)
            if acked.source == "barrier":
                continue  # the BarrierDelivered event is the outcome
            yield F(EventType.DELIVERED_AT_MOST_ONCE if acked.source == "delivery"
                    else EventType.ACKED, at, queue, acked.bookmark, acked.consumer_id,
                    delivery_count=acked.delivery_count, reason=str(acked.source))
        elif isinstance(e, ev.EntryReleased):
            yield F(EventType.RELEASED, at, queue, e.bookmark, e.consumer_id,
                    available_at_ms=ms(e.available_at) if e.available_at else None)
        elif isinstance(e, ev.LeaseRenewed):
            yield F(EventType.RENEWED, at, queue, e.bookmark, e.consumer_id,
                    lease_expires_ms=ms(e.deadline))
        elif isinstance(e, ev.LeaseExpired):
            yield F(EventType.LEASE_EXPIRED, at, queue, e.bookmark, e.consumer_id,
                    reason=LeaseEndReason.DEADLINE.value,
                    available_at_ms=ms(e.available_at) if e.available_at else None)
        elif isinstance(e, ev.LeaseBroken):
            yield F(EventType.LEASE_EXPIRED, at, queue, e.bookmark, e.consumer_id,
                    reason=_LEASE_END[e.reason].value)
        elif kind is ev.DeliveryRefused:
            # The entry's outcome (DELIVERED_AT_MOST_ONCE) is already written: only where the
            # record went.
            refused = cast(ev.DeliveryRefused, e)
            yield F(EventType.DEAD_LETTERED, at, queue, refused.bookmark, refused.consumer_id,
                    delivery_count=refused.delivery_count,
                    reason=wire_reason(str(refused.reason)))
        elif isinstance(e, ev.EntryExpired):
            reason = wire_reason(str(e.reason))
            if e.reason is ExpiryReason.REJECTED:
                # The consumer's REJECT, with its own words; the outcome follows.
                yield F(EventType.REJECTED, at, queue, e.bookmark, e.consumer_id,
                        delivery_count=e.delivery_count, reason=e.detail)
            if e.dead_letter:
                # DEAD_LETTERED says where it went; EXPIRED is the entry's one outcome.
                yield F(EventType.DEAD_LETTERED, at, queue, e.bookmark, e.consumer_id,
                        delivery_count=e.delivery_count, reason=reason)
            yield F(EventType.EXPIRED, at, queue, e.bookmark, e.consumer_id,
                    delivery_count=e.delivery_count, reason=reason)
        elif isinstance(e, ev.BarrierDelivered):
            yield F(EventType.BARRIER_DELIVERED, at, queue, e.bookmark,
                    reason=",".join(r.consumer_id for r in e.recipients))
        elif isinstance(e, ev.ConsumerSubscribed):
            yield F(EventType.CONSUMER_SUBSCRIBED, at, queue, None, e.consumer_id,
                    e.session_id)
        elif isinstance(e, ev.ConsumerReplaced):
            yield F(EventType.CONSUMER_REPLACED, at, queue, None, e.consumer_id, e.session_id)
        elif isinstance(e, ev.ConsumerLeft):
            yield F(_LEAVE_EVENT[e.reason], at, queue, None, e.consumer_id, e.session_id,
                    reason=wire_reason(str(e.reason)))
        # EntryDelayed and BacklogFreed are internal bookkeeping: not part of the audit trail.
