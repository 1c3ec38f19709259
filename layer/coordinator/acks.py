"""Ack records of one shard: items applied to their queues' engines in order, refused ones
answered, items of queues another shard serves passed on, items for entries a restart's
replay has not reached yet kept until it has."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from itertools import groupby
from typing import TYPE_CHECKING, Final

from layer.coordinator.identity import Refusal
from layer.coordinator.translate import ms
from layer.domain.definitions import Semantics
from layer.domain.engine import EntryAck
from layer.domain.states import AckOutcome, AckType, Bookmark
from layer.kafka import JournalRecord, OutgoingRecord
from layer.protocol import (
    AcceptRecord,
    AckItem,
    AckItemResult,
    AckRecord,
    AckResult,
    AckStatus,
    EventType,
    ProtocolError,
    ack_item_shape_problem,
    forwarded_hops,
    topic_name_problem,
)
from layer.protocol import Bookmark as WireBookmark
from layer.protocol.bookmark import partition_of

if TYPE_CHECKING:
    from layer.coordinator.core import ShardCore

log = logging.getLogger(__name__)

__all__ = ["MAX_FORWARD_HOPS", "Acks", "ItemOutcome"]

_ACK_STATUS = {
    AckOutcome.APPLIED: AckStatus.OK,
    AckOutcome.REMEMBERED: AckStatus.OK,
    AckOutcome.WRONG_TOKEN: AckStatus.WRONG_TOKEN,
    AckOutcome.NOT_LEASED: AckStatus.LEASE_LOST,
    AckOutcome.ALREADY_DONE: AckStatus.DUPLICATE,
    AckOutcome.UNKNOWN_BOOKMARK: AckStatus.UNKNOWN_ENTRY,
}

#: What applying one ack item came to: its status, the lease's new expiry (RENEW) and why it
#: was refused.
ItemOutcome = tuple[AckStatus, int | None, str | None]
_OK: ItemOutcome = (AckStatus.OK, None, None)
# Kafka partitions are int32 and offsets int64 (as `layer.protocol.Bookmark` checks).
_MAX_PARTITION = 2**31 - 1
_MAX_OFFSET = 2**63 - 1

#: The largest ack-topic record a coordinator reads (bytes); larger ones are dropped unread and
#: counted (``oversized_ack_records``). The ack topic is made with this ``max.message.bytes``,
#: so the broker refuses them first. The SDK writes at most 500 items (or one AcceptRecord of
#: short offsets and tokens) per record, far below it.
ACK_RECORD_LIMIT: Final = 1 << 20
#: The most bytes of one reply's items (an AckResult is split past it): well under the 1 MB
#: a record may have by default, with room for the reply's own fields.
REPLY_BYTES: Final = 256 << 10

#: A control or ack record passes through at most this many coordinators: catalogs that
#: disagree for a moment (a queue just moved) must not bounce a record for ever; past it, the
#: shard that has it answers as best it can (UNKNOWN_ENTRY, UNKNOWN_SESSION).
MAX_FORWARD_HOPS = 4


def _bookmark_or_none(text: str) -> WireBookmark | None:
    try:
        return WireBookmark.parse(text)
    except ProtocolError:
        return None


class Acks:
    """The ack side of a `ShardCore`."""

    def __init__(self, core: ShardCore) -> None:
        self.core = core
        self.reset()

    def reset(self) -> None:
        # Ack items (consumer id, session id, item) for restored leases the replay has not
        # reached yet, retried each step in order.
        # (consumer id, session id, item, passed on): a passed-on item keeps its quiet
        # DUPLICATE when it applies later (`retry_deferred`).
        self.deferred: list[tuple[str, str, AckItem, bool]] = []
        # Per ack partition, the offset of the first record with deferred items: its input
        # position is not stored past it until they are applied (a restart reads them again).
        self.deferred_from: dict[tuple[str, int], int] = {}
        # Topic names of AcceptRecords already checked against Kafka's rules.
        self._topics_ok: dict[str, bool] = {}

    def on_record(self, r: JournalRecord, now: float, replies: list[OutgoingRecord],
                  came: float | None = None) -> int | None:
        """Apply one ack-topic record; returns its items, or None when it must wait for a
        fresher catalog (it names a session this shard's catalog does not know yet; ``came``:
        when it was first read)."""
        value = r.value
        if value is not None and len(value) > ACK_RECORD_LIMIT:
            self.core.count_malformed("ack", r, f"{len(value)} bytes, more than the ack "
                                      f"topic's limit of {ACK_RECORD_LIMIT}", now, oversized=True)
            return 0
        # Who the record is from, before its items are decoded (issue 36: decoding first let
        # records of no session at all stall every shard of the process). A record of a live
        # session of this shard must prove its secret now; one of a session another shard
        # holds is passed on, and that shard checks it; one of no session is dropped, counted.
        named = self.core.codec.peek_ack_session(value)
        if named is None:
            self.core.count_malformed("ack", r, "not an AckRecord or AcceptRecord", now)
            return 0
        consumer_id, session_id = named
        session = self.core.sessions.get(consumer_id)
        admitted = False
        if session is not None and session.session_id == session_id:
            if not self.core.identity.admits(session, r.headers, "ack", now):
                return 0
            admitted = True
        elif not self._held_elsewhere(consumer_id, session_id):
            if self.core.catalog().loaded_at <= (now if came is None else came):
                return None
            self.core.identity.refuse("ack", Refusal.UNKNOWN_SESSION, consumer_id, now,
                                      f"no session {session_id}")
            self.core.refusals.count("ack", Refusal.UNKNOWN_SESSION.value, None)
            return 0
        try:
            decoded = self.core.codec.decode_ack_topic_any(value)
        except ProtocolError as exc:
            self.core.count_malformed("ack", r, exc, now)
            return 0
        engines = self.core.engines
        split = self.core.split
        if isinstance(decoded, AcceptRecord):
            if all(g.queue in engines for g in decoded.groups) and (
                    not split or all(g.queue not in split or engines[g.queue].serves(g.partition)
                                     for g in decoded.groups)):
                if not admitted and not self._admitted(r, decoded.consumer_id,
                                                       decoded.session_id, now):
                    return 0
                admitted = True
                applied = self._accept(r, decoded, now, replies)
                if applied is not None:
                    self.core.consumer_acks[decoded.consumer_id] += applied
                    return applied
            record = decoded.as_ack_record()
        else:
            record = decoded
        items = record.items
        if not all(item.queue in engines for item in items) or (
                split and any(item.queue in split for item in items)):
            items = self._forward_acks(r, record)
        if items and not admitted and not self._admitted(r, record.consumer_id,
                                                         record.session_id, now):
            return 0
        waiting = len(self.deferred)
        # A record passed on by a shard that was then fenced is passed on again after its
        # rebuild (it is written before the position past it is stored): its acks were
        # applied the first time, so their DUPLICATE is not news to the consumer.
        self._settle(record.consumer_id, record.session_id, items, now, replies,
                     quiet_duplicates=r.headers is not None and forwarded_hops(r.headers) > 0)
        if len(self.deferred) > waiting:
            self.core.counters["acks_deferred_for_replay"] += len(self.deferred) - waiting
            self.deferred_from.setdefault((r.topic, r.partition), r.offset)
        self.core.consumer_acks[record.consumer_id] += len(record.items)
        return len(record.items)

    def _admitted(self, r: JournalRecord, consumer_id: str, session_id: str, now: float
                  ) -> bool:
        """Whether an ack record may settle anything: it names a live session of this shard
        (a record of an unknown or ended session is not acted on: that session's leases were
        broken when it ended) and proves that session's secret when it has one."""
        session = self.core.sessions.get(consumer_id)
        if session is None or session.session_id != session_id:
            self.core.identity.refuse("ack", Refusal.UNKNOWN_SESSION, consumer_id, now,
                                      f"no session {session_id}")
            return False
        return self.core.identity.admits(session, r.headers, "ack", now)

    def _held_elsewhere(self, consumer_id: str, session_id: str) -> bool:
        """Whether the catalog knows this session on another shard (its items are passed
        on there), or the record was passed on to this shard already."""
        row = self.core.catalog().consumers.get(consumer_id)
        return row is not None and row.session_id == session_id

    def _forward_acks(self, r: JournalRecord, record: AckRecord) -> tuple[AckItem, ...]:
        """Pass the items of queues another shard serves on to that shard's ack partition;
        return the items this shard answers (its own, and those of unknown queues)."""
        hops = forwarded_hops(r.headers)
        if hops >= MAX_FORWARD_HOPS:
            self.core.counters["forward_hops_exceeded"] += 1
            return record.items
        catalog = self.core.catalog()
        mine: list[AckItem] = []
        theirs: dict[int, list[AckItem]] = {}
        engines, split = self.core.engines, self.core.split
        for item in record.items:
            if item.queue in split:
                # A queue of several parts: the part of the item's journal partition.
                partition = partition_of(item.bookmark)
                shard = (None if partition is None or engines[item.queue].serves(partition)
                         else catalog.shard_of(item.queue, partition))
            elif item.queue in engines:
                shard = None
            else:
                # Of a queue of several parts served elsewhere: straight to its part's shard.
                placed = catalog.queues.get(item.queue)
                shard = catalog.shard_of(item.queue, partition_of(item.bookmark)
                                         if placed is not None and placed.parts > 1 else None)
            if shard is None or shard == self.core.shard:
                mine.append(item)
            else:
                theirs.setdefault(shard, []).append(item)
        for shard, items in theirs.items():
            value = r.value if len(items) == len(record.items) else self.core.codec.encode_ack(
                AckRecord(consumer_id=record.consumer_id, session_id=record.session_id,
                          sent_at_ms=record.sent_at_ms, items=tuple(items)))
            self.core.control.forward(r, value, shard, hops)
        return tuple(mine)

    def _accept(self, r: JournalRecord, record: AcceptRecord, now: float,
                replies: list[OutgoingRecord]) -> int | None:
        """An AcceptRecord applied straight to its queues' engines, without an item and a
        parsed bookmark per message; items are made only for the few that are refused or wait.
        None when the record needs the general path: a queue this shard does not serve
        (passed on), a bookmark or token the protocol rules out (answered INVALID), acks
        waiting for the replay ahead of it (their order is kept), or a passed-on record."""
        engines = self.core.engines
        if self.deferred or (r.headers is not None and forwarded_hops(r.headers) > 0):
            return None
        if self.core.lane is not None:
            return self._accept_native(r, record, now, replies)
        run: dict[str, list[tuple[int, EntryAck]]] = {}
        shapes: list[tuple[str, str, int, int, str]] = []
        accept = AckType.ACCEPT
        for g in record.groups:
            if g.queue not in engines or not self._topic_ok(g.topic) \
                    or not 0 <= g.partition <= _MAX_PARTITION:
                return None
            offsets, leases = g.offsets, g.leases
            if (offsets and (min(offsets) < 0 or max(offsets) > _MAX_OFFSET)) \
                    or not all(leases):
                return None
            pairs = run.setdefault(g.queue, [])
            topic, partition, queue = g.topic, g.partition, g.queue
            for offset, lease in zip(offsets, leases, strict=True):
                pairs.append((len(shapes), EntryAck(Bookmark(topic, partition, offset), lease,
                                                    accept, None, None)))
                shapes.append((queue, topic, partition, offset, lease))
        outcomes: list[ItemOutcome | None] = [None] * len(shapes)
        self._apply_run(run, outcomes, now, record.consumer_id)
        ok = _OK
        odd = [i for i, outcome in enumerate(outcomes) if outcome is not ok]
        if len(odd) < len(outcomes):
            self.core.counters["ack_ok"] += len(outcomes) - len(odd)
        if odd:
            waiting = len(self.deferred)
            items = [AckItem(shapes[i][0], f"{shapes[i][1]}/{shapes[i][2]}/{shapes[i][3]}",
                             shapes[i][4], accept) for i in odd]
            self._answer(record.consumer_id, record.session_id, items,
                         [outcomes[i] for i in odd], now, replies)
            if len(self.deferred) > waiting:
                self.core.counters["acks_deferred_for_replay"] += len(self.deferred) - waiting
                self.deferred_from.setdefault((r.topic, r.partition), r.offset)
        return len(shapes)

    def _accept_native(self, r: JournalRecord, record: AcceptRecord, now: float,
                       replies: list[OutgoingRecord]) -> int | None:
        """`_accept` for native engines: each group applied by its engine at once, items made
        only for the offsets that are refused or wait for the replay."""
        engines = self.core.engines
        for g in record.groups:
            offsets, leases = g.offsets, g.leases
            if g.queue not in engines or not self._topic_ok(g.topic) \
                    or not 0 <= g.partition <= _MAX_PARTITION \
                    or (offsets and (min(offsets) < 0 or max(offsets) > _MAX_OFFSET)) \
                    or not all(leases):
                return None
        accept = AckType.ACCEPT
        items: list[AckItem] = []
        outcomes: list[ItemOutcome | None] = []
        applied = total = 0
        for g in record.groups:
            engine = engines[g.queue]
            at_most_once = engine.definition.semantics is Semantics.AT_MOST_ONCE
            total += len(g.offsets)
            odd = engine.core.accept(  # type: ignore[union-attr]
                g.topic, g.partition, g.offsets, g.leases, now, record.consumer_id)
            applied += len(g.offsets) - len(odd)
            for i, outcome in odd:
                if outcome == "restoring":
                    outcomes.append(None)  # the replay has not reached it: it waits
                else:
                    result = AckOutcome(outcome)
                    if at_most_once and result is AckOutcome.ALREADY_DONE:
                        applied += 1  # done on delivery: nothing failed (see `_apply_run`)
                        continue
                    outcomes.append((_ACK_STATUS[result], None, result.value))
                items.append(AckItem(g.queue, f"{g.topic}/{g.partition}/{g.offsets[i]}",
                                     g.leases[i], accept))
        if applied:
            self.core.counters["ack_ok"] += applied
        if items:
            waiting = len(self.deferred)
            self._answer(record.consumer_id, record.session_id, items, outcomes, now, replies)
            if len(self.deferred) > waiting:
                self.core.counters["acks_deferred_for_replay"] += len(self.deferred) - waiting
                self.deferred_from.setdefault((r.topic, r.partition), r.offset)
        return total

    def _topic_ok(self, topic: str) -> bool:
        known = self._topics_ok.get(topic)
        if known is None:
            known = self._topics_ok[topic] = topic_name_problem(topic) is None
        return known

    def _settle(self, consumer_id: str, session_id: str, items: Sequence[AckItem], now: float,
                replies: list[OutgoingRecord], quiet_duplicates: bool = False) -> None:
        """Apply one consumer's ack items and answer the refused ones (and every RENEW).

        Items for entries a restart has not re-read yet wait for the replay
        (`_retry_deferred_acks`): refused now, the consumer would lose its ack and the
        message come back when its restored lease ran out.
        """
        self._answer(consumer_id, session_id, items, self._apply_acks(items, now, consumer_id),
                     now, replies, quiet_duplicates)

    def _answer(self, consumer_id: str, session_id: str, items: Sequence[AckItem],
                outcomes: Sequence[ItemOutcome | None], now: float,
                replies: list[OutgoingRecord], quiet_duplicates: bool = False) -> None:
        """Count applied items, keep those waiting for the replay, answer the refused ones
        (and every RENEW)."""
        answers: list[AckItemResult] = []
        statuses: Counter[AckStatus] = Counter()
        for item, outcome in zip(items, outcomes, strict=True):
            if outcome is None:
                self.deferred.append((consumer_id, session_id, item, quiet_duplicates))
                continue
            status, expires, message = outcome
            if quiet_duplicates and status is AckStatus.DUPLICATE:
                self.core.counters["ack_duplicate_forwarded"] += 1
                continue
            statuses[status] += 1
            if status is not AckStatus.OK:
                self.core.control.refused(EventType.ACK_REFUSED, now, status.value, consumer_id,
                              session_id, item.queue, _bookmark_or_none(item.bookmark))
            if status is not AckStatus.OK or item.type is AckType.RENEW:
                answers.append(AckItemResult(queue=item.queue, bookmark=item.bookmark,
                                             type=item.type, status=status,
                                             lease_expires_ms=expires, message=message))
        for status, n in statuses.items():
            self.core.counters[f"ack_{status.value.lower()}"] += n
        if answers:
            # Split so that no reply outgrows a record (`REPLY_BYTES`): a record of many refused
            # items once made one reply over the broker's limit, which failed the iteration.
            topic = self.core.control.delivery_topic_of(consumer_id)
            parts = _split_answers(answers)
            if len(parts) > 1:
                self.core.counters["replies_split"] += len(parts) - 1
            for part in parts:
                replies.append(self.core.control.reply(topic, AckResult(
                    consumer_id=consumer_id, session_id=session_id,
                    items=tuple(part), sent_at_ms=ms(now)), consumer_id))

    def retry_deferred(self, now: float, replies: list[OutgoingRecord]) -> None:
        """Acks that waited for the replay, in the order they came, before any newer one."""
        if not self.deferred:
            return
        deferred, self.deferred = self.deferred, []
        # A passed-on record read twice (its shard was fenced before storing the position
        # past it) can wait twice; its second copy's DUPLICATE stays quiet here too.
        for (consumer_id, session_id, quiet), group in groupby(
                deferred, key=lambda d: (d[0], d[1], d[3])):
            self._settle(consumer_id, session_id, [item for _, _, item, _ in group], now,
                         replies, quiet_duplicates=quiet)
        if not self.deferred:
            self.deferred_from.clear()

    def _apply_acks(self, items: Sequence[AckItem], now: float, consumer: str
                    ) -> list[ItemOutcome | None]:
        """Each item's status, lease expiry (RENEW) and refusal message, applied in order;
        None for an item whose entry waits for the replay after a restart (not applied).

        Items go to their queue's engine a run at a time (one call per queue, not per item);
        a RENEW ends the run, because its answer reads the lease right after it.
        """
        outcomes: list[ItemOutcome | None] = [None] * len(items)
        run: dict[str, list[tuple[int, EntryAck]]] = {}
        for i, item in enumerate(items):
            checked = self._checked_ack(item)
            if not isinstance(checked, EntryAck):
                outcomes[i] = checked
            elif item.type is AckType.RENEW:
                self._apply_run(run, outcomes, now, consumer)
                self._apply_run({item.queue: [(i, checked)]}, outcomes, now, consumer)
            else:
                run.setdefault(item.queue, []).append((i, checked))
        self._apply_run(run, outcomes, now, consumer)
        return outcomes

    def _checked_ack(self, item: AckItem) -> EntryAck | ItemOutcome:
        """The engine's form of a well-formed item for a known queue, else its refusal."""
        try:
            wire = WireBookmark.parse(item.bookmark)
        except ProtocolError as exc:
            return AckStatus.INVALID, None, exc.message
        problem = ack_item_shape_problem(item)
        if problem is not None:
            return AckStatus.INVALID, None, problem
        if item.queue not in self.core.engines:
            return AckStatus.UNKNOWN_ENTRY, None, f"unknown queue {item.queue!r}"
        delay = item.delay_ms / 1000.0 if item.delay_ms is not None else None
        return EntryAck(Bookmark(wire.topic, wire.partition, wire.offset), item.lease,
                             item.type, delay, item.reason)

    def _apply_run(self, run: dict[str, list[tuple[int, EntryAck]]],
                   outcomes: list[ItemOutcome | None], now: float, consumer: str) -> None:
        """Apply runs of one consumer's items; a token settles only a lease ``consumer``
        holds (protocol 5: a lease token alone no longer settles a lease)."""
        for queue, pairs in run.items():
            engine = self.core.engines[queue]
            at_most_once = engine.definition.semantics is Semantics.AT_MOST_ONCE
            results = engine.ack([item for _, item in pairs], now, consumer)
            for (i, item), result in zip(pairs, results, strict=True):
                if result is AckOutcome.UNKNOWN_BOOKMARK and engine.restoring(
                        item.bookmark):
                    # A lease restored from PostgreSQL whose record the replay has not
                    # reached yet: nothing was applied; the item waits (see `_settle`).
                    outcomes[i] = None
                    continue
                status = _ACK_STATUS[result]
                if (at_most_once and result is AckOutcome.ALREADY_DONE
                        and item.type is not AckType.RENEW):
                    # An at-most-once entry is done when it is delivered; the ack only frees
                    # a backlog slot, and after a restart (which frees them all) there is none
                    # left to free. Nothing failed that the consumer could act on.
                    status = AckStatus.OK
                expires = None
                if status is AckStatus.OK and item.type is AckType.RENEW:
                    entry = engine.entry(item.bookmark)
                    if entry is not None and entry.deadline is not None:
                        expires = ms(entry.deadline)
                if status is AckStatus.OK:
                    outcomes[i] = _OK if expires is None else (status, expires, None)
                else:
                    outcomes[i] = (status, expires, result.value)
        run.clear()


def _split_answers(answers: list[AckItemResult]) -> list[list[AckItemResult]]:
    """``answers`` in parts of at most `REPLY_BYTES` (by their strings' lengths, an upper
    bound of their encoded size less a few bytes of numbers each)."""
    parts: list[list[AckItemResult]] = [[]]
    size = 0
    for answer in answers:
        length = (len(answer.queue) + len(answer.bookmark) + len(answer.message or "")) * 4 + 32
        if parts[-1] and size + length > REPLY_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(answer)
        size += length
    return parts

