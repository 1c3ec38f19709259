"""A Subscribe or a Replace on one shard (`Control.on_record`): who asks and whether it may,
which queues it matches here and on other shards, the session it makes or changes in each
queue's engine, its stored row and its answer."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from layer.coordinator.authorize import Verdict
from layer.coordinator.logformat import fields
from layer.coordinator.sessions import Session
from layer.coordinator.translate import ms
from layer.domain import events as ev
from layer.domain.consumers import BacklogShare
from layer.domain.definitions import Semantics
from layer.domain.errors import ExpressionError
from layer.domain.expressions import compile_expression
from layer.kafka import KafkaAdapterError, OutgoingRecord, TopicSpec
from layer.protocol import (
    DeliveryFormat,
    EventType,
    GrantSemantics,
    InputHeaders,
    ProtocolError,
    QueueGrant,
    Replace,
    RequestKind,
    SessionEndReason,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
)
from layer.protocol.headers import (
    FENCING,
    REFUSAL,
    SPANS_SHARDS,
    TRANSACTIONAL_ID,
    credit_home,
    credit_report_header,
    shards_header,
    transactional_id,
)
from layer.store.batch import WriteBatch
from layer.store.rows import ConsumerRow

if TYPE_CHECKING:
    from layer.coordinator.control import Control

log = logging.getLogger(__name__)

__all__ = ["on_subscribe"]


def on_subscribe(control: Control, m: Subscribe | Replace, now: float, batch: WriteBatch,
                 replies: list[OutgoingRecord], formats: str = DeliveryFormat.RECORD,
                 headers: InputHeaders = None, came: float | None = None) -> bool:
    """Subscribe or Replace; False when the answer must wait for a fresher catalog."""
    kind = RequestKind.SUBSCRIBE if isinstance(m, Subscribe) else RequestKind.REPLACE
    existing = control.core.sessions.get(m.consumer_id)
    # Protocol 8: a part of a session whose consumer grants credit; a Replace keeps the
    # home its session has.
    home = credit_home(headers)
    # A Replace keeps its session's home; one with `qlayer.credit` naming this shard makes
    # a session of one shard the home of a spanning one (its regex now matches queues of
    # another shard too).
    if (kind is RequestKind.REPLACE and existing is not None
            and (existing.home is not None or home != control.core.shard)):
        home = existing.home
    span = home is not None and home != control.core.shard
    came = now if came is None else came
    catalog = control.core.catalog()
    entitlements = catalog.entitlements
    timeout = (m.session_timeout_ms / 1000.0 if isinstance(m, Subscribe)
               and m.session_timeout_ms > 0 else
               existing.session_timeout if existing is not None
               else control.core.options.default_session_timeout)
    label = existing.principal if existing is not None and existing.principal else None
    # Set once a credential proved a principal that owns the consumer id: its refusals
    # may create the id's delivery topic (under the ACL recipe a consumer cannot), so the
    # consumer reads why instead of timing out. Anyone else's refusal goes to the topic
    # only if it exists: records must not make topics at will.
    owner: list[bool] = [False]

    def refuse(status: SubscribeStatus, why: str, reason: str | None = None,
               not_authorized: bool = False,
               extra: list[tuple[str, bytes]] | None = None) -> bool:
        control.core.counters[f"subscribe_{status.value.lower()}"] += 1
        control.core.refusals.count(kind.value.lower(), reason or status.value.lower(),
                                 label)
        control.refused(EventType.SUBSCRIBE_REFUSED, now, status.value, m.consumer_id,
                      m.session_id, m.queue if not m.queue_is_regex else None)
        log.info("refused %s of %s to %r: %s", kind.value.lower(), m.consumer_id, m.queue, why,
                 extra=fields(consumer=m.consumer_id, queue=m.queue, shard=control.core.shard,
                              reason=reason or status.value))
        # Always the consumer id's own delivery topic (protocol 7: qlayer names it), never
        # one the request names: a refusal reaches the consumer the id belongs to, and
        # says nothing of another session.
        topic = control.delivery_topic_of(m.consumer_id)
        if owner[0] and topic not in control.core.known_topics:
            try:
                control.core.admin.ensure_topics([TopicSpec(topic, 1)])
                control.core.known_topics.add(topic)
            except KafkaAdapterError as exc:
                log.warning("cannot make delivery topic %s to answer a refused %s: %s",
                            topic, kind.value.lower(), exc)
        replies.append(control.reply(topic, SubscribeResult(
            consumer_id=m.consumer_id, session_id=m.session_id, request_id=m.request_id,
            request=kind, status=status, message=why, queues=(),
            session_timeout_ms=int(timeout * 1000),
            heartbeat_interval_ms=int(timeout * 1000 / 3),
            coordinator_id=control.core.owner_id, sent_at_ms=ms(now)), m.consumer_id,
            control.not_authorized if not_authorized
            else [*control.reply_headers, *extra] if extra else None))
        return True

    if kind is RequestKind.REPLACE and (existing is None
                                        or existing.session_id != m.session_id):
        return refuse(SubscribeStatus.INVALID_REQUEST,
                      "replace of an unknown session: subscribe")
    # Authorization (protocol 7) first: who the Subscribe is, and whether that principal
    # owns the consumer id. A Replace keeps its session's principal.
    if kind is RequestKind.SUBSCRIBE:
        who: Verdict = control.authorization.subscribe(entitlements, m.consumer_id, headers)
        label = who.label
        if who.refused:
            if control.stale(came):
                return False
            return refuse(SubscribeStatus.INVALID_REQUEST, who.message or "not authorized",
                          who.reason, not_authorized=True)
        principal, credential_hash = who.principal, who.credential_hash
    else:
        assert existing is not None
        principal, credential_hash = existing.principal, existing.credential_hash
    owner[0] = principal is not None
    if not m.queue_is_regex:
        why_not = control.authorization.queue_refusal(entitlements, principal, m.queue)
        if why_not is not None:
            if control.stale(came):
                return False
            return refuse(SubscribeStatus.INVALID_REQUEST, why_not, "queue_not_granted",
                          not_authorized=True)
    # One consumer id, one session across shards: another shard's live session of this id
    # is not shadowed (and its stored row is never overwritten: `UPSERT_CONSUMERS`).
    if existing is None and not span:
        elsewhere = catalog.live_elsewhere(m.consumer_id, control.core.shard, now)
        if elsewhere is not None:
            if control.stale(came):
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
        verdict = control.core.identity.subscribe(
            m.consumer_id, existing, headers, now,
            existing.session_timeout if existing is not None else timeout)
        if verdict.refusal is not None:
            return refuse(SubscribeStatus.INVALID_REQUEST, verdict.message or verdict.refusal,
                          verdict.refusal.value)
        secret_hash = verdict.secret_hash
        if (existing is not None and existing.session_id != m.session_id
                and control.core.fence_first(
                    existing, SessionEndReason.EVICTED,
                    "its consumer id subscribed again with a new session")):
            # Protocol 9: the old session may be a paused process with an open transaction;
            # its leases are broken only once its producer is fenced, so the new session
            # waits for that (its consumer subscribes again in a moment).
            return refuse(SubscribeStatus.INVALID_REQUEST, (
                f"the previous session {existing.session_id} of consumer "
                f"{m.consumer_id!r} settles in Kafka transactions: it is being fenced and "
                "ended first; subscribe again in a moment (docs/protocol.md §15)"), FENCING,
                extra=[(REFUSAL, FENCING.encode())])
        if span and not catalog.home_holds(m.consumer_id, m.session_id, home or 0,
                                           secret_hash):
            # A part joins its session only once the home shard holds it (the consumer
            # subscribes there first): waited for one catalog load, then refused.
            if control.stale(came):
                return False
            return refuse(SubscribeStatus.INVALID_REQUEST, (
                f"no session {m.session_id} of consumer {m.consumer_id!r} on its home "
                f"shard {home}: subscribe there first (docs/protocol.md §14)"),
                "no_home_session")
    # Delivery topics are named by qlayer (protocol 7), never by the client: a client-named
    # topic let a Subscribe make the coordinator write to a journal, to another consumer's
    # delivery topic or to its own internal topics.
    try:
        expected = control.core.topics.delivery(m.consumer_id)
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
    # Protocol 9: the Kafka transactional.id the session settles with; a Replace keeps it.
    tx_id = (existing.transactional_id if existing is not None
             and kind is RequestKind.REPLACE else None)
    if kind is RequestKind.SUBSCRIBE:
        try:
            tx_id = transactional_id(headers)
        except ValueError as exc:
            return refuse(SubscribeStatus.INVALID_REQUEST, str(exc), "bad_transactional_id")
        if tx_id is not None and not tx_id.endswith("." + m.session_id):
            return refuse(SubscribeStatus.INVALID_REQUEST, (
                f"{TRANSACTIONAL_ID} {tx_id!r} must end with '.{m.session_id}', the session "
                "id: a session may have only its own producer fenced (docs/protocol.md §15)"),
                "bad_transactional_id")
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
                       home=home, transactional_id=tx_id)
    try:
        # A regex covers the queues the principal may consume, only (AMPS entitlements
        # filter a regex subscription the same way).
        names = [n for n in control.core.engines if session.matches(n)
                 and entitlements.may_consume(principal, n)]
        shards = {s for n, q in catalog.queues.items()
                  if session.matches(n) and entitlements.may_consume(principal, n)
                  for s in catalog.shards_of(q)}
    except re.error as exc:
        return refuse(SubscribeStatus.INVALID_REQUEST, f"invalid queue regex: {exc}")
    if home is None and (len(shards) > 1 or (shards and control.core.shard not in shards)):
        # One backlog across the matched queues (AMPS) is credit the consumer moves
        # between their shards (protocol 8); a consumer of an earlier protocol has none.
        # So is a replace of this shard's session onto another shard's queue: the session
        # stays here (its leases too) and gets a part there.
        where = (f"the queues {m.queue!r} matches are on shards {sorted(shards)}"
                 if len(shards) > 1 else f"{m.queue!r} is on shard {min(shards)}, the "
                 f"session on shard {control.core.shard}")
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
        if control.stale(came):
            return False
        return refuse(SubscribeStatus.UNKNOWN_QUEUE,
                      f"no queue {'matches' if m.queue_is_regex else 'named'} {m.queue!r}"
                      + (" that this consumer may consume" if m.queue_is_regex
                         and entitlements.grants else ""))
    try:
        # A Replace of a live session (every credit move of a session over several shards
        # is one) keeps a delivery topic this shard made sure of: asking the broker again
        # was a metadata request of every topic per move (a tenth of the coordinator's time
        # with a queue of four parts).
        if not (replacing and m.delivery_topic in control.core.known_topics):
            control.core.admin.ensure_topics([TopicSpec(m.delivery_topic, 1)])
            control.core.known_topics.add(m.delivery_topic)
    except KafkaAdapterError as exc:
        # Refused rather than retried: a topic the broker will not create would otherwise
        # fail this record's iteration forever. The consumer may subscribe again.
        return refuse(SubscribeStatus.INVALID_REQUEST, f"cannot use delivery_topic: {exc}")
    if replacing and existing is not None:
        for name in leaving:
            control.core.engines[name].retire(m.consumer_id, now, session.share)
        # Queues it already drained from, still holding leases, and not subscribed again.
        session.draining = [n for n in existing.draining + leaving
                            if n not in names and n in control.core.engines]
    else:
        for name in old:
            if name not in names:
                control.core.engines[name].unsubscribe(m.consumer_id, now)
        if existing is not None:
            for name in existing.draining:
                if name in control.core.engines:
                    control.core.engines[name].unsubscribe(m.consumer_id, now)
    grants = []
    for name in names:
        engine = control.core.engines[name]
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
            control.core.mark_transactional(engine, session)
        definition = engine.definition
        grants.append(QueueGrant(
            queue=name, max_backlog=event.max_backlog,
            lease_period_ms=int(definition.lease_period * 1000),
            semantics=(GrantSemantics.AT_MOST_ONCE
                       if definition.semantics is Semantics.AT_MOST_ONCE
                       else GrantSemantics.AT_LEAST_ONCE)))
    session.queues = names
    control.core.sessions[m.consumer_id] = session
    batch.put_consumer(ConsumerRow(
        consumer_id=m.consumer_id, session_id=m.session_id, queue=m.queue,
        is_regex=m.queue_is_regex, delivery_topic=m.delivery_topic,
        session_timeout_ms=int(timeout * 1000), subscribed_at=session.subscribed_at,
        last_heartbeat_at=now, max_backlog=m.max_backlog, filter=m.filter or None,
        delivery_format=formats, secret_hash=secret_hash, shard=control.core.shard,
        principal=principal, credential_hash=credential_hash, credit_home=home,
        transactional_id=tx_id))
    control.core.counters["subscribes" if kind is RequestKind.SUBSCRIBE else "replaces"] += 1
    answer_headers = None
    if home is not None:
        control.credit.credited.add(m.consumer_id)
        report = control.credit.report(session)
        session.reported = report
        # And where the subscription's queues are, for the consumer to add parts there.
        answer_headers = [*control.reply_headers, credit_report_header(*report),
                          shards_header(list(shards))]
    ok = control.reply(m.delivery_topic, SubscribeResult(
        consumer_id=m.consumer_id, session_id=m.session_id, request_id=m.request_id,
        request=kind, status=SubscribeStatus.OK, message=None, queues=tuple(grants),
        session_timeout_ms=int(timeout * 1000),
        heartbeat_interval_ms=max(int(timeout * 1000 / 3), 100),
        coordinator_id=control.core.owner_id, sent_at_ms=ms(now)), m.consumer_id,
        answer_headers)
    replies.append(ok)
    control.accepted[m.consumer_id] = (m, ok)
    return True
