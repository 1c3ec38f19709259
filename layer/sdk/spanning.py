"""A session over queues of several shards (protocol 8): subscribing, replacing and following
the directory, for `QueueConsumer` (its state is the consumer's; the credit is `Spans`).

Functions over the consumer rather than methods of it: they are the consumer's spanning half,
kept apart so that `layer/sdk/consumer.py` stays the single-shard path it was.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from layer import __version__
from layer.domain.errors import QlayerError
from layer.domain.likepattern import name_matcher
from layer.protocol.headers import FENCING, new_session_secret, proof_headers, secret_headers
from layer.protocol.records import (
    QueueGrant,
    Replace,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    Unsubscribe,
)
from layer.sdk.credit import CreditLedger
from layer.sdk.directory import QueueDirectory
from layer.sdk.errors import NoCoordinatorError
from layer.sdk.spans import Spans

if TYPE_CHECKING:
    from layer.sdk.consumer import QueueConsumer

__all__ = ["DIRECTORY_INTERVAL", "follow_directory", "follow_parts", "move_credit",
           "replace_onto_shards",
           "replace_spanning", "subscribe_spanning"]

log = logging.getLogger("layer.sdk.consumer")

#: seconds; the longest a wait for an answer polls at once (as the consumer's own waits)
_MAX_POLL_WAIT = 0.5
#: seconds; how often a regex subscription looks for its queues on shards it has no part on
DIRECTORY_INTERVAL = 2.0


#: Between two Subscribes while the previous transactional session is fenced (protocol 9).
FENCING_PAUSE = 0.2

def _now_ms() -> int:
    return int(time.time() * 1000)


def subscribe_spanning(c: QueueConsumer, shards: list[int],
                       fencing_until: float | None = None) -> None:
    """Subscribe a regex whose queues are on several shards (protocol 8): a part on the
    home shard (the lowest), then one on each other shard, one session, one backlog held
    as credit (`layer.sdk.credit`). A part refused while the previous transactional session
    is fenced there (protocol 9) makes the whole asked again until ``fencing_until``."""
    if fencing_until is None:
        fencing_until = time.monotonic() + c._subscribe_timeout
    session_id = str(uuid.uuid4())
    secret = new_session_secret()
    previous = c._secret or (c._secrets.load() if c._secrets is not None
                                else None)
    with c._cond:
        c._session_id = session_id
        c._set_secret(secret)
        c._active = False
    c._results.clear()
    spans = c._spans = Spans(shards[0], CreditLedger(whole_backlog(c)))
    learn_parts(c)
    grants = spans.ledger.initial(shards)
    headers = (c._format_header + secret_headers(secret) + c._credential_header
               + c._new_transactional_producer(session_id) + [spans.header])
    if previous is not None:
        headers += proof_headers(previous)
    refusal: SubscribeResult | None = None
    grants_by_queue: dict[str, QueueGrant] = {}
    deadline = time.monotonic() + c._subscribe_timeout
    # The home part first: the other shards accept a part only of a session it holds.
    for group in ([shards[0]], shards[1:]):
        waiting: dict[str, int] = {}
        for shard in group:
            request_id = uuid.uuid4().hex
            spans.sent(shard, request_id, grants[shard])
            waiting[request_id] = shard
            c._producer.send(c._topics.control, c._key, c._codec.encode_control(
                Subscribe(
                    consumer_id=c._consumer_id, session_id=session_id,
                    request_id=request_id, queue=c._queue, queue_is_regex=c._regex,
                    max_backlog=grants[shard], filter=c._filter,
                    delivery_topic=c._delivery_topic,
                    session_timeout_ms=round(c._session_timeout * 1000),
                    client_name=c._client_name, client_version=__version__,
                    sent_at_ms=_now_ms())), shard, headers)
        while any(r not in c._results for r in waiting):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                end_parts(c, session_id, "no answer to Subscribe")
                silent = sorted(s for r, s in waiting.items() if r not in c._results)
                raise NoCoordinatorError(
                    f"no coordinator answered the Subscribe to queue {c._queue!r} on "
                    f"shard(s) {silent} within {c._subscribe_timeout:g}s (control topic "
                    f"{c._topics.control} at {c._config.bootstrap_servers}). Is "
                    "`qlayer coordinator run` running for every shard?")
            c._ingest(c._reader.poll(min(remaining, _MAX_POLL_WAIT)))
        for request_id, shard in waiting.items():
            result = c._results.pop(request_id)
            if result.status is SubscribeStatus.OK:
                grants_by_queue.update({g.queue: g for g in result.queues})
            elif result.status is SubscribeStatus.UNKNOWN_QUEUE and shard != spans.home:
                spans.drop(shard)  # the directory was behind: no such queue there now
            else:
                refusal = refusal or result
        if refusal is not None:
            end_parts(c, session_id, "subscription refused")
            with c._cond:
                c._set_secret(previous)
            if (c._refused_why.get(refusal.request_id) == FENCING
                    and time.monotonic() < fencing_until):
                # A part of the previous transactional session is being fenced (protocol
                # 9): the whole subscription is asked again in a moment.
                del c._refused_why[refusal.request_id]
                time.sleep(FENCING_PAUSE)
                subscribe_spanning(c, shards, fencing_until)
                return
            raise c._refusal(refusal, c._queue, c._filter)
    if c._secrets is not None:
        c._secrets.save(secret)
    c._request_id = ""
    c._grants = grants_by_queue
    c._seen.remember_for(c._max_backlog * max(len(spans.shards), 1))
    interval = c._effective_session_timeout / 3
    with c._cond:
        c._heartbeat_interval = interval
        c._next_heartbeat = time.monotonic() + interval
        c._active = True
        c._cond.notify_all()
    move_credit(c)


def _directory(c: QueueConsumer) -> QueueDirectory:
    if c._directory is None:
        c._directory = QueueDirectory(config=c._config, refresh_interval=DIRECTORY_INTERVAL,
                                      timeout=c._subscribe_timeout)
    return c._directory


def whole_backlog(c: QueueConsumer) -> int:
    """The session's one backlog: its ``max_backlog``, and for a queue of several parts no
    more than the queue's ``max_per_subscription_backlog``: each part's shard holds the
    consumer to that limit in its part alone, the SDK over the whole queue."""
    if c._regex:
        return c._max_backlog
    try:
        definition = _directory(c).get(c._queue)
    except QlayerError as exc:
        log.debug("consumer %s: the queue directory: %s", c._consumer_id, exc)
        return c._max_backlog
    if definition is None or definition.parts == 1:
        return c._max_backlog
    return min(c._max_backlog, definition.max_per_subscription_backlog)


def learn_parts(c: QueueConsumer) -> None:
    """Where the parts of the subscription's queues of several parts are (the directory
    says: docs/coordinator.md, "Partitioned queues"), so that each message's acks go to its
    part's shard at once. A queue the directory does not show yet is settled through the
    shard that granted it, which passes its acks on."""
    spans = c._spans
    if spans is None:
        return
    try:
        directory = _directory(c)
        if c._regex:
            matches = name_matcher(c._queue)
            names = [n for n in directory.placements() if matches(n)]
        else:
            names = [c._queue]
        found = {name: directory.part_shards(name) for name in names}
    except QlayerError as exc:
        log.debug("consumer %s: the queue directory: %s", c._consumer_id, exc)
        return
    spans.parts = {name: shards for name, shards in found.items() if len(shards) > 1}


def follow_parts(c: QueueConsumer) -> None:
    """For a session over the parts of one queue: learn where its parts are once the
    directory shows them (a queue applied a moment ago may not be there yet when the
    consumer subscribes; until then each ack goes through the shard that granted the
    queue, which passes it on, at a cost to both)."""
    spans = c._spans
    now = time.monotonic()
    if spans is None or c._queue in spans.parts or now < c._next_directory_check:
        return
    c._next_directory_check = now + DIRECTORY_INTERVAL
    learn_parts(c)


def end_parts(c: QueueConsumer, session_id: str, reason: str) -> None:
    """Unsubscribe the session on every shard it was sent to (an answer that never came
    must not leave a part, and its leases, behind)."""
    spans = c._spans
    if spans is None:
        return
    value = _unsubscribe(c, session_id, reason)
    for shard in spans.shards:
        c._producer.send(c._topics.control, c._key, value, shard,
                            list(c._proof or []) or None)


def follow_directory(c: QueueConsumer) -> None:
    """Join the queues the regex matches on shards the session has no part on (AMPS: a
    regex subscription covers queues created after it): a session of one shard first
    becomes the home of a spanning one, then each new shard gets a part with no credit,
    which it is granted once it reports entries waiting."""
    now = time.monotonic()
    if now < c._next_directory_check or not c._active or c._closed:
        return
    c._next_directory_check = now + DIRECTORY_INTERVAL
    try:
        placed = _directory(c).placements()
    except QlayerError as exc:
        log.debug("consumer %s: the queue directory: %s", c._consumer_id, exc)
        return
    matches = name_matcher(c._queue)
    try:
        shards = {s for name, shard in placed.items() if shard is not None and matches(name)
                  for s in _directory(c).part_shards(name) or (shard,)}
    except QlayerError as exc:
        log.debug("consumer %s: the queue directory: %s", c._consumer_id, exc)
        return
    spans = c._spans
    if spans is None:
        here = c._shard
        if here is None or not shards - {here}:
            return
        become_spanning(c, here)
        return
    learn_parts(c)
    if not spans.ready_to_join():
        return
    for shard in sorted(shards - set(spans.shards)):
        join(c, shard)
    # Queues the directory shows on another shard than the one that granted them moved
    # (`qlayer queue move`), their leases along: acks go to the new shard from now on, and a
    # part whose every queue moved away, on a shard no queue it matches is on, is left. Only
    # a move the directory shows: a queue it does not list yet may be a new one.
    vacated: set[int] = set()
    for queue, granted in list(spans.queue_shard.items()):
        if queue in spans.parts:
            continue  # its parts' shards are all joined above; acks follow `spans.parts`
        now_on = placed.get(queue)
        if now_on is not None and now_on != granted:
            spans.queue_shard[queue] = now_on
            vacated.add(granted)
    for shard in sorted(vacated - shards - {spans.home}):
        if shard in spans.ledger.shards and shard not in spans.queue_shard.values():
            leave(c, shard)


def leave(c: QueueConsumer, shard: int) -> None:
    """Leave the part on a shard where no queue the subscription matches lives any more
    (its queues moved to other shards, taking their leases along): its credit is free
    again for the shards that have the work. The shard is told (an Unsubscribe); one that
    already dropped the part (it rebuilt without the queues) counts it, changes nothing."""
    spans, session_id = c._spans, c._session_id
    assert spans is not None
    if session_id is None:
        return
    log.info("consumer %s: no queue %r matches is on shard %d any more; leaving it",
             c._consumer_id, c._queue, shard)
    spans.drop(shard)
    c._producer.send(c._topics.control, c._key,
                     _unsubscribe(c, session_id, "no matching queue here"), shard,
                     [*(c._proof or []), spans.header])


def _unsubscribe(c: QueueConsumer, session_id: str, reason: str) -> bytes:
    """An Unsubscribe of the session's part on one shard, encoded."""
    return c._codec.encode_control(Unsubscribe(
        consumer_id=c._consumer_id, session_id=session_id, reason=reason,
        sent_at_ms=_now_ms()))


def become_spanning(c: QueueConsumer, here: int) -> None:
    """Make this session of one shard the home of a spanning one: a Replace with
    ``qlayer.credit`` naming its shard, its whole backlog granted there."""
    spans = c._spans = Spans(here, CreditLedger(c._max_backlog))
    spans.queue_shard = dict.fromkeys(c._grants, here)
    log.info("consumer %s: %r now matches queues of other shards; its session on shard "
             "%d holds the backlog as credit from now on", c._consumer_id, c._queue,
             here)
    spans.unawaited.add(send_part(c, Replace, here, c._max_backlog, c._queue,
                                        c._regex, c._filter))


def join(c: QueueConsumer, shard: int) -> None:
    """A part of this session on ``shard``, with no credit yet."""
    spans = c._spans
    assert spans is not None
    if c._secret is None:
        return  # an unproven session cannot prove it is this one to another shard
    log.info("consumer %s: %r matches queues on shard %d; joining it", c._consumer_id,
             c._queue, shard)
    spans.unawaited.add(send_part(c, Subscribe, shard, 0, c._queue, c._regex,
                                        c._filter))


def move_credit(c: QueueConsumer) -> None:
    """Send the grants the ledger plans (Replace records of the session's parts)."""
    spans = c._spans
    if spans is None or c._session_id is None or not c._active:
        return
    for shard, grant in spans.ledger.plan().items():
        send_part(c, Replace, shard, grant, c._queue, c._regex, c._filter)
        with c._cond:
            c._stats.credit_moves += 1


def replace_spanning(c: QueueConsumer, new_queue: str, new_regex: bool, new_filter: str | None,
                      new_backlog: int, wait: float) -> None:
    """Replace every part of a spanning session (protocol 8); the shards of the new
    queues it has no part on get one. A part left with no queue drains: its leases stay
    valid until settled, and their credit comes back as they settle (AMPS). A smaller
    backlog lowers the grants at once; the leases held keep counting until they settle."""
    spans = c._spans
    session_id = c._session_id
    assert spans is not None and session_id is not None
    spans.ledger.backlog = new_backlog
    share, extra = divmod(new_backlog, max(len(spans.shards), 1))
    sent: list[str] = []
    for i, shard in enumerate(spans.shards):
        grant = min(spans.ledger.shards[shard].grant, share + (1 if i < extra else 0))
        sent.append(send_part(c, Replace, shard, grant, new_queue, new_regex,
                                    new_filter))
    answers = answers_to(c, sent, wait, new_queue)
    refusal = next((r for r in answers if r.status is not SubscribeStatus.OK), None)
    if refusal is not None:
        raise c._refusal(refusal, new_queue, new_filter)
    join_after_replace(c, answers, sent, new_queue, new_regex, new_filter, wait)
    c._queue, c._regex = new_queue, new_regex
    c._filter, c._max_backlog = new_filter, new_backlog
    c._seen.remember_for(new_backlog * max(len(spans.shards), 1))
    learn_parts(c)
    spans.ledger.backlog = whole_backlog(c)
    move_credit(c)


def replace_onto_shards(c: QueueConsumer, new_queue: str, new_regex: bool, new_filter: str | None,
                         new_backlog: int, wait: float) -> None:
    """A replace of a session of one shard onto queues of other shards (refused with
    ``spans_shards``): the session becomes the home of a spanning one, with the new
    queues (none of them, maybe: it then drains the leases it holds), and each shard of
    the new queues gets a part (AMPS: a replace keeps the leases held)."""
    here = c._shard
    assert here is not None
    spans = c._spans = Spans(here, CreditLedger(new_backlog))
    spans.queue_shard = dict.fromkeys(c._grants, here)  # held leases settle there
    spans.ledger.add(here)
    sent = [send_part(c, Replace, here, new_backlog, new_queue, new_regex, new_filter)]
    answers = answers_to(c, sent, wait, new_queue)
    if answers[0].status is not SubscribeStatus.OK:
        c._spans = None
        raise c._refusal(answers[0], new_queue, new_filter)
    c._grants = {g.queue: g for g in answers[0].queues}
    join_after_replace(c, answers, sent, new_queue, new_regex, new_filter, wait)
    c._queue, c._regex = new_queue, new_regex
    c._filter, c._max_backlog = new_filter, new_backlog
    c._seen.remember_for(new_backlog * max(len(spans.shards), 1))
    learn_parts(c)
    spans.ledger.backlog = whole_backlog(c)
    move_credit(c)


def join_after_replace(c: QueueConsumer, answers: list[SubscribeResult], sent: list[str],
                        queue: str, regex: bool, filter: str | None, wait: float) -> None:
    """Parts on the shards the answers name that the session has none on (no credit yet:
    it comes as they report entries waiting)."""
    spans = c._spans
    assert spans is not None
    wanted: set[int] = set()
    for request_id in sent:
        wanted.update(c._answer_shards.pop(request_id, []))
    joins = [send_part(c, Subscribe, shard, 0, queue, regex, filter)
             for shard in sorted(wanted - set(spans.shards))]
    for answer in answers_to(c, joins, wait, queue):
        if answer.status is not SubscribeStatus.OK:
            raise c._refusal(answer, queue, filter)
        c._grants.update({g.queue: g for g in answer.queues})


def send_part(c: QueueConsumer, kind: type[Subscribe] | type[Replace], shard: int, grant: int,
               queue: str, regex: bool, filter: str | None) -> str:
    """A Subscribe (a new part) or Replace of the session's part on ``shard``, carrying
    ``grant``; returns its request id."""
    spans, session_id, secret = c._spans, c._session_id, c._secret
    assert spans is not None and session_id is not None
    spans.ledger.add(shard)
    request_id = uuid.uuid4().hex
    spans.sent(shard, request_id, grant)
    common: dict[str, Any] = dict(
        consumer_id=c._consumer_id, session_id=session_id, request_id=request_id,
        queue=queue, queue_is_regex=regex, max_backlog=grant, filter=filter,
        delivery_topic=c._delivery_topic, sent_at_ms=_now_ms())
    if kind is Subscribe:
        message: Subscribe | Replace = Subscribe(
            **common, session_timeout_ms=round(c._session_timeout * 1000),
            client_name=c._client_name, client_version=__version__)
        headers = [*c._format_header, *(secret_headers(secret) if secret else []),
                   *c._credential_header, *c.transactional_header(), spans.header]
    else:
        message = Replace(**common)
        headers = [*c._format_header, *(c._proof or []), spans.header]
    c._producer.send(c._topics.control, c._key,
                        c._codec.encode_control(message), shard, headers)
    return request_id


def answers_to(c: QueueConsumer, request_ids: list[str], wait: float, queue: str
               ) -> list[SubscribeResult]:
    """The answers to these requests, in their order; raises ``NoCoordinatorError`` when
    one does not come within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while any(r not in c._results for r in request_ids):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NoCoordinatorError(
                f"no coordinator answered consumer {c._consumer_id} about {queue!r} "
                f"within {wait:g}s on every shard it spans; the previous subscription may "
                "still be in force on some. Is `qlayer coordinator run` still running?")
        c._ingest(c._reader.poll(min(remaining, _MAX_POLL_WAIT)))
    return [c._results.pop(r) for r in request_ids]
