"""Control records of one shard: subscribe, replace, heartbeat, unsubscribe; the sessions they
make and end; replies; records of other shards passed on to them."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from layer.coordinator.acks import MAX_FORWARD_HOPS
from layer.coordinator.authorize import Authorization, Verdict
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
)
from layer.protocol import Bookmark as WireBookmark
from layer.protocol.batch import BATCH, encode_delivery_batch
from layer.protocol.headers import (
    FORWARDED,
    NOT_AUTHORIZED,
    REFUSAL,
    SESSION,
    SHARD,
    SPANS_SHARDS,
    credit_home,
    credit_report_header,
    shards_header,
)
from layer.store.batch import WriteBatch
from layer.store.rows import ConsumerRow

if TYPE_CHECKING:
    from layer.coordinator.core import ShardCore

log = logging.getLogger(__name__)

__all__ = ["CONTROL_RECORD_LIMIT", "Control"]

#: The largest control record a coordinator reads (bytes); larger ones are dropped unread and
#: counted (``oversized_control_records``). The control topic is made with this
#: ``max.message.bytes``. A Subscribe holds ids, a queue name or regex and a filter (at most
#: `layer.domain.expressions` limits): a few KiB.
CONTROL_RECORD_LIMIT = 64 << 10

#: A credit notice's value: a delivery batch of no message (protocol 8).
_EMPTY_BATCH = encode_delivery_batch([])


class Control:
    """The control side of a `ShardCore`."""

    def __init__(self, core: ShardCore) -> None:
        self.core = core
        self._headers = reply_headers(core.shard)
        self._not_authorized = [*self._headers, (REFUSAL, NOT_AUTHORIZED.encode())]
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
        #: Consumer ids whose session here holds credit its consumer granted (protocol 8): they
        #: are told what they hold and what waits whenever that changes (`credit_notices`).
        self.credited: set[str] = set()

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

    def _stale(self, came: float) -> bool:
        """Whether the catalog was loaded before a record that came at ``came``."""
        return self.core.catalog().loaded_at <= came

    def reply(self, topic: str, message: SubscribeResult | AckResult | SessionEnded,
               key: str, headers: list[tuple[str, bytes]] | None = None
               ) -> OutgoingRecord:
        return OutgoingRecord(topic, self.core.codec.encode_reply(message), key.encode(),
                              headers if headers is not None else self._headers, partition=0)

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
            return self._on_subscribe(message, now, batch, replies, delivery_format(r.headers),
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

    def _on_subscribe(self, m: Subscribe | Replace, now: float, batch: WriteBatch,
                      replies: list[OutgoingRecord], formats: str = DeliveryFormat.RECORD,
                      headers: InputHeaders = None, came: float | None = None) -> bool:
        """Subscribe or Replace; False when the answer must wait for a fresher catalog."""
        kind = RequestKind.SUBSCRIBE if isinstance(m, Subscribe) else RequestKind.REPLACE
        existing = self.core.sessions.get(m.consumer_id)
        # Protocol 8: a part of a session whose consumer grants credit; a Replace keeps the
        # home its session has.
        home = credit_home(headers)
        # A Replace keeps its session's home; one with `qlayer.credit` naming this shard makes
        # a session of one shard the home of a spanning one (its regex now matches queues of
        # another shard too).
        if (kind is RequestKind.REPLACE and existing is not None
                and (existing.home is not None or home != self.core.shard)):
            home = existing.home
        span = home is not None and home != self.core.shard
        came = now if came is None else came
        catalog = self.core.catalog()
        entitlements = catalog.entitlements
        timeout = (m.session_timeout_ms / 1000.0 if isinstance(m, Subscribe)
                   and m.session_timeout_ms > 0 else
                   existing.session_timeout if existing is not None
                   else self.core.options.default_session_timeout)
        label = existing.principal if existing is not None and existing.principal else None
        # Set once a credential proved a principal that owns the consumer id: its refusals
        # may create the id's delivery topic (under the ACL recipe a consumer cannot), so the
        # consumer reads why instead of timing out. Anyone else's refusal goes to the topic
        # only if it exists: records must not make topics at will.
        owner: list[bool] = [False]

        def refuse(status: SubscribeStatus, why: str, reason: str | None = None,
                   not_authorized: bool = False,
                   extra: list[tuple[str, bytes]] | None = None) -> bool:
            self.core.counters[f"subscribe_{status.value.lower()}"] += 1
            self.core.refusals.count(kind.value.lower(), reason or status.value.lower(),
                                     label)
            self.refused(EventType.SUBSCRIBE_REFUSED, now, status.value, m.consumer_id,
                          m.session_id, m.queue if not m.queue_is_regex else None)
            log.info("refused %s of %s to %r: %s", kind.value.lower(), m.consumer_id, m.queue, why,
                     extra=fields(consumer=m.consumer_id, queue=m.queue, shard=self.core.shard,
                                  reason=reason or status.value))
            # Always the consumer id's own delivery topic (protocol 7: qlayer names it), never
            # one the request names: a refusal reaches the consumer the id belongs to, and
            # says nothing of another session.
            topic = self.delivery_topic_of(m.consumer_id)
            if owner[0] and topic not in self.core.known_topics:
                try:
                    self.core.admin.ensure_topics([TopicSpec(topic, 1)])
                    self.core.known_topics.add(topic)
                except KafkaAdapterError as exc:
                    log.warning("cannot make delivery topic %s to answer a refused %s: %s",
                                topic, kind.value.lower(), exc)
            replies.append(self.reply(topic, SubscribeResult(
                consumer_id=m.consumer_id, session_id=m.session_id, request_id=m.request_id,
                request=kind, status=status, message=why, queues=(),
                session_timeout_ms=int(timeout * 1000),
                heartbeat_interval_ms=int(timeout * 1000 / 3),
                coordinator_id=self.core.owner_id, sent_at_ms=ms(now)), m.consumer_id,
                self._not_authorized if not_authorized
                else [*self._headers, *extra] if extra else None))
            return True

        if kind is RequestKind.REPLACE and (existing is None
                                            or existing.session_id != m.session_id):
            return refuse(SubscribeStatus.INVALID_REQUEST,
                          "replace of an unknown session: subscribe")
        # Authorization (protocol 7) first: who the Subscribe is, and whether that principal
        # owns the consumer id. A Replace keeps its session's principal.
        if kind is RequestKind.SUBSCRIBE:
            who: Verdict = self.authorization.subscribe(entitlements, m.consumer_id, headers)
            label = who.label
            if who.refused:
                if self._stale(came):
                    return False
                return refuse(SubscribeStatus.INVALID_REQUEST, who.message or "not authorized",
                              who.reason, not_authorized=True)
            principal, credential_hash = who.principal, who.credential_hash
        else:
            assert existing is not None
            principal, credential_hash = existing.principal, existing.credential_hash
        owner[0] = principal is not None
        if not m.queue_is_regex:
            why_not = self.authorization.queue_refusal(entitlements, principal, m.queue)
            if why_not is not None:
                if self._stale(came):
                    return False
                return refuse(SubscribeStatus.INVALID_REQUEST, why_not, "queue_not_granted",
                              not_authorized=True)
        # One consumer id, one session across shards: another shard's live session of this id
        # is not shadowed (and its stored row is never overwritten: `UPSERT_CONSUMERS`).
        if existing is None and not span:
            elsewhere = catalog.live_elsewhere(m.consumer_id, self.core.shard, now)
            if elsewhere is not None:
                if self._stale(came):
                    return False
                return refuse(SubscribeStatus.INVALID_REQUEST, (
                    f"consumer id {m.consumer_id!r} has a live session on another shard; one "
                    "consumer id has one session: it ends with its Unsubscribe or after its "
                    f"session timeout ({elsewhere.session_timeout_ms / 1000:g}s without a "
                    "heartbeat)"), "consumer_id_live_elsewhere")
        # A Replace keeps its session's secret (its proof was checked in `on_record`); a
        # Subscribe brings a new one, and may not take a live proven session over without
        # proving that session's secret. Checked before anything is created for it.
        secret_hash = existing.secret_hash if existing is not None else None
        if kind is RequestKind.SUBSCRIBE:
            verdict = self.core.identity.subscribe(
                m.consumer_id, existing, headers, now,
                existing.session_timeout if existing is not None else timeout)
            if verdict.refusal is not None:
                return refuse(SubscribeStatus.INVALID_REQUEST, verdict.message or verdict.refusal,
                              verdict.refusal.value)
            secret_hash = verdict.secret_hash
            if span and not catalog.home_holds(m.consumer_id, m.session_id, home or 0,
                                               secret_hash):
                # A part joins its session only once the home shard holds it (the consumer
                # subscribes there first): waited for one catalog load, then refused.
                if self._stale(came):
                    return False
                return refuse(SubscribeStatus.INVALID_REQUEST, (
                    f"no session {m.session_id} of consumer {m.consumer_id!r} on its home "
                    f"shard {home}: subscribe there first (docs/protocol.md §14)"),
                    "no_home_session")
        # Delivery topics are named by qlayer (protocol 7), never by the client: a client-named
        # topic let a Subscribe make the coordinator write to a journal, to another consumer's
        # delivery topic or to its own internal topics.
        try:
            expected = self.core.topics.delivery(m.consumer_id)
        except ProtocolError as exc:
            return refuse(SubscribeStatus.INVALID_REQUEST, f"consumer id: {exc}",
                          "bad_consumer_id")
        if m.delivery_topic != expected:
            return refuse(SubscribeStatus.INVALID_REQUEST, (
                f"delivery_topic must be {expected!r}: qlayer names each consumer's delivery "
                "topic (<prefix>delivery.<consumer_id>, docs/protocol.md §1)"),
                "delivery_topic_not_its_own")
        if m.max_backlog is not None and m.max_backlog < 0:
            return refuse(SubscribeStatus.INVALID_REQUEST,
                          f"max_backlog must be 0 or more, got {m.max_backlog}")
        if m.filter:
            try:
                compile_expression(m.filter)
            except ExpressionError as exc:
                return refuse(SubscribeStatus.INVALID_FILTER, str(exc))
        session = Session(m.consumer_id, m.session_id, m.queue, m.queue_is_regex,
                           m.max_backlog, m.filter or None, m.delivery_topic, timeout,
                           existing.subscribed_at if existing and kind is RequestKind.REPLACE
                           else now, [], delivery_format=formats, secret_hash=secret_hash,
                           principal=principal, credential_hash=credential_hash,
                           home=home)
        try:
            # A regex covers the queues the principal may consume, only (AMPS entitlements
            # filter a regex subscription the same way).
            names = [n for n in self.core.engines if session.matches(n)
                     and entitlements.may_consume(principal, n)]
            shards = {catalog.queues[n].shard for n in catalog.queues
                      if session.matches(n) and entitlements.may_consume(principal, n)}
        except re.error as exc:
            return refuse(SubscribeStatus.INVALID_REQUEST, f"invalid queue regex: {exc}")
        if home is None and (len(shards) > 1 or (shards and self.core.shard not in shards)):
            # One backlog across the matched queues (AMPS) is credit the consumer moves
            # between their shards (protocol 8); a consumer of an earlier protocol has none.
            # So is a replace of this shard's session onto another shard's queue: the session
            # stays here (its leases too) and gets a part there.
            where = (f"the queues {m.queue!r} matches are on shards {sorted(shards)}"
                     if len(shards) > 1 else f"{m.queue!r} is on shard {min(shards)}, the "
                     f"session on shard {self.core.shard}")
            return refuse(SubscribeStatus.INVALID_REQUEST,
                          f"{where}; a subscription over several shards needs a consumer of "
                          "protocol 8 (the qlayer SDK from 0.9), which grants each shard its "
                          "credit (docs/coordinator.md, 'One backlog')", SPANS_SHARDS,
                          extra=[(REFUSAL, SPANS_SHARDS.encode()), shards_header(list(shards))])
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
        # A replace of a spanning session's part onto queues of other shards only: the part
        # keeps draining the leases it holds here (AMPS "Replacing Queue Subscriptions").
        drains_only = not names and bool(shards) and home is not None and replacing
        if not names and not drains_only:
            # A queue applied a moment ago is served once this shard's catalog has it: the
            # Subscribe waits for that rather than being refused (issue 35: deployment scripts
            # apply queues and start consumers at once).
            if self._stale(came):
                return False
            return refuse(SubscribeStatus.UNKNOWN_QUEUE,
                          f"no queue {'matches' if m.queue_is_regex else 'named'} {m.queue!r}"
                          + (" that this consumer may consume" if m.queue_is_regex
                             and entitlements.grants else ""))
        try:
            self.core.admin.ensure_topics([TopicSpec(m.delivery_topic, 1)])
            self.core.known_topics.add(m.delivery_topic)
        except KafkaAdapterError as exc:
            # Refused rather than retried: a topic the broker will not create would otherwise
            # fail this record's iteration forever. The consumer may subscribe again.
            return refuse(SubscribeStatus.INVALID_REQUEST, f"cannot use delivery_topic: {exc}")
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
            delivery_format=formats, secret_hash=secret_hash, shard=self.core.shard,
            principal=principal, credential_hash=credential_hash, credit_home=home))
        self.core.counters["subscribes" if kind is RequestKind.SUBSCRIBE else "replaces"] += 1
        answer_headers = None
        if home is not None:
            self.credited.add(m.consumer_id)
            report = self.credit_report(session)
            session.reported = report
            # And where the subscription's queues are, for the consumer to add parts there.
            answer_headers = [*self._headers, credit_report_header(*report),
                              shards_header(list(shards))]
        ok = self.reply(m.delivery_topic, SubscribeResult(
            consumer_id=m.consumer_id, session_id=m.session_id, request_id=m.request_id,
            request=kind, status=SubscribeStatus.OK, message=None, queues=tuple(grants),
            session_timeout_ms=int(timeout * 1000),
            heartbeat_interval_ms=max(int(timeout * 1000 / 3), 100),
            coordinator_id=self.core.owner_id, sent_at_ms=ms(now)), m.consumer_id,
            answer_headers)
        replies.append(ok)
        self.accepted[m.consumer_id] = (m, ok)
        return True

    # --- credit (protocol 8) --------------------------------------------------------------------

    def credit_report(self, session: Session) -> tuple[int, int, int]:
        """``(held, grant, waiting)`` of a session's part on this shard: the leases it holds in
        every queue here (those it drains too), its grant, and the entries available in its
        queues (before its filter: where work waits, roughly)."""
        held = waiting = 0
        engines = self.core.engines
        for name in session.every_queue:
            engine = engines.get(name)
            if engine is None:
                continue
            for info in engine.consumers():
                if info.consumer_id == session.consumer_id:
                    held += info.backlog
                    break
            restored = self.core.restored_leases.get(name)
            if restored:
                # Its leases restored from PostgreSQL that the replay has not reached: held
                # all the same (reported as free, their credit would be granted twice).
                waiting_replay = {(c, b) for c, b in restored if engine.restoring(b)}
                if len(waiting_replay) < len(restored):
                    restored.intersection_update(waiting_replay)
                held += sum(1 for c, _ in restored if c == session.consumer_id)
            if name in session.queues:
                waiting += engine.stats().available
        grant = session.max_backlog if session.max_backlog is not None else 1
        return held, grant, waiting

    def credit_notices(self, replies: list[OutgoingRecord]) -> None:
        """Tell each credited session what changed since it was last told that its consumer
        acts on (work came to wait or stopped waiting, a grant was applied, leases held past
        the grant were settled): an empty delivery batch with a ``qlayer.credit-report``
        header, after this step's deliveries. Its consumer moves its credit on these
        (`layer.sdk.credit`)."""
        sessions = self.core.sessions
        for consumer_id in list(self.credited):
            session = sessions.get(consumer_id)
            if session is None or session.home is None:
                self.credited.discard(consumer_id)
                continue
            report = self.credit_report(session)
            last = session.reported
            # Only what its consumer's ledger acts on: where work starts or stops waiting, a
            # grant applied, and leases settled while more are held than granted (credit
            # coming back). Deliveries within the grant need no word: at full speed a notice
            # per step per shard cost more than the credit it moves.
            if last is not None and not (
                    report[1] != last[1] or (report[2] > 0) != (last[2] > 0)
                    or (report[0] < last[0] and last[0] > report[1])):
                continue
            session.reported = report
            replies.append(OutgoingRecord(
                session.delivery_topic, _EMPTY_BATCH, consumer_id.encode(),
                [(BATCH, b"1"), (SESSION, session.session_id.encode()),
                 (SHARD, b"%d" % self.core.shard), credit_report_header(*report)],
                partition=0))

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
                    leave: LeaveReason = LeaveReason.EVICTED) -> None:
        """End a live session of this shard at once: its leases break in every queue, the
        consumer is told (``replies``; None: not told) and its row goes, if still its own."""
        session = self.core.sessions.pop(consumer_id, None)
        if session is None:
            return
        for name in session.every_queue:
            engine = self.core.engines.get(name)
            if engine is not None:
                engine.unsubscribe(consumer_id, now, leave)
        if replies is not None:
            # The session is gone already, so this is the consumer id's own delivery topic.
            replies.append(self.session_ended(consumer_id, session.session_id,
                                               SessionEndReason.EVICTED, now, message))
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
