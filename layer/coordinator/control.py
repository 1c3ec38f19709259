"""Control records of one shard: subscribe and replace (`layer.coordinator.subscribe`),
heartbeat, unsubscribe; the sessions they make and end; replies; records of other shards
passed on to them."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from layer.coordinator.acks import MAX_FORWARD_HOPS
from layer.coordinator.authorize import Authorization
from layer.coordinator.credit import Credit
from layer.coordinator.identity import Refusal
from layer.coordinator.logformat import fields
from layer.coordinator.sessions import Session
from layer.coordinator.subscribe import on_subscribe
from layer.coordinator.translate import ms
from layer.domain import events as ev
from layer.domain.states import LeaveReason
from layer.kafka import JournalRecord, OutgoingRecord
from layer.protocol import (
    AckResult,
    Event,
    EventType,
    Heartbeat,
    ProtocolError,
    Replace,
    RequestKind,
    SessionEnded,
    SessionEndReason,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    Unsubscribe,
    delivery_format,
    forwarded_headers,
    forwarded_hops,
    reply_headers,
)
from layer.protocol import Bookmark as WireBookmark
from layer.protocol.headers import (
    FORWARDED,
    NOT_AUTHORIZED,
    REFUSAL,
    credit_home,
)
from layer.store.batch import WriteBatch

if TYPE_CHECKING:
    from layer.coordinator.core import ShardCore

log = logging.getLogger(__name__)

__all__ = ["CONTROL_RECORD_LIMIT", "Control"]

#: The largest control record a coordinator reads (bytes); larger ones are dropped unread and
#: counted (``oversized_control_records``). The control topic is made with this
#: ``max.message.bytes``. A Subscribe holds ids, a queue name or regex and a filter (at most
#: `layer.domain.expressions` limits): a few KiB.
CONTROL_RECORD_LIMIT = 64 << 10

class Control:
    """The control side of a `ShardCore`."""

    def __init__(self, core: ShardCore) -> None:
        self.core = core
        self.reply_headers = reply_headers(core.shard)
        self.not_authorized = [*self.reply_headers, (REFUSAL, NOT_AUTHORIZED.encode())]
        self.authorization = Authorization()
        self.reset()

    def reset(self) -> None:
        #: Control records that wait for a catalog loaded after they came (a queue applied, a
        #: principal added or a grant given a moment ago must not be refused for the
        #: catalog's age), with when each came. Every later record of the same partition
        #: waits behind them, so the stored input position never passes one: a restart reads
        #: them again.
        self.held: list[tuple[JournalRecord, float]] = []
        self._held_partitions: set[tuple[str, int]] = set()
        #: Set when a record is held: the process loads the catalog soon (`wants_catalog`).
        self.wants_catalog = False
        #: This step's accepted Subscribes (consumer id -> the request and its OK reply): a
        #: store that refuses the session's row (`lost_claims`) turns the OK into a refusal.
        self.accepted: dict[str, tuple[Subscribe | Replace, OutgoingRecord]] = {}
        #: Sessions here that hold credit their consumer granted (protocol 8).
        self.credit = Credit(self.core)

    def holds(self, r: JournalRecord) -> bool:
        return (r.topic, r.partition) in self._held_partitions

    def hold(self, r: JournalRecord, came: float) -> None:
        self.held.append((r, came))
        self._held_partitions.add((r.topic, r.partition))
        self.wants_catalog = True

    def release(self) -> list[tuple[JournalRecord, float]]:
        """The held records, in order, once the catalog was loaded after the first of them
        came (each is decided again; one that came after the load may be held again)."""
        if not self.held or self.core.catalog().loaded_at <= self.held[0][1]:
            return []
        released, self.held = self.held, []
        self._held_partitions.clear()
        return released

    def stale(self, came: float) -> bool:
        """Whether the catalog was loaded before a record that came at ``came``."""
        return self.core.catalog().loaded_at <= came

    def reply(self, topic: str, message: SubscribeResult | AckResult | SessionEnded,
               key: str, headers: list[tuple[str, bytes]] | None = None
               ) -> OutgoingRecord:
        return OutgoingRecord(topic, self.core.codec.encode_reply(message), key.encode(),
                              headers if headers is not None else self.reply_headers, partition=0)

    def forward(self, r: JournalRecord, value: bytes | None, shard: int, hops: int) -> None:
        """Pass a record on to the shard that serves it, with its own headers (a Subscribe's
        delivery format) but for the hop count, which goes up by one."""
        kept: list[tuple[str, bytes | None]] = [
            (k, v) for k, v in r.headers or () if k != FORWARDED]
        kept.extend(forwarded_headers(hops + 1))
        self.core.forwards.append(OutgoingRecord(r.topic, value, r.key, kept,
                                                 partition=shard))

    def refused(self, kind: EventType, now: float, reason: str, consumer_id: str,
                 session_id: str, queue: str | None, bookmark: WireBookmark | None = None
                 ) -> None:
        self.core.pending_events.append(Event(type=kind, timestamp_ms=ms(now),
                                    coordinator_id=self.core.owner_id,
                                    coordinator_epoch=self.core.epoch, queue=queue,
                                    bookmark=bookmark, consumer_id=consumer_id,
                                    session_id=session_id, reason=reason))

    def on_record(self, r: JournalRecord, now: float, batch: WriteBatch,
                  replies: list[OutgoingRecord], came: float | None = None) -> bool:
        """Act on one control record; False when it must wait for a fresher catalog
        (`hold`). ``came``: when the record was first read (now, unless it was held)."""
        if r.value is not None and len(r.value) > CONTROL_RECORD_LIMIT:
            self.core.count_malformed("control", r, f"{len(r.value)} bytes, more than the "
                                      f"control topic's limit of {CONTROL_RECORD_LIMIT}", now,
                                      oversized=True)
            return True
        try:
            message = self.core.codec.decode_control(r.value)
        except ProtocolError as exc:
            self.core.count_malformed("control", r, exc, now)
            return True
        hops = forwarded_hops(r.headers)
        # A record of a part of a session that spans shards (protocol 8) is for this shard,
        # whatever else it would match: the consumer sent it here.
        target = (self._shard_of(message) if hops < MAX_FORWARD_HOPS
                  and credit_home(r.headers) is None else None)
        if target is not None and target != self.core.shard:
            self.forward(r, r.value, target, hops)
            return True
        identity = self.core.identity
        if isinstance(message, Subscribe | Replace):
            if isinstance(message, Replace):
                session = self.core.sessions.get(message.consumer_id)
                if (session is not None and session.session_id == message.session_id
                        and not identity.admits(session, r.headers, "replace", now)):
                    return True
            return on_subscribe(self, message, now, batch, replies, delivery_format(r.headers),
                                r.headers, now if came is None else came)
        elif isinstance(message, Heartbeat):
            session = self.core.sessions.get(message.consumer_id)
            if session is None or session.session_id != message.session_id:
                self.core.counters["unknown_session_heartbeats"] += 1
                identity.log("heartbeat", Refusal.UNKNOWN_SESSION, message.consumer_id, now,
                             f"no session {message.session_id}",
                             "counted as unknown_session_heartbeats")
                # Answered only on a delivery topic that exists: replies create no topic.
                replies.append(self.session_ended(message.consumer_id, message.session_id,
                                                   SessionEndReason.UNKNOWN_SESSION, now,
                                                   "no such session: subscribe again"))
                return True
            if not identity.admits(session, r.headers, "heartbeat", now):
                return True
            for name in session.every_queue:
                self.core.engines[name].heartbeat(message.consumer_id, now, message.session_id)
            batch.heartbeat(message.consumer_id, now, self._span(session))
        elif isinstance(message, Unsubscribe):
            session = self.core.sessions.get(message.consumer_id)
            if session is None or session.session_id != message.session_id:
                self.core.counters["unknown_session_unsubscribes"] += 1
                identity.log("unsubscribe", Refusal.UNKNOWN_SESSION, message.consumer_id, now,
                             f"no session {message.session_id}",
                             "counted as unknown_session_unsubscribes")
                return True
            if not identity.admits(session, r.headers, "unsubscribe", now):
                return True
            if self.core.fence_first(session, SessionEndReason.UNSUBSCRIBED, "unsubscribed"):
                # Its committed acks may not all be read yet (they come on another
                # partition): the session ends once the fence has read them.
                return True
            for name in session.every_queue:
                self.core.engines[name].unsubscribe(message.consumer_id, now)
            del self.core.sessions[message.consumer_id]
            batch.delete_consumer(message.consumer_id, message.session_id, self._span(session))
        return True

    def _span(self, session: Session) -> int | None:
        """This shard, for a part of a session whose home is another shard (its row is in
        `consumer_spans`); None for a session whose row is its `consumers` row."""
        return self.core.shard if session.is_span(self.core.shard) else None

    def _shard_of(self, message: Subscribe | Replace | Heartbeat | Unsubscribe
                       ) -> int | None:
        """The one shard that serves a control record, None when this shard answers it (its
        own session, or a request no shard or several shards would serve)."""
        session = self.core.sessions.get(message.consumer_id)
        if session is not None and session.session_id == message.session_id:
            return None
        catalog = self.core.catalog()
        if isinstance(message, Subscribe | Replace):
            try:
                shards = catalog.shards_matching(message.queue, message.queue_is_regex)
            except re.error:
                return None
        else:
            shards = catalog.consumer_shards(message.consumer_id, message.session_id)
        return next(iter(shards)) if len(shards) == 1 else None

    def delivery_topic_of(self, consumer_id: str) -> str:
        """Where to answer a consumer: its session's delivery topic, else the conventional
        one (docs/protocol.md §7). Not validated here: a consumer id that makes no legal topic
        name is dropped, counted, by :meth:`_answerable`."""
        session = self.core.sessions.get(consumer_id)
        if session is not None:
            return session.delivery_topic
        return f"{self.core.topics.prefix}delivery.{consumer_id}"

    def session_ended(self, consumer_id: str, session_id: str, reason: SessionEndReason,
                       now: float, message: str | None = None) -> OutgoingRecord:
        topic = self.delivery_topic_of(consumer_id)
        return self.reply(topic, SessionEnded(consumer_id=consumer_id, session_id=session_id,
                                               reason=reason, message=message,
                                               sent_at_ms=ms(now)), consumer_id)

    def on_consumer_left(self, e: ev.ConsumerLeft, batch: WriteBatch,
                          replies: list[OutgoingRecord], now: float) -> None:
        """An engine dropped a consumer: a session timeout ends the session everywhere (and
        tells the consumer); a consumer that drained a queue a replace took it off has left
        that queue."""
        session = self.core.sessions.get(e.consumer_id)
        if session is None or session.session_id != e.session_id:
            return
        if e.reason is LeaveReason.REPLACED:
            if e.queue in session.draining:
                session.draining.remove(e.queue)
            return
        if e.reason is not LeaveReason.SESSION_TIMEOUT:
            return
        for name in session.every_queue:
            if name != e.queue:
                self.core.engines[name].unsubscribe(e.consumer_id, now, LeaveReason.SESSION_TIMEOUT)
        replies.append(self.session_ended(e.consumer_id, e.session_id,
                                           SessionEndReason.TIMED_OUT, now,
                                           "no heartbeat within the session timeout"))
        del self.core.sessions[e.consumer_id]
        batch.delete_consumer(e.consumer_id, e.session_id, self._span(session))
        self.core.counters["session_timeouts"] += 1
        log.info("consumer %s timed out; its leases were broken", e.consumer_id,
                 extra=fields(consumer=e.consumer_id, queue=e.queue, shard=self.core.shard,
                              reason="session timeout"))

    def end_session(self, consumer_id: str, now: float, batch: WriteBatch,
                    replies: list[OutgoingRecord] | None, message: str,
                    leave: LeaveReason = LeaveReason.EVICTED,
                    end: SessionEndReason = SessionEndReason.EVICTED,
                    fenced: bool = False) -> None:
        """End a live session of this shard at once: its leases break in every queue, the
        consumer is told (``replies``; None: not told, ``end`` says why) and its row goes, if
        still its own. A transactional session (protocol 9) is fenced first: it ends once
        its producer is fenced and what it committed is applied (``fenced``)."""
        session = self.core.sessions.get(consumer_id)
        if session is None:
            return
        if not fenced and self.core.fence_first(session, end, message):
            return
        del self.core.sessions[consumer_id]
        self.core.fences.forget(consumer_id, session.session_id)
        for name in session.every_queue:
            engine = self.core.engines.get(name)
            if engine is not None:
                engine.unsubscribe(consumer_id, now, leave)
        if replies is not None:
            # The session is gone already, so this is the consumer id's own delivery topic.
            replies.append(self.session_ended(consumer_id, session.session_id, end, now,
                                               message))
        batch.delete_consumer(consumer_id, session.session_id, self._span(session))

    def revoke(self, now: float, batch: WriteBatch, replies: list[OutgoingRecord]) -> None:
        """Sessions the catalog's principals and grants no longer allow (a principal removed,
        a credential rotated, a grant revoked, credentials now required): ended, or taken off
        the queues they lost (a regex subscription), like an eviction."""
        entitlements = self.core.catalog().entitlements
        for consumer_id, session in list(self.core.sessions.items()):
            why = self.authorization.revoked(entitlements, session)
            lost = [] if why is not None else [
                n for n in session.queues if not entitlements.may_consume(session.principal, n)]
            if why is None and lost and len(lost) == len(session.queues):
                why = "it may no longer consume " + ", ".join(repr(n) for n in lost)
            if why is not None:
                self.core.refusals.count("session", "revoked", session.principal)
                self.core.counters["sessions_revoked"] += 1
                log.warning("consumer %s: session ended: %s", consumer_id, why,
                            extra=fields(consumer=consumer_id, shard=self.core.shard,
                                         reason="revoked"))
                self.end_session(consumer_id, now, batch, replies,
                                 f"authorization revoked: {why}")
                continue
            for name in lost:
                engine = self.core.engines.get(name)
                if engine is not None:
                    engine.unsubscribe(consumer_id, now, LeaveReason.EVICTED)
                session.queues.remove(name)
                self.core.refusals.count("queue", "revoked", session.principal)
                log.warning("consumer %s: taken off queue %s: its principal may no longer "
                            "consume it", consumer_id, name,
                            extra=fields(consumer=consumer_id, queue=name,
                                         shard=self.core.shard, reason="revoked"))

    def lost_claims(self, consumer_ids: frozenset[str], now: float,
                    replies: list[OutgoingRecord]) -> frozenset[str]:
        """Sessions this shard accepted whose row another shard holds for a live session of
        the same consumer id (two Subscribes at once on two shards: the store wrote the
        first): ended here, so one consumer id has one session; the OK this step was to send
        becomes a refusal (the replies are not sent yet). Returns the consumer ids ended: what
        the step leased to them must not be sent either (`Output.deliveries`): the consumer
        id's delivery topic is the live session's, which would get a message of a queue it
        never subscribed to. Their leases are broken by the unsubscribe below; the next step
        stores that."""
        ended = frozenset(c for c in consumer_ids if c in self.core.sessions)
        for consumer_id in sorted(consumer_ids):
            if consumer_id not in self.core.sessions:
                continue
            accepted = self.accepted.get(consumer_id)
            if accepted is not None:
                request, ok = accepted
                replies[:] = [r for r in replies if r is not ok]
                replies.append(self.reply(self.delivery_topic_of(consumer_id), SubscribeResult(
                    consumer_id=consumer_id, session_id=request.session_id,
                    request_id=request.request_id,
                    request=(RequestKind.SUBSCRIBE if isinstance(request, Subscribe)
                             else RequestKind.REPLACE),
                    status=SubscribeStatus.INVALID_REQUEST,
                    message=(f"consumer id {consumer_id!r} has a live session on another "
                             "shard; one consumer id has one session"),
                    queues=(), session_timeout_ms=0, heartbeat_interval_ms=0,
                    coordinator_id=self.core.owner_id, sent_at_ms=ms(now)), consumer_id))
            self.core.refusals.count("subscribe", "consumer_id_live_elsewhere",
                                     self.core.sessions[consumer_id].principal)
            self.core.counters["registry_conflicts"] += 1
            log.warning("consumer %s: another shard holds a live session of this consumer id; "
                        "the session this shard accepted ends", consumer_id,
                        extra=fields(consumer=consumer_id, shard=self.core.shard,
                                     reason="consumer id live elsewhere"))
            session = self.core.sessions.pop(consumer_id)
            for name in session.every_queue:
                engine = self.core.engines.get(name)
                if engine is not None:
                    engine.unsubscribe(consumer_id, now, LeaveReason.EVICTED)
            # No row to delete (it is the other session's), and no reply: the consumer id's
            # delivery topic is the other session's too.
        return ended
