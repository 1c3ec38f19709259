"""Bad input end to end: clear answers and counters, never a crash, never a lost entry.

Malformed journal records, garbage on the control and ack topics, forged lease tokens, acks
for entries that do not exist or are done, and subscriptions the coordinator must refuse.
After each, the coordinator keeps serving the well-behaved consumers.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import pytest

from layer.coordinator.process import CoordinatorProcess
from layer.protocol import (
    AckItem,
    AckRecord,
    AckStatus,
    AckType,
    Codec,
    EventType,
    Heartbeat,
    SessionEnded,
    SessionEndReason,
    SubscribeStatus,
    TopicNames,
)
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    EventReader,
    collect,
    counters,
    forged,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration


def still_serving(settings: Settings, pool: Consumers, journal: str,
                  coordinator: CoordinatorProcess) -> None:
    """The coordinator is alive and delivering: a fresh message reaches one of the consumers
    that are still subscribed, and its ack is applied."""
    assert coordinator.is_owner
    marker = json.dumps({"kind": "order", "price": 1, "qty": 1, "id": "still-serving"}).encode()
    produce(settings.bootstrap_servers, journal, [marker])
    live = [c for c in pool.all if c.subscribed]
    got = collect(live, 1)
    (holder, (delivery,)) = next((cid, ds) for cid, ds in got.items() if ds)
    assert delivery.value == marker
    next(c for c in live if c.consumer_id == holder).ack([delivery])


def test_malformed_journal_records_are_queued_or_filtered_by_the_rules(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """Not-JSON makes every path NULL: `/kind IS NULL` lets it in, the priority is NULL and so
    lowest. A tombstone (null value) is a delete, which AMPS never queues ("Only publish
    messages are added to the queue"); it is counted. Nothing is dropped silently and the loop
    does not stop."""
    orders = journal("Orders")
    put_queues(settings, {"name": "Orders", "underlying_topic": orders,
                          "filter": "/kind IS NULL OR /kind != 'heartbeat'",
                          "priority": "/price * /qty"})
    good_high = json.dumps({"kind": "order", "price": 50, "qty": 2}).encode()   # 100
    good_low = json.dumps({"kind": "order", "price": 3, "qty": 1}).encode()     # 3
    heartbeat = json.dumps({"kind": "heartbeat"}).encode()                      # filtered
    no_price = json.dumps({"kind": "order", "qty": 5}).encode()                 # NULL priority
    malformed = b'{"kind": "order", "price": 9'
    not_utf8 = b'\xff\xfe{"kind": "order"}\x80'
    nan = b'{"kind": "order", "price": NaN, "qty": 1}'
    deep = b"[" * 100_000 + b"]" * 100_000
    records = [malformed, good_low, not_utf8, heartbeat, None, nan, good_high, deep, no_price,
               b""]
    produce(settings.bootstrap_servers, orders, records, partition=0)
    # A malformed deliver-at header is counted and ignored: available at once.
    produce(settings.bootstrap_servers, orders, [good_low],
            headers=[("qlayer.deliver-at", b"tomorrow")], partition=0)
    # Everything but the heartbeat and the tombstone, plus the late one.
    queued = len(records) - 2 + 1
    with running_coordinator(settings) as coordinator, Consumers(settings) as pool:
        wait_until(lambda: counters(settings, "Orders").get("enqueued") == queued,
                   what="every record but the heartbeat and the tombstone enqueued")
        trader = pool.subscribe("Orders")  # backlog 1: priority order is observable
        got = []
        for _ in range(queued):
            (delivery,) = trader.receive(1)
            got.append(delivery.value)
            trader.ack([delivery])
        assert trader.idle(0.3) == []
        assert got[:3] == [good_high, good_low, good_low], "numbers first, highest first"
        # NULL priorities are lowest and keep their journal order.
        assert got[3:] == [malformed, not_utf8, nan, deep, no_price, b""]
        assert heartbeat not in got and None not in got
        assert coordinator.counters["deletes_passed_over"] == 1
        totals = counters(settings, "Orders")
        assert totals["enqueued"] == queued and totals["acked"] == queued
        still_serving(settings, pool, orders, coordinator)


def test_garbage_on_the_control_and_ack_topics_is_counted_and_skipped(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    topics = TopicNames(settings.topic_prefix)
    codec = Codec()
    with running_coordinator(settings) as coordinator, Consumers(settings) as pool:
        vandal = pool.subscribe("Work")
        heartbeat = codec.encode_control(Heartbeat(consumer_id=vandal.consumer_id,
                                                   session_id=vandal.session_id, sent_at_ms=0))
        for junk in (b"garbage", b"", None, b"\xc3\x01" + b"\x00" * 8 + b"body",
                     heartbeat[:-1], heartbeat + b"\x00"):
            vandal.send_raw(topics.control, junk)
        for junk in (b"{\"ack\": true}", None, heartbeat):  # a control record on the ack topic
            vandal.send_raw(topics.ack, junk)
        # Well-formed records from a consumer id no topic can be named after: the answer to
        # the heartbeat (no such session) has nowhere to go; the ack record names no live
        # session, so it is not acted on (protocol 5) and not answered.
        nameless = "no such consumer!"
        vandal.send_raw(topics.control, codec.encode_control(Heartbeat(
            consumer_id=nameless, session_id="s", sent_at_ms=0)))
        vandal.send_raw(topics.ack, codec.encode_ack(AckRecord(
            consumer_id=nameless, session_id="s", sent_at_ms=0, items=(AckItem(
                queue="Work", bookmark=f"{work}/0/0", lease="x", type=AckType.ACCEPT),))))

        wait_until(lambda: coordinator.counters["malformed_control_records"] >= 6
                   and coordinator.counters["malformed_ack_records"] >= 3,
                   what="malformed records counted")
        assert coordinator.counters["malformed_control_records"] == 6
        assert coordinator.counters["malformed_ack_records"] == 3
        wait_until(lambda: coordinator.counters["unanswerable_replies"] >= 1
                   and coordinator.counters["identity_refused_ack_unknown_session"] >= 1,
                   what="the records of the nameless consumer counted")
        # The vandal's own session is unharmed, and so is everyone else's.
        produce(settings.bootstrap_servers, work, [b"after the garbage"])
        (delivery,) = vandal.receive(1)
        assert delivery.value == b"after the garbage"
        vandal.ack([delivery])
        still_serving(settings, pool, work, coordinator)


def test_forged_unknown_and_duplicate_acks_are_answered_and_change_nothing(
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "30s"})
    events = EventReader(settings)
    with running_coordinator(settings) as coordinator, Consumers(settings) as pool:
        holder = pool.subscribe("Work")
        produce(settings.bootstrap_servers, work, [b"the job"], partition=1)
        (delivery,) = holder.receive(1)
        thief = pool.subscribe("Work")

        # Strict leasing: only the holder's token settles the entry.
        thief.ack([forged(delivery, "0" * 32)])
        thief.ack([forged(delivery, "0" * 32)], AckType.REJECT, reason="mine now")
        thief.ack([forged(delivery, "0" * 32)], AckType.RELEASE)
        holder.ack([forged(delivery, delivery.lease[::-1])], AckType.RENEW)
        stolen = thief.wait_for_ack_results(3)
        assert [(r.status, r.bookmark) for r in stolen] == [
            (AckStatus.WRONG_TOKEN, delivery.bookmark)] * 3
        assert [r.type for r in stolen] == [AckType.ACCEPT, AckType.REJECT, AckType.RELEASE]
        (typo,) = holder.wait_for_ack_results(1)
        assert (typo.status, typo.type) == (AckStatus.WRONG_TOKEN, AckType.RENEW)

        # Entries that do not exist, and one that is not even a bookmark.
        holder.send_items([
            AckItem(queue="Work", bookmark=f"{work}/1/999999", lease="x", type=AckType.ACCEPT),
            AckItem(queue="Work", bookmark="no-such-topic/0/0", lease="x", type=AckType.ACCEPT),
            AckItem(queue="NoSuchQueue", bookmark=delivery.bookmark, lease=delivery.lease,
                    type=AckType.ACCEPT),
            AckItem(queue="Work", bookmark="not a bookmark", lease="x", type=AckType.ACCEPT),
            AckItem(queue="Work", bookmark=delivery.bookmark, lease=delivery.lease,
                    type=AckType.RELEASE, delay_ms=-5),
        ])
        answers = holder.wait_for_ack_results(1 + 5)[1:]
        assert [a.status for a in answers] == [
            AckStatus.UNKNOWN_ENTRY, AckStatus.UNKNOWN_ENTRY, AckStatus.UNKNOWN_ENTRY,
            AckStatus.INVALID, AckStatus.INVALID]
        assert "NoSuchQueue" in (answers[2].message or "")
        assert all(a.message for a in answers), "every refusal says why"

        # Through all that the entry stayed leased to its holder: never redelivered, and
        # the holder's real ack is applied (silently); a second one is a duplicate.
        assert holder.idle(0.3) == [] and thief.idle(0.1) == []
        holder.ack([delivery])
        holder.ack([delivery])
        (duplicate,) = holder.wait_for_ack_results(1 + 5 + 1)[6:]
        assert (duplicate.status, duplicate.bookmark) == (AckStatus.DUPLICATE, delivery.bookmark)
        totals = wait_for_counters(settings, "Work", acked=1)
        assert (totals["delivered"], totals["acked"], totals["dead_lettered"],
                totals["released"]) == (1, 1, 0, 0)
        assert coordinator.counters["ack_wrong_token"] == 4
        assert coordinator.counters["ack_unknown_entry"] == 3
        assert coordinator.counters["ack_invalid"] == 2
        assert coordinator.counters["ack_duplicate"] == 1
        still_serving(settings, pool, work, coordinator)

        # The audit trail has each refusal too (docs/protocol.md §11: ACK_REFUSED).
        refusals = [e for e in events.read_until(
            lambda es: sum(e.type is EventType.ACK_REFUSED for e in es) >= 10)
            if e.type is EventType.ACK_REFUSED]
        assert Counter((e.consumer_id, e.reason) for e in refusals) == {
            (thief.consumer_id, "WRONG_TOKEN"): 3, (holder.consumer_id, "WRONG_TOKEN"): 1,
            (holder.consumer_id, "UNKNOWN_ENTRY"): 3, (holder.consumer_id, "INVALID"): 2,
            (holder.consumer_id, "DUPLICATE"): 1}
        assert {str(e.bookmark) for e in refusals if e.reason == "WRONG_TOKEN"} == {
            delivery.bookmark}
    events.close()


@pytest.mark.parametrize(("options", "status", "says"), [
    ({"queue": "NoSuchQueue"}, SubscribeStatus.UNKNOWN_QUEUE, "NoSuchQueue"),
    ({"filter": "/price > > 3"}, SubscribeStatus.INVALID_FILTER, "column"),
    ({"max_backlog": -1}, SubscribeStatus.INVALID_REQUEST, "max_backlog"),
    ({"delivery_topic": "not a topic name!"}, SubscribeStatus.INVALID_REQUEST, "topic"),
    ({"queue": "Wo(rk", "is_regex": True}, SubscribeStatus.INVALID_REQUEST, "regex"),
    # Queue regexes run on RE2 (linear time): what only a backtracking engine can run is
    # refused, and a pattern that backtracks exponentially in `re` is answered at once.
    ({"queue": "(W)o\\1", "is_regex": True}, SubscribeStatus.INVALID_REQUEST, "backreferences"),
    ({"queue": "(W|Wo|o|r|k)*(a+)+$", "is_regex": True}, SubscribeStatus.UNKNOWN_QUEUE,
     "(a+)+"),
])
def test_a_refused_subscribe_is_answered_and_harms_no_one(
    options: dict[str, object], status: SubscribeStatus, says: str,
    settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Work")
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    events = EventReader(settings)
    with running_coordinator(settings) as coordinator, Consumers(settings) as pool:
        bystander = pool.subscribe("Work", max_backlog=10)
        refused = pool.new(str(options.get("queue", "Work")),
                           max_backlog=options.get("max_backlog"), filter=options.get("filter"),
                           queue_is_regex=bool(options.get("is_regex", False)))
        # A reply cannot go to a topic that cannot exist: it comes on the consumer id's
        # conventional delivery topic, which the consumer reads.
        result = refused.subscribe(timeout=15,
                                   delivery_topic=options.get("delivery_topic"))  # type: ignore[arg-type]
        assert result.status is status
        assert says in (result.message or ""), result.message
        assert result.queues == ()
        assert coordinator.counters[f"subscribe_{status.value.lower()}"] == 1

        # Nothing is delivered to the refused session...
        produce(settings.bootstrap_servers, work, [b"w1", b"w2"])
        got = bystander.receive(2)
        assert sorted(d.value for d in got) == [b"w1", b"w2"]
        assert refused.idle(0.3) == []
        bystander.ack(got)
        # ...and a heartbeat from it is answered: no such session.
        refused.heartbeat()

        def session_ended() -> list[SessionEnded]:
            refused.poll(0.1)
            return [r for r in refused.replies if isinstance(r, SessionEnded)]

        ended = wait_until(session_ended, what="SessionEnded")
        assert ended[0].reason is SessionEndReason.UNKNOWN_SESSION
        still_serving(settings, pool, work, coordinator)

        found = events.read_until(
            lambda es: any(e.type is EventType.SUBSCRIBE_REFUSED for e in es))
        (event,) = [e for e in found if e.type is EventType.SUBSCRIBE_REFUSED]
        assert (event.consumer_id, event.session_id, event.reason) == (
            refused.consumer_id, refused.session_id, status.value)
    events.close()
