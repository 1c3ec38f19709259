"""QueueConsumer against a coordinator peer over real Kafka (see peer.py).

Each test looks at the consumer from both sides: what the user's code gets, and what a
coordinator reads on the control and ack topics.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import re
import signal
import statistics
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from confluent_kafka import Producer

from layer.domain.errors import QlayerError
from layer.domain.errors import UnknownQueueError as DomainUnknownQueueError
from layer.kafka import JournalReader, JournalRecord
from layer.protocol import (
    AckItemResult,
    AckStatus,
    AckType,
    Bookmark,
    Heartbeat,
    Replace,
    SessionEndReason,
    Subscribe,
    SubscribeStatus,
    Unsubscribe,
)
from layer.sdk import (
    ConsumerClosedError,
    InvalidFilterError,
    InvalidSubscriptionError,
    LeaseLostError,
    Message,
    NoCoordinatorError,
    QueueConsumer,
    SessionEndedError,
    UnknownQueueError,
)
from tests.integration.sdk.conftest import Connect
from tests.integration.sdk.peer import CoordinatorPeer

pytestmark = pytest.mark.integration


def receive_all(consumer: QueueConsumer, count: int, timeout: float = 30.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"received {len(got)} of {count} messages"
        message = consumer.receive(timeout=1.0)
        if message is not None:
            got.append(message)
    return got


# --- subscribing ------------------------------------------------------------------------------


def test_subscribe_names_queue_backlog_filter_and_delivery_topic(
    connect: Connect, peer: CoordinatorPeer, prefix: str
) -> None:
    consumer, subscribe = connect("WorkToDo", max_backlog=10, filter="/region = 'EU'",
                                  consumer_id="worker-1")
    assert subscribe.queue == "WorkToDo" and subscribe.queue_is_regex is False
    assert subscribe.max_backlog == 10
    assert subscribe.filter == "/region = 'EU'"
    assert subscribe.delivery_topic == f"{prefix}delivery.worker-1" == consumer.delivery_topic
    assert subscribe.consumer_id == "worker-1"
    assert subscribe.session_id == consumer.session_id
    assert subscribe.session_timeout_ms == 30_000
    # Keyed by consumer id, so one consumer's control records stay in order.
    assert peer.control_keys[0] == b"worker-1"
    assert [(g.queue, g.max_backlog) for g in consumer.grants] == [("WorkToDo", 10)]


def test_max_backlog_defaults_to_one(connect: Connect) -> None:
    _, subscribe = connect("Jobs")
    assert subscribe.max_backlog == 1


def test_regex_subscription_receives_from_every_granted_queue(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, subscribe = connect(re.compile("Work.*"), max_backlog=4,
                                  reply={"queues": ["WorkToDo", "WorkLater"]})
    assert subscribe.queue == "Work.*" and subscribe.queue_is_regex is True
    assert sorted(g.queue for g in consumer.grants) == ["WorkLater", "WorkToDo"]
    peer.deliver(subscribe, b"a", queue="WorkToDo", bookmark=Bookmark("todo", 0, 1))
    peer.deliver(subscribe, b"b", queue="WorkLater", bookmark=Bookmark("later", 2, 7))
    first, second = receive_all(consumer, 2)
    assert [(m.queue, str(m.bookmark)) for m in (first, second)] == [
        ("WorkToDo", "todo/0/1"), ("WorkLater", "later/2/7")]
    first.ack()
    second.ack()
    consumer.close()
    items = peer.ack_items(2)
    assert [(i.queue, i.bookmark) for i in items] == [("WorkToDo", "todo/0/1"),
                                                      ("WorkLater", "later/2/7")]


def test_regex_flag_with_a_string(connect: Connect) -> None:
    _, subscribe = connect("^Orders-(eu|us)$", regex=True)
    assert subscribe.queue_is_regex is True and subscribe.queue == "^Orders-(eu|us)$"


def test_unknown_queue_raises_naming_the_queue(connect: Connect) -> None:
    with pytest.raises(UnknownQueueError) as caught:
        connect("Nope", reply={"status": SubscribeStatus.UNKNOWN_QUEUE,
                               "message": "no queue is named 'Nope'"})
    assert caught.value.name == "Nope"
    assert "'Nope'" in str(caught.value) and "qlayer queue apply" in str(caught.value)
    assert isinstance(caught.value, DomainUnknownQueueError)


@pytest.mark.parametrize(
    ("status", "error"),
    [(SubscribeStatus.INVALID_FILTER, InvalidFilterError),
     (SubscribeStatus.INVALID_REQUEST, InvalidSubscriptionError)],
)
def test_refused_subscription_raises_the_matching_error(
    connect: Connect, status: SubscribeStatus, error: type[QlayerError]
) -> None:
    with pytest.raises(error) as caught:
        connect("Jobs", filter="/x = 1", reply={"status": status, "message": "refused here"})
    assert "refused here" in str(caught.value)


def test_filter_that_does_not_parse_fails_before_any_kafka_call() -> None:
    started = time.monotonic()
    # Nothing listens on port 1: a consumer that tried to talk to Kafka would hang, not fail.
    with pytest.raises(InvalidFilterError) as caught:
        QueueConsumer("Jobs", "127.0.0.1:1", filter="/region = ")
    assert time.monotonic() - started < 2
    assert caught.value.column == len("/region = ")  # the end, where a value was expected
    assert "/region = " in str(caught.value)


def test_no_coordinator_raises_within_the_subscribe_timeout(
    bootstrap_servers: str, prefix: str, peer: CoordinatorPeer
) -> None:
    started = time.monotonic()
    with pytest.raises(NoCoordinatorError) as caught:
        QueueConsumer("Jobs", bootstrap_servers, topic_prefix=prefix, subscribe_timeout=1.5)
    elapsed = time.monotonic() - started
    assert 1.5 <= elapsed < 8, elapsed
    assert "qlayer coordinator run" in str(caught.value)
    assert prefix in str(caught.value)
    # The Subscribe went out; a coordinator that picks it up late is told to drop it at once.
    subscribe = peer.next_control(Subscribe)
    unsubscribe = peer.next_control(Unsubscribe)
    assert unsubscribe.session_id == subscribe.session_id


# --- receiving ---------------------------------------------------------------------------------


def test_delivered_journal_record_reaches_the_user_as_published(
    connect: Connect, peer: CoordinatorPeer, bootstrap_servers: str,
    create_topic: Callable[..., str], unique_name: Callable[[str], str],
) -> None:
    journal = create_topic(unique_name("orders"), partitions=3)
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    sent_at = int(time.time() * 1000) - 5_000
    for i in range(3):
        producer.produce(journal, key=f"k{i}".encode(),
                         value=json.dumps({"region": "EU", "n": i}).encode(),
                         headers=[("trace", f"t{i}".encode()), ("empty", None)],
                         timestamp=sent_at + i, partition=i)
    assert producer.flush(10) == 0
    # The peer reads the journal as a coordinator would and delivers the records as they are.
    reader = JournalReader({"bootstrap.servers": bootstrap_servers}, unique_name("g"))
    reader.assign({(journal, p): 0 for p in range(3)})
    records: list[JournalRecord] = []
    deadline = time.monotonic() + 30
    while len(records) < 3 and time.monotonic() < deadline:
        records += reader.poll(10, 0.5)
    reader.close()
    records.sort(key=lambda r: r.partition)

    consumer, subscribe = connect("WorkToDo", max_backlog=10, filter="/region = 'EU'")
    lease_end = int(time.time() * 1000) + 45_000
    infos = [
        peer.deliver(subscribe, r.value, key=r.key, headers=list(r.headers or []),
                     bookmark=Bookmark(journal, r.partition, r.offset),
                     timestamp_ms=r.timestamp_ms, lease_expires_ms=lease_end,
                     delivery_count=2)
        for r in records
    ]
    got = []
    for message in consumer:
        got.append(message)
        message.ack()
        if len(got) == 3:
            break

    for i, message in enumerate(got):
        assert message.key == f"k{i}".encode()
        assert message.json() == {"region": "EU", "n": i}
        # The record's own headers, as published: the qlayer.* ones are properties instead.
        assert message.headers == [("trace", f"t{i}".encode()), ("empty", None)]
        assert message.header("trace") == f"t{i}".encode()
        assert message.timestamp == datetime.fromtimestamp((sent_at + i) / 1000, tz=UTC)
        assert message.bookmark == Bookmark(journal, i, 0)
        assert (message.topic, message.partition, message.offset) == (journal, i, 0)
        assert message.queue == "WorkToDo"
        assert message.lease == infos[i].lease
        assert message.delivery_count == 2
        assert message.lease_expires_at == datetime.fromtimestamp(lease_end / 1000, tz=UTC)
    consumer.close()
    items = peer.ack_items(3)
    assert [(i.type, i.queue, i.bookmark, i.lease) for i in items] == [
        (AckType.ACCEPT, "WorkToDo", f"{journal}/{n}/0", infos[n].lease) for n in range(3)]


def test_receive_returns_none_when_nothing_comes_in_time(connect: Connect) -> None:
    consumer, _ = connect("Jobs")
    started = time.monotonic()
    assert consumer.receive(timeout=0.5) is None
    assert 0.5 <= time.monotonic() - started < 3


def test_deliveries_and_replies_of_another_session_are_ignored(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, subscribe = connect("Jobs")
    peer.deliver(subscribe, b"from an earlier run", session_id="an-earlier-session")
    # An earlier run's session ending must not end this one.
    earlier = dataclasses.replace(subscribe, session_id="an-earlier-session")
    peer.end_session(earlier, SessionEndReason.TIMED_OUT)
    peer.deliver(subscribe, b"mine")
    message = consumer.receive(timeout=20)
    assert message is not None and message.value == b"mine"
    assert consumer.receive(timeout=0.5) is None
    assert consumer.stats.ignored == 2
    assert consumer.stats.resubscriptions == 0


def test_malformed_delivery_is_counted_and_skipped(
    connect: Connect, peer: CoordinatorPeer, bootstrap_servers: str
) -> None:
    consumer, subscribe = connect("Jobs")
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    # Our session, but no bookmark or lease: it cannot be settled, so it is not handed out.
    producer.produce(subscribe.delivery_topic, value=b"x", partition=0,
                     headers=[("qlayer.session", subscribe.session_id.encode())])
    assert producer.flush(10) == 0
    peer.deliver(subscribe, b"good")
    message = consumer.receive(timeout=20)
    assert message is not None and message.value == b"good"
    assert consumer.stats.malformed == 1


# --- acknowledging -----------------------------------------------------------------------------


def test_acks_are_batched_many_items_per_record(connect: Connect, peer: CoordinatorPeer) -> None:
    consumer, subscribe = connect("WorkToDo", max_backlog=50, ack_batch_size=20,
                                  ack_interval=60.0)
    infos = [peer.deliver(subscribe, f"m{i}".encode()) for i in range(50)]
    messages = receive_all(consumer, 50)
    for message in messages:
        message.ack()
    consumer.close()
    items = peer.ack_items(50)
    # A full batch goes at once; the rest goes on close.
    assert [len(record.items) for record in peer.acks] == [20, 20, 10]
    assert {record.session_id for record in peer.acks} == {subscribe.session_id}
    assert set(peer.ack_keys) == {subscribe.consumer_id.encode()}
    assert [(i.bookmark, i.lease, i.type) for i in items] == [
        (str(info.bookmark), info.lease, AckType.ACCEPT) for info in infos]
    assert consumer.stats.ack_records_sent == 3 and consumer.stats.ack_items_sent == 50


def test_acks_waiting_longer_than_the_interval_are_sent_in_the_background(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, subscribe = connect("WorkToDo", max_backlog=5, ack_batch_size=500,
                                  ack_interval=0.3)
    for i in range(3):
        peer.deliver(subscribe, f"m{i}".encode())
    messages = receive_all(consumer, 3)
    acked_at = time.monotonic()
    for message in messages:
        message.ack()
    # The test thread does not call the consumer again: only the background thread can send.
    items = peer.ack_items(3, timeout=10)
    assert time.monotonic() - acked_at >= 0.3
    assert len(items) == 3 and len(peer.acks) == 1


def test_acks_go_out_as_soon_as_the_consumer_waits_for_more(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    # With max_backlog=1 the next message comes only after this ack: holding it for the
    # batch interval (a minute here) would stall the queue.
    consumer, subscribe = connect("Jobs", ack_interval=60.0)
    peer.deliver(subscribe, b"m0")
    message = consumer.receive(timeout=20)
    assert message is not None
    message.ack()
    waited = time.monotonic()
    assert consumer.receive(timeout=0.3) is None
    [item] = peer.ack_items(1, timeout=5)
    assert time.monotonic() - waited < 5
    assert item.bookmark == str(message.bookmark)


def test_ack_release_reject_carry_their_type_delay_and_reason(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, subscribe = connect("Jobs", max_backlog=10)
    infos = [peer.deliver(subscribe, f"m{i}".encode()) for i in range(5)]
    peer.deliver(subscribe, b"barrier", barrier=True)
    m0, m1, m2, m3, m4, barrier = receive_all(consumer, 6)
    m0.ack()
    m1.release(delay=2.5)
    m2.release()
    m3.release(delay=timedelta(minutes=1))
    m4.reject(reason="bad payload")
    assert barrier.is_barrier
    barrier.ack()  # needs no acknowledgement: nothing is sent for it
    consumer.close()
    items = peer.ack_items(5)
    assert [(i.type, i.delay_ms, i.reason) for i in items] == [
        (AckType.ACCEPT, None, None),
        (AckType.RELEASE, 2500, None),
        (AckType.RELEASE, None, None),
        (AckType.RELEASE, 60_000, None),
        (AckType.REJECT, None, "bad payload"),
    ]
    assert [i.bookmark for i in items] == [str(info.bookmark) for info in infos]
    assert len(items) == 5  # nothing for the barrier


def test_settling_twice_is_refused(connect: Connect, peer: CoordinatorPeer) -> None:
    consumer, subscribe = connect("Jobs")
    peer.deliver(subscribe, b"m")
    message = consumer.receive(timeout=20)
    assert message is not None
    message.ack()
    with pytest.raises(QlayerError, match="already settled"):
        message.reject(reason="again")
    with pytest.raises(QlayerError, match="already settled"):
        message.renew()


def test_refused_ack_goes_to_on_ack_error(connect: Connect, peer: CoordinatorPeer) -> None:
    errors: list[LeaseLostError] = []
    consumer, subscribe = connect("Jobs", on_ack_error=errors.append)
    info = peer.deliver(subscribe, b"m")
    message = consumer.receive(timeout=20)
    assert message is not None
    message.ack()
    assert consumer.receive(timeout=0.2) is None  # waiting: the ack goes out now
    [item] = peer.ack_items(1)
    peer.ack_result(subscribe, [AckItemResult(queue=item.queue, bookmark=item.bookmark,
                                              type=item.type, status=AckStatus.LEASE_LOST,
                                              message="lease expired")])
    deadline = time.monotonic() + 20
    while not errors and time.monotonic() < deadline:
        consumer.receive(timeout=0.5)
    [error] = errors
    assert error.status is AckStatus.LEASE_LOST
    assert error.failures[0].bookmark == str(info.bookmark)
    assert "lease expired" in str(error)
    assert consumer.stats.ack_failures == 1


def test_refused_ack_without_callback_raises_on_the_next_receive(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, subscribe = connect("Jobs")
    peer.deliver(subscribe, b"m")
    message = consumer.receive(timeout=20)
    assert message is not None
    message.ack()
    assert consumer.receive(timeout=0.2) is None
    [item] = peer.ack_items(1)
    peer.ack_result(subscribe, [AckItemResult(queue=item.queue, bookmark=item.bookmark,
                                              type=item.type, status=AckStatus.DUPLICATE)])
    with pytest.raises(LeaseLostError) as caught:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            consumer.receive(timeout=0.5)
    assert caught.value.status is AckStatus.DUPLICATE
    assert caught.value.failures[0].bookmark == item.bookmark
    # Reported once.
    assert consumer.receive(timeout=0.3) is None


def test_renew_returns_the_new_deadline(connect: Connect, peer: CoordinatorPeer) -> None:
    consumer, subscribe = connect("Jobs")
    info = peer.deliver(subscribe, b"m", lease_expires_ms=int(time.time() * 1000) + 5_000)
    message = consumer.receive(timeout=20)
    assert message is not None
    answered = peer.answer_renew(subscribe, extend_ms=120_000)
    deadline = message.renew()
    item, result = answered.result(timeout=30)
    assert (item.type, item.bookmark, item.lease) == (AckType.RENEW, str(info.bookmark),
                                                      info.lease)
    expected = result.items[0].lease_expires_ms
    assert expected is not None
    assert deadline == datetime.fromtimestamp(expected / 1000, tz=UTC)
    assert message.lease_expires_at == deadline
    assert deadline > datetime.now(UTC) + timedelta(seconds=100)
    message.ack()  # still held: it can be settled after a renew


def test_refused_renew_raises_lease_lost(connect: Connect, peer: CoordinatorPeer) -> None:
    consumer, subscribe = connect("Jobs")
    peer.deliver(subscribe, b"m")
    message = consumer.receive(timeout=20)
    assert message is not None
    answered = peer.answer_renew(subscribe, status=AckStatus.LEASE_LOST, message="too late")
    with pytest.raises(LeaseLostError) as caught:
        message.renew()
    answered.result(timeout=30)
    assert caught.value.status is AckStatus.LEASE_LOST
    assert "too late" in str(caught.value)


def test_unanswered_renew_raises_no_coordinator(connect: Connect, peer: CoordinatorPeer) -> None:
    consumer, subscribe = connect("Jobs")
    peer.deliver(subscribe, b"m")
    message = consumer.receive(timeout=20)
    assert message is not None
    before = message.lease_expires_at
    with pytest.raises(NoCoordinatorError, match="RENEW"):
        message.renew(timeout=1.0)
    assert message.lease_expires_at == before


# --- heartbeats --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "interval"),
    [({"heartbeat_interval_ms": 300}, 0.3),
     # No interval advertised: one third of the effective session timeout.
     ({"heartbeat_interval_ms": 0, "session_timeout_ms": 1200}, 0.4)],
)
def test_heartbeats_arrive_at_the_advertised_interval(
    connect: Connect, peer: CoordinatorPeer, reply: dict[str, int], interval: float
) -> None:
    consumer, subscribe = connect("Jobs", reply=reply)
    assert consumer.heartbeat_interval == pytest.approx(interval)
    # The test thread is busy elsewhere (a slow handler, say): heartbeats must not depend on it.
    time.sleep(interval * 8 + 0.2)
    peer.wait_for(lambda: len(peer.of_kind(Heartbeat)) >= 8 or None, "8 heartbeats")
    beats = peer.of_kind(Heartbeat)
    assert {b.session_id for b in beats} == {subscribe.session_id}
    gaps = [(b.sent_at_ms - a.sent_at_ms) / 1000 for a, b in itertools.pairwise(beats)]
    assert min(gaps) >= interval * 0.9, gaps
    assert statistics.median(gaps) <= interval * 1.5, gaps


def test_a_consumer_dropped_without_close_stops_heartbeating(
    bootstrap_servers: str, prefix: str, peer: CoordinatorPeer
) -> None:
    answered = peer.answer_subscribe(heartbeat_interval_ms=200)
    consumer = QueueConsumer("Jobs", bootstrap_servers, topic_prefix=prefix)
    subscribe = answered.result(timeout=30)
    thread = next(t for t in threading.enumerate() if t.name.endswith(subscribe.consumer_id))
    peer.wait_for(lambda: len(peer.of_kind(Heartbeat)) >= 2 or None, "heartbeats")
    del consumer
    gc.collect()
    # Its session is left to time out on the coordinator, as for a crashed process.
    thread.join(timeout=5)
    assert not thread.is_alive()


# --- replace ------------------------------------------------------------------------------------


def test_replace_sends_the_whole_new_subscription_and_keeps_leases(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, subscribe = connect("Jobs", filter="/to = 'me'")
    info = peer.deliver(subscribe, b"held")
    held = consumer.receive(timeout=20)
    assert held is not None
    answered = peer.answer_replace()
    consumer.replace(filter="/to = 'any'", max_backlog=5)
    request = answered.result(timeout=30)
    assert isinstance(request, Replace)
    assert (request.session_id, request.queue, request.filter, request.max_backlog,
            request.delivery_topic) == (subscribe.session_id, "Jobs", "/to = 'any'", 5,
                                        subscribe.delivery_topic)
    assert (consumer.filter, consumer.max_backlog) == ("/to = 'any'", 5)
    # The lease taken before the replace is still ours to settle.
    held.ack()
    consumer.close()
    [item] = peer.ack_items(1)
    assert (item.bookmark, item.lease, item.type) == (str(info.bookmark), info.lease,
                                                      AckType.ACCEPT)
    assert peer.of_kind(Subscribe) == [subscribe]  # one session throughout


def test_refused_replace_keeps_the_previous_subscription(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, _ = connect("Jobs", filter="/to = 'me'", max_backlog=3)
    answered = peer.answer_replace(status=SubscribeStatus.UNKNOWN_QUEUE)
    with pytest.raises(UnknownQueueError):
        consumer.replace(queue="Missing")
    answered.result(timeout=30)
    assert (consumer.queue, consumer.filter, consumer.max_backlog) == ("Jobs", "/to = 'me'", 3)
    answered = peer.answer_replace()
    consumer.replace(filter=None)
    assert answered.result(timeout=30).filter is None
    assert consumer.filter is None


# --- sessions and closing -----------------------------------------------------------------------


def test_close_flushes_acks_then_unsubscribes(connect: Connect, peer: CoordinatorPeer) -> None:
    consumer, subscribe = connect("Jobs", max_backlog=3, ack_interval=60.0)
    for i in range(3):
        peer.deliver(subscribe, f"m{i}".encode())
    for message in receive_all(consumer, 3):
        message.ack()
    consumer.close()
    items = peer.ack_items(3)
    unsubscribe = peer.next_control(Unsubscribe)
    assert unsubscribe.session_id == subscribe.session_id
    assert len(items) == 3
    # Acks were written before the Unsubscribe, so none of them meets a broken lease.
    assert max(record.sent_at_ms for record in peer.acks) <= unsubscribe.sent_at_ms
    with pytest.raises(ConsumerClosedError):
        consumer.receive(timeout=0)
    consumer.close()  # idempotent
    peer.poll(1.0)
    assert len(peer.of_kind(Unsubscribe)) == 1


def test_leaving_the_with_block_unsubscribes(
    bootstrap_servers: str, prefix: str, peer: CoordinatorPeer
) -> None:
    answered = peer.answer_subscribe()
    with QueueConsumer("Jobs", bootstrap_servers, topic_prefix=prefix) as consumer:
        subscribe = answered.result(timeout=30)
        peer.deliver(subscribe, b"m")
        message = consumer.receive(timeout=20)
        assert message is not None
    assert peer.next_control(Unsubscribe).session_id == subscribe.session_id
    with pytest.raises(ConsumerClosedError):
        message.ack()  # its lease was broken by the Unsubscribe


def test_close_from_another_thread_ends_the_iteration(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, subscribe = connect("Jobs")
    peer.deliver(subscribe, b"m")
    closer = threading.Timer(1.5, consumer.close)
    closer.start()
    got = [message.value for message in consumer]  # ends when closed, without an error
    closer.join()
    assert got == [b"m"]
    assert peer.next_control(Unsubscribe).session_id == subscribe.session_id


def test_close_from_a_signal_handler_ends_the_iteration(connect: Connect,
                                                       peer: CoordinatorPeer) -> None:
    consumer, subscribe = connect("Jobs")
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: consumer.close())
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        started = time.monotonic()
        assert list(consumer) == []  # interrupted mid-poll, ends without an error
        assert time.monotonic() - started < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert peer.next_control(Unsubscribe).session_id == subscribe.session_id


def test_eviction_raises_session_ended(connect: Connect, peer: CoordinatorPeer) -> None:
    consumer, subscribe = connect("Jobs")
    peer.end_session(subscribe, SessionEndReason.EVICTED, "by the operator")
    with pytest.raises(SessionEndedError) as caught:
        consumer.receive(timeout=20)
    assert caught.value.reason is SessionEndReason.EVICTED
    assert "by the operator" in str(caught.value)
    with pytest.raises(SessionEndedError):
        consumer.receive(timeout=0)
    peer.poll(1.0)
    assert peer.of_kind(Subscribe) == [subscribe]  # an eviction is not undone behind its back


def test_timed_out_session_is_resubscribed_transparently(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    errors: list[LeaseLostError] = []
    consumer, first = connect("Jobs", filter="/a = 1", max_backlog=2, on_ack_error=errors.append)
    peer.deliver(first, b"old")
    old = consumer.receive(timeout=20)
    assert old is not None
    answered = peer.answer_subscribe()
    peer.end_session(first, SessionEndReason.TIMED_OUT)
    assert consumer.receive(timeout=5) is None
    second = answered.result(timeout=30)
    assert second.session_id != first.session_id
    assert (second.queue, second.filter, second.max_backlog) == ("Jobs", "/a = 1", 2)
    assert consumer.session_id == second.session_id
    assert consumer.stats.resubscriptions == 1
    peer.deliver(second, b"new")
    new = consumer.receive(timeout=20)
    assert new is not None and new.value == b"new"
    # The old lease was broken with its session: acknowledging it is reported, not sent.
    old.ack()
    [error] = errors
    assert error.status is AckStatus.LEASE_LOST and "session" in str(error)
    new.ack()
    consumer.close()
    [item] = peer.ack_items(1)
    assert item.bookmark == str(new.bookmark)


def test_failed_resubscription_is_retried_by_the_next_receive(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, first = connect("Jobs", subscribe_timeout=1.5)
    peer.end_session(first, SessionEndReason.UNKNOWN_SESSION)
    with pytest.raises(NoCoordinatorError):  # nobody answers the resubscription
        consumer.receive(timeout=20)
    unanswered = peer.next_control(Subscribe)
    assert peer.next_control(Unsubscribe).session_id == unanswered.session_id
    answered = peer.answer_subscribe()
    assert consumer.receive(timeout=0.5) is None  # subscribes again, then waits
    second = answered.result(timeout=30)
    assert peer.of_kind(Subscribe) == [first, unanswered, second]
    assert consumer.session_id == second.session_id
    peer.deliver(second, b"again")
    message = consumer.receive(timeout=20)
    assert message is not None and message.value == b"again"


def test_timed_out_session_without_resubscribe_raises(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, subscribe = connect("Jobs", resubscribe=False)
    peer.end_session(subscribe, SessionEndReason.TIMED_OUT)
    with pytest.raises(SessionEndedError) as caught:
        consumer.receive(timeout=20)
    assert caught.value.reason is SessionEndReason.TIMED_OUT


# --- callback use -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("on_error", "settled"),
    [("release", (AckType.RELEASE, 1500, None)),
     ("reject", (AckType.REJECT, None, "ValueError: cannot handle m1")),
     ("raise", (AckType.RELEASE, 1500, None))],
)
def test_run_acks_on_return_and_settles_failures_by_policy(
    connect: Connect, peer: CoordinatorPeer, on_error: str,
    settled: tuple[AckType, int | None, str | None],
) -> None:
    consumer, subscribe = connect("Jobs", max_backlog=3)
    for i in range(3):
        peer.deliver(subscribe, f"m{i}".encode())
    seen: list[bytes | None] = []

    def handler(message: Message) -> None:
        seen.append(message.value)
        if message.value == b"m1":
            raise ValueError("cannot handle m1")

    if on_error == "raise":
        with pytest.raises(ValueError, match="cannot handle m1"):
            consumer.run(handler, on_error="raise", release_delay=1.5)
        assert consumer.run(handler, max_messages=1) == 1
    else:
        assert consumer.run(handler, on_error=on_error,  # type: ignore[arg-type]
                            release_delay=1.5, max_messages=3) == 3
    assert seen == [b"m0", b"m1", b"m2"]
    consumer.close()
    items = peer.ack_items(3)
    assert [(i.type, i.delay_ms, i.reason) for i in items] == [
        (AckType.ACCEPT, None, None), settled, (AckType.ACCEPT, None, None)]


def test_run_with_a_function_policy_and_a_stop_event(
    connect: Connect, peer: CoordinatorPeer
) -> None:
    consumer, subscribe = connect("Jobs", max_backlog=2)
    for value in (b"poison", b"fine"):
        peer.deliver(subscribe, value)
    stop = threading.Event()
    decided: list[str] = []

    def policy(message: Message, exc: Exception) -> None:
        decided.append(str(exc))
        message.reject(reason="poison message")

    def handler(message: Message) -> None:
        if message.value == b"poison":
            raise RuntimeError("poisoned")
        stop.set()

    assert consumer.run(handler, on_error=policy, stop=stop) == 2
    assert decided == ["poisoned"]
    consumer.close()
    items = peer.ack_items(2)
    assert [(i.type, i.reason) for i in items] == [(AckType.REJECT, "poison message"),
                                                   (AckType.ACCEPT, None)]


def test_run_stops_after_idle_timeout(connect: Connect) -> None:
    consumer, _ = connect("Jobs")
    started = time.monotonic()
    assert consumer.run(lambda message: None, idle_timeout=1.0) == 0
    assert 1.0 <= time.monotonic() - started < 4
