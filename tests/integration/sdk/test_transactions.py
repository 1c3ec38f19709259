"""Exactly-once processing (protocol 9, docs/sdk.md "Exactly-once processing"): a consumer
settles messages inside its own Kafka transaction, with the records it produced for them; the
coordinator fences a transactional session's producer before it breaks any of its leases.
Real broker, real PostgreSQL, the coordinator's real loop."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

import pytest

from layer.sdk import (
    InvalidSubscriptionError,
    Message,
    QueueConsumer,
    QueuePublisher,
    Transaction,
    TransactionAbortedError,
)
from layer.settings import Settings
from tests.support.coordinator import (
    TopicReader,
    counters,
    put_queues,
    running_coordinator,
    wait_until,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qx{uuid.uuid4().hex[:8]}.")


def consumer(settings: Settings, queue: str, **options: object) -> QueueConsumer:
    return QueueConsumer(queue, settings.bootstrap_servers, topic_prefix=settings.topic_prefix,
                         **options)  # type: ignore[arg-type]


def publish(settings: Settings, topic: str, count: int) -> None:
    with QueuePublisher(settings.bootstrap_servers,
                        topic_prefix=settings.topic_prefix) as publisher:
        for i in range(count):
            publisher.publish(topic, json.dumps({"n": i}).encode(), key=str(i).encode())


def outputs(reader: TopicReader) -> Counter[int]:
    """How many times each input's result is in the output topic (read_committed)."""
    return Counter(json.loads(r.value or b"{}")["n"] for r in reader.records)


def transform(tx_consumer: QueueConsumer, message: Message, out: str) -> None:
    with tx_consumer.transaction() as tx:
        tx.produce(out, json.dumps({"n": message.json()["n"], "by": tx_consumer.consumer_id})
                   .encode(), key=message.key)
        tx.ack(message)


def left_open(tx_consumer: QueueConsumer, message: Message, out: str, n: int, by: str
              ) -> Transaction:
    """A transaction that produced ``message``'s result and settled it, not committed yet (a
    worker stalled in the middle of it): the test ends it with ``__exit__``."""
    tx = tx_consumer.transaction().__enter__()
    tx.produce(out, json.dumps({"n": n, "by": by}).encode())
    tx.ack(message)
    return tx


def test_consume_transform_produce_commits_each_result_once(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Work"), partitions=2)
    out = create_topic(unique_name("Results"), partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    publish(settings, work, 200)
    reader = TopicReader(settings.bootstrap_servers, out)
    with running_coordinator(settings):
        workers = [consumer(settings, "Work", max_backlog=5, transactional=True,
                            consumer_id=f"worker-{i}") for i in range(2)]
        assert workers[0].transaction().transactional_id == (
            f"{settings.topic_prefix}qlayer-tx.worker-0.{workers[0].session_id}")
        # Operators see it (`qlayer consumers`, --json "transactional_id").
        from layer.services.consumers import ConsumerService

        with ConsumerService.from_settings(settings) as service:
            listed = {c.consumer_id: c.transactional_id for c in service.list_consumers("Work")}
        assert listed == {f"worker-{i}": f"{settings.topic_prefix}qlayer-tx.worker-{i}."
                          f"{workers[i].session_id}" for i in range(2)}

        def work_on(worker: QueueConsumer) -> None:
            while (message := worker.receive(timeout=3.0)) is not None:
                transform(worker, message, out)

        threads = [threading.Thread(target=work_on, args=(w,)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        wait_until(lambda: counters(settings, "Work").get("acked") == 200 or None,
                   timeout=30, what="200 acks applied")
        for worker in workers:
            worker.close()
    reader.read_until(lambda records: len(records) >= 200)
    reader.read(1.0)
    assert outputs(reader) == Counter(range(200))  # every input once: no gap, no duplicate
    reader.close()


def test_a_lease_that_runs_out_in_an_open_transaction_is_fenced_before_another_gets_it(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    """A worker that stalls past its lease with its transaction open (a long GC pause, a
    SIGSTOP) finds it aborted and its producer fenced; the message goes to another worker,
    whose result is the only one committed."""
    work = create_topic(unique_name("Work"), partitions=1)
    out = create_topic(unique_name("Results"), partitions=1)
    put_queues(settings, {"name": "Slow", "underlying_topic": work, "lease_period": "2s"})
    publish(settings, work, 1)
    reader = TopicReader(settings.bootstrap_servers, out)
    with running_coordinator(settings):
        stalled = consumer(settings, "Slow", transactional=True, consumer_id="stalled")
        message = stalled.receive(timeout=20)
        assert message is not None
        tx = left_open(stalled, message, out, 0, "stalled")
        other = consumer(settings, "Slow", transactional=True, consumer_id="other")
        # Past the lease: the coordinator fences the stalled worker's producer, then the
        # message goes to the other worker.
        again = other.receive(timeout=30)
        assert again is not None and again.bookmark == message.bookmark
        assert again.delivery_count == 2
        transform(other, again, out)
        with pytest.raises(TransactionAbortedError) as aborted:
            tx.__exit__(None, None, None)
        assert aborted.value.fenced
        wait_until(lambda: counters(settings, "Slow").get("acked") == 1 or None,
                   timeout=20, what="the other worker's ack applied")
        # The stalled worker's session was ended after the fence; it subscribes again.
        assert stalled.receive(timeout=1.0) is None
        assert stalled.stats.resubscriptions == 1
        stalled.close()
        other.close()
    reader.read_until(lambda records: len(records) >= 1)
    reader.read(2.0)
    assert [json.loads(r.value or b"{}")["by"] for r in reader.records] == ["other"]
    reader.close()


def test_without_transactions_the_same_stall_produces_the_result_twice(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    """The same stall at-least-once: the stalled worker's output is written, its ack comes
    too late, and the message is processed again (what the test above rules out)."""
    from confluent_kafka import Producer

    work = create_topic(unique_name("Work"), partitions=1)
    out = create_topic(unique_name("Results"), partitions=1)
    put_queues(settings, {"name": "Slow", "underlying_topic": work, "lease_period": "2s"})
    publish(settings, work, 1)
    reader = TopicReader(settings.bootstrap_servers, out)
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    with running_coordinator(settings):
        stalled = consumer(settings, "Slow", consumer_id="stalled", session_timeout=3.0)
        message = stalled.receive(timeout=20)
        assert message is not None
        producer.produce(out, json.dumps({"n": 0, "by": "stalled"}).encode())
        producer.flush(10)
        stalled._stop.set()  # stalled: its heartbeats stop too, so its session times out
        other = consumer(settings, "Slow", consumer_id="other")
        again = other.receive(timeout=30)
        assert again is not None and again.bookmark == message.bookmark
        producer.produce(out, json.dumps({"n": 0, "by": "other"}).encode())
        producer.flush(10)
        again.ack()
        message.ack()  # too late: refused (LEASE_LOST), the output is out already
        stalled.close()
        other.close()
    reader.read_until(lambda records: len(records) >= 2)
    assert outputs(reader) == Counter({0: 2})
    reader.close()


def test_a_transaction_that_aborts_settles_nothing_and_produces_nothing(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Work"), partitions=1)
    out = create_topic(unique_name("Results"), partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    publish(settings, work, 1)
    reader = TopicReader(settings.bootstrap_servers, out)
    with running_coordinator(settings):
        worker = consumer(settings, "Work", transactional=True, consumer_id="w")
        message = worker.receive(timeout=20)
        assert message is not None
        with pytest.raises(RuntimeError, match="boom"), worker.transaction() as tx:
            tx.produce(out, b'{"n": 0}')
            tx.ack(message)
            raise RuntimeError("boom")
        # Still leased to this worker: settled for real in a second transaction.
        transform(worker, message, out)
        wait_until(lambda: counters(settings, "Work").get("acked") == 1 or None,
                   timeout=20, what="the ack applied")
        worker.close()
    reader.read_until(lambda records: len(records) >= 1)
    reader.read(1.0)
    assert outputs(reader) == Counter({0: 1})
    reader.close()


def test_a_subscribe_naming_another_sessions_producer_is_refused(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    """A session may have only its own producer fenced: a transactional.id not ending with
    its session id is refused (else a Subscribe could fence any application's producer)."""
    from tests.support.coordinator import RawConsumer

    work = create_topic(unique_name("Work"), partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    with running_coordinator(settings):
        raw = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Work",
                          extra_headers=[("qlayer.transactional-id", b"payments-producer-1")])
        result = raw.subscribe()
        assert result.status.value == "INVALID_REQUEST"
        assert "must end with" in (result.message or "")
        raw.close()
    with pytest.raises(ValueError, match="transactional=True"):
        consumer(settings, "Work", transactional_id_prefix="x.")
    assert InvalidSubscriptionError  # the SDK's refusal type for such answers


def test_an_evicted_transactional_session_is_fenced_before_its_message_goes_elsewhere(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    from layer.sdk import SessionEndedError
    from layer.store.store import Store

    work = create_topic(unique_name("Work"), partitions=1)
    out = create_topic(unique_name("Results"), partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    publish(settings, work, 1)
    reader = TopicReader(settings.bootstrap_servers, out)
    with running_coordinator(settings):
        victim = consumer(settings, "Work", transactional=True, consumer_id="victim")
        message = victim.receive(timeout=20)
        assert message is not None
        tx = left_open(victim, message, out, 0, "victim")
        with Store(settings.database_url) as store:
            store.request_eviction("victim", time.time())
        other = consumer(settings, "Work", transactional=True, consumer_id="other")
        again = other.receive(timeout=30)
        assert again is not None and again.bookmark == message.bookmark
        with pytest.raises(TransactionAbortedError) as aborted:
            tx.__exit__(None, None, None)
        assert aborted.value.fenced
        with pytest.raises(SessionEndedError, match="EVICTED"):
            victim.receive(timeout=5)
        transform(other, again, out)
        other.close()
        victim.close()
    reader.read_until(lambda records: len(records) >= 1)
    reader.read(1.0)
    assert [json.loads(r.value or b"{}")["by"] for r in reader.records] == ["other"]
    reader.close()


def test_a_restarted_process_of_the_consumer_id_waits_for_the_old_sessions_fence(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str],
    tmp_path: object,
) -> None:
    """A new process of a consumer id (its state dir proves the old session's secret) while
    the old one stalls with a transaction open: the new Subscribe is answered once the old
    producer is fenced, and the old transaction can commit nothing."""
    work = create_topic(unique_name("Work"), partitions=1)
    out = create_topic(unique_name("Results"), partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    publish(settings, work, 1)
    reader = TopicReader(settings.bootstrap_servers, out)
    with running_coordinator(settings):
        old = consumer(settings, "Work", transactional=True, consumer_id="w",
                       state_dir=str(tmp_path))
        message = old.receive(timeout=20)
        assert message is not None
        tx = left_open(old, message, out, 0, "old")
        new = consumer(settings, "Work", transactional=True, consumer_id="w",
                       state_dir=str(tmp_path))
        assert new.session_id != old.session_id
        with pytest.raises(TransactionAbortedError):
            tx.__exit__(None, None, None)
        again = new.receive(timeout=30)
        assert again is not None and again.bookmark == message.bookmark
        transform(new, again, out)
        new.close()
        old.close()
    reader.read_until(lambda records: len(records) >= 1)
    reader.read(1.0)
    assert [json.loads(r.value or b"{}")["by"] for r in reader.records] == ["w"]
    reader.close()


def test_a_transactional_regex_session_over_two_shards_is_fenced_and_subscribed_anew(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    """Protocol 8 and 9 together: a lease runs out on one shard of a session spanning two;
    that shard fences the session's producer and ends its part, and the consumer ends the
    whole session and subscribes anew over both (each part fenced before it is replaced)."""
    works = [create_topic(unique_name(f"Work{i}"), partitions=1) for i in range(2)]
    out = create_topic(unique_name("Results"), partitions=1)
    put_queues(settings, *({"name": f"Span{i}", "underlying_topic": works[i], "shard": i,
                            "lease_period": "2s"} for i in range(2)))
    with QueuePublisher(settings.bootstrap_servers,
                        topic_prefix=settings.topic_prefix) as publisher:
        for i in range(2):
            publisher.publish(works[i], json.dumps({"n": i}).encode())
    reader = TopicReader(settings.bootstrap_servers, out)
    with running_coordinator(settings):
        worker = consumer(settings, "^Span[01]$", regex=True, transactional=True,
                          consumer_id="spanner", max_backlog=2)
        got = {}
        while len(got) < 2:
            message = worker.receive(timeout=30)
            assert message is not None
            got[message.queue] = message
        transform(worker, got["Span0"], out)
        tx = left_open(worker, got["Span1"], out, 1, "stalled")
        time.sleep(6)  # the lease on shard 1 runs out; that shard fences the producer
        with pytest.raises(TransactionAbortedError):
            tx.__exit__(None, None, None)
        again = worker.receive(timeout=30)
        assert again is not None and again.queue == "Span1" and again.delivery_count == 2
        assert worker.session_id != got["Span1"].session_id
        transform(worker, again, out)
        wait_until(lambda: sum(counters(settings, f"Span{i}").get("acked", 0)
                               for i in range(2)) == 2 or None, timeout=20, what="both acked")
        worker.close()
    reader.read_until(lambda records: len(records) >= 2)
    reader.read(1.0)
    assert outputs(reader) == Counter({0: 1, 1: 1})
    assert "stalled" not in {json.loads(r.value or b"{}")["by"] for r in reader.records}
    reader.close()
