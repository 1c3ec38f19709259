"""Control records of one shard: subscribe, replace, heartbeat, unsubscribe; the sessions they
make and end; replies; records of other shards passed on to them."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from layer.coordinator.acks import MAX_FORWARD_HOPS
from layer.coordinator.identity import Refusal
from layer.coordinator.logformat import fields
from layer.coordinator.sessions import Session
from layer.coordinator.translate import ms
from layer.domain import events as ev
from layer.domain.consumers import BacklogShare
from layer.domain.definitions import Semantics
from layer.domain.errors import ExpressionError
from layer.domain.expressions import compile_expression
from layer.domain.states import LeaveReason
from layer.kafka import JournalRecord, KafkaAdapterError, OutgoingRecord, TopicSpec
from layer.protocol import (
    AckResult,
    DeliveryFormat,
    Event,
    EventType,
    GrantSemantics,
    Heartbeat,
    InputHeaders,
    ProtocolError,
    QueueGrant,
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
    topic_name_problem,
)
from layer.protocol import Bookmark as WireBookmark
from layer.protocol.headers import FORWARDED
from layer.store.batch import WriteBatch
from layer.store.rows import ConsumerRow

if TYPE_CHECKING:
    from layer.coordinator.core import ShardCore

log = logging.getLogger(__name__)

__all__ = ["Control"]


class Control:
    """The control side of a `ShardCore`."""

    def __init__(self, core: ShardCore) -> None:
        self.core = core
        self._headers = reply_headers(core.shard)

    def reply(self, topic: str, message: SubscribeResult | AckResult | SessionEnded,
               key: str) -> OutgoingRecord:
        return OutgoingRecord(topic, self.core.codec.encode_reply(message), key.encode(),
                              self._headers, partition=0)

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
                    replies: list[OutgoingRecord]) -> None:
        try:
            message = self.core.codec.decode_control(r.value)
        except ProtocolError as exc:
            self.core.counters["malformed_control_records"] += 1
            log.warning("malformed record on %s[%d]@%d: %s", r.topic, r.partition, r.offset, exc)
            return
        hops = forwarded_hops(r.headers)
        target = self._shard_of(message) if hops < MAX_FORWARD_HOPS else None
        if target is not None and target != self.core.shard:
            self.forward(r, r.value, target, hops)
            return
        identity = self.core.identity
        if isinstance(message, Subscribe | Replace):
            if isinstance(message, Replace):
                session = self.core.sessions.get(message.consumer_id)
                if (session is not None and session.session_id == message.session_id
                        and not identity.admits(session, r.headers, "replace", now)):
                    return
            self._on_subscribe(message, now, batch, replies, delivery_format(r.headers),
                               r.headers)
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
                return
            if not identity.admits(session, r.headers, "heartbeat", now):
                return
            for name in session.every_queue:
                self.core.engines[name].heartbeat(message.consumer_id, now, message.session_id)
            batch.heartbeat(message.consumer_id, now)
        elif isinstance(message, Unsubscribe):
            session = self.core.sessions.get(message.consumer_id)
            if session is None or session.session_id != message.session_id:
                self.core.counters["unknown_session_unsubscribes"] += 1
                identity.log("unsubscribe", Refusal.UNKNOWN_SESSION, message.consumer_id, now,
                             f"no session {message.session_id}",
                             "counted as unknown_session_unsubscribes")
                return
            if not identity.admits(session, r.headers, "unsubscribe", now):
                return
            for name in session.every_queue:
                self.core.engines[name].unsubscribe(message.consumer_id, now)
            del self.core.sessions[message.consumer_id]
            batch.delete_consumer(message.consumer_id, message.session_id)

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

    def _on_subscribe(self, m: Subscribe | Replace, now: float, batch: WriteBatch,
                      replies: list[OutgoingRecord], formats: str = DeliveryFormat.RECORD,
                      headers: InputHeaders = None) -> None:
        kind = RequestKind.SUBSCRIBE if isinstance(m, Subscribe) else RequestKind.REPLACE
        existing = self.core.sessions.get(m.consumer_id)
        timeout = (m.session_timeout_ms / 1000.0 if isinstance(m, Subscribe)
                   and m.session_timeout_ms > 0 else
                   existing.session_timeout if existing is not None
                   else self.core.options.default_session_timeout)

        def refuse(status: SubscribeStatus, why: str) -> None:
            self.core.counters[f"subscribe_{status.value.lower()}"] += 1
            self.refused(EventType.SUBSCRIBE_REFUSED, now, status.value, m.consumer_id,
                          m.session_id, m.queue if not m.queue_is_regex else None)
            log.info("refused %s of %s to %r: %s", kind.value.lower(), m.consumer_id, m.queue, why,
                     extra=fields(consumer=m.consumer_id, queue=m.queue, shard=self.core.shard,
                                  reason=status.value))
            topic = (m.delivery_topic if topic_name_problem(m.delivery_topic) is None
                     else self.delivery_topic_of(m.consumer_id))
            replies.append(self.reply(topic, SubscribeResult(
                consumer_id=m.consumer_id, session_id=m.session_id, request_id=m.request_id,
                request=kind, status=status, message=why, queues=(),
                session_timeout_ms=int(timeout * 1000),
                heartbeat_interval_ms=int(timeout * 1000 / 3),
                coordinator_id=self.core.owner_id, sent_at_ms=ms(now)), m.consumer_id))

        if kind is RequestKind.REPLACE and (existing is None
                                            or existing.session_id != m.session_id):
            refuse(SubscribeStatus.INVALID_REQUEST, "replace of an unknown session: subscribe")
            return
        # A Replace keeps its session's secret (its proof was checked in `on_record`); a
        # Subscribe brings a new one, and may not take a live proven session over without
        # proving that session's secret. Checked before anything is created for it.
        secret_hash = existing.secret_hash if existing is not None else None
        if kind is RequestKind.SUBSCRIBE:
            verdict = self.core.identity.subscribe(
                m.consumer_id, existing, headers, now,
                existing.session_timeout if existing is not None else timeout)
            if verdict.refusal is not None:
                refuse(SubscribeStatus.INVALID_REQUEST, verdict.message or verdict.refusal)
                return
            secret_hash = verdict.secret_hash
        problem = topic_name_problem(m.delivery_topic)
        if problem is None and m.delivery_topic in (self.core.topics.control, self.core.topics.ack,
                                                    self.core.topics.events):
            problem = "it is one of the coordinator's own topics"
        if problem is not None:
            refuse(SubscribeStatus.INVALID_REQUEST,
                   f"delivery_topic {m.delivery_topic!r}: {problem}")
            return
        if m.max_backlog is not None and m.max_backlog < 0:
            refuse(SubscribeStatus.INVALID_REQUEST,
                   f"max_backlog must be 0 or more, got {m.max_backlog}")
            return
        if m.filter:
            try:
                compile_expression(m.filter)
            except ExpressionError as exc:
                refuse(SubscribeStatus.INVALID_FILTER, str(exc))
                return
        session = Session(m.consumer_id, m.session_id, m.queue, m.queue_is_regex,
                           m.max_backlog, m.filter or None, m.delivery_topic, timeout,
                           existing.subscribed_at if existing and kind is RequestKind.REPLACE
                           else now, [], delivery_format=formats, secret_hash=secret_hash)
        try:
            names = [n for n in self.core.engines if session.matches(n)]
            shards = self.core.catalog().shards_matching(m.queue, m.queue_is_regex)
        except re.error as exc:
            refuse(SubscribeStatus.INVALID_REQUEST, f"invalid queue regex: {exc}")
            return
        if len(shards) > 1:
            # One backlog across the matched queues (AMPS) needs them in one loop.
            refuse(SubscribeStatus.INVALID_REQUEST,
                   f"the queues {m.queue!r} matches are on shards {sorted(shards)}; a regex "
                   "subscription reads queues of one shard only: give them one shard_group "
                   "in their queue files (docs/coordinator.md, 'One backlog')")
            return
        old = existing.queues if existing is not None else []
        replacing = kind is RequestKind.REPLACE and existing is not None
        # A replace that takes the subscription off a queue keeps its leases there (AMPS
        # "Replacing Queue Subscriptions"), and they keep counting against its backlog: the
        # queues it drains and the new ones share one backlog.
        leaving = [n for n in old if n not in names] if replacing else []
        if m.queue_is_regex or leaving or (replacing and existing is not None
                                           and existing.draining):
            session.share = (existing.share if existing is not None and replacing
                             and existing.share is not None else BacklogShare())
        if not names:
            refuse(SubscribeStatus.UNKNOWN_QUEUE,
                   f"no queue {'matches' if m.queue_is_regex else 'named'} {m.queue!r}")
            return
        try:
            self.core.admin.ensure_topics([TopicSpec(m.delivery_topic, 1)])
            self.core.known_topics.add(m.delivery_topic)
        except KafkaAdapterError as exc:
            # Refused rather than retried: a topic the broker will not create would otherwise
            # fail this record's iteration forever. The consumer may subscribe again.
            refuse(SubscribeStatus.INVALID_REQUEST, f"cannot use delivery_topic: {exc}")
            return
        if replacing and existing is not None:
            for name in leaving:
                self.core.engines[name].retire(m.consumer_id, now, session.share)
            # Queues it already drained from, still holding leases, and not subscribed again.
            session.draining = [n for n in existing.draining + leaving
                                if n not in names and n in self.core.engines]
        else:
            for name in old:
                if name not in names:
                    self.core.engines[name].unsubscribe(m.consumer_id, now)
            if existing is not None:
                for name in existing.draining:
                    if name in self.core.engines:
                        self.core.engines[name].unsubscribe(m.consumer_id, now)
        grants = []
        for name in names:
            engine = self.core.engines[name]
            event: ev.ConsumerSubscribed | ev.ConsumerReplaced
            if replacing and (name in old or name in (existing.draining if existing else [])):
                event = engine.replace(m.consumer_id, now, max_backlog=m.max_backlog,
                                       filter=m.filter or None, delivery_topic=m.delivery_topic,
                                       share=session.share)
            else:
                event = engine.subscribe(m.consumer_id, m.session_id, now,
                                         delivery_topic=m.delivery_topic,
                                         max_backlog=m.max_backlog, filter=m.filter or None,
                                         session_timeout=timeout, share=session.share)
            definition = engine.definition
            grants.append(QueueGrant(
                queue=name, max_backlog=event.max_backlog,
                lease_period_ms=int(definition.lease_period * 1000),
                semantics=(GrantSemantics.AT_MOST_ONCE
                           if definition.semantics is Semantics.AT_MOST_ONCE
                           else GrantSemantics.AT_LEAST_ONCE)))
        session.queues = names
        self.core.sessions[m.consumer_id] = session
        batch.put_consumer(ConsumerRow(
            consumer_id=m.consumer_id, session_id=m.session_id, queue=m.queue,
            is_regex=m.queue_is_regex, delivery_topic=m.delivery_topic,
            session_timeout_ms=int(timeout * 1000), subscribed_at=session.subscribed_at,
            last_heartbeat_at=now, max_backlog=m.max_backlog, filter=m.filter or None,
            delivery_format=formats, secret_hash=secret_hash))
        self.core.counters["subscribes" if kind is RequestKind.SUBSCRIBE else "replaces"] += 1
        replies.append(self.reply(m.delivery_topic, SubscribeResult(
            consumer_id=m.consumer_id, session_id=m.session_id, request_id=m.request_id,
            request=kind, status=SubscribeStatus.OK, message=None, queues=tuple(grants),
            session_timeout_ms=int(timeout * 1000),
            heartbeat_interval_ms=max(int(timeout * 1000 / 3), 100),
            coordinator_id=self.core.owner_id, sent_at_ms=ms(now)), m.consumer_id))

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
        batch.delete_consumer(e.consumer_id, e.session_id)
        self.core.counters["session_timeouts"] += 1
        log.info("consumer %s timed out; its leases were broken", e.consumer_id,
                 extra=fields(consumer=e.consumer_id, queue=e.queue, shard=self.core.shard,
                              reason="session timeout"))
