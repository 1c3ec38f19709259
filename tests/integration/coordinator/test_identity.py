"""Session identity against a real broker and PostgreSQL, on both shard cores (protocol 5,
docs/security.md "Session identity"): the attacks of issue 15 item 3, tried as a hostile user
with write access to the control and ack topics would, each leaving the victim's session, its
leases and its messages where they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient

from layer.protocol import AckStatus, Replace, SubscribeStatus, TopicNames
from layer.protocol.headers import SESSION, new_session_secret
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import (
    Consumers,
    RawConsumer,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

from .test_options_expiry_and_backoff import core

__all__ = ["core"]  # the fixture, imported to run every test on both cores

pytestmark = pytest.mark.integration


def impostor(pool: Consumers, victim: RawConsumer, **options: object) -> RawConsumer:
    """A consumer writing records in the victim's name (its consumer id, the session id every
    delivery's ``qlayer.session`` header shows, and its shard), with a secret of its own."""
    forger = pool.new(victim.queue, consumer_id=victim.consumer_id, **options)
    forger.session_id = victim.session_id
    forger.delivery_topic = victim.delivery_topic
    forger.shard = victim.shard  # its replies' qlayer.shard header: the partition to write to
    return forger


def test_a_subscribe_with_the_victims_id_is_refused_and_the_victim_keeps_its_leases(
        core: str, settings: Settings, journal: Callable[..., str]) -> None:
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "60s"})
    with running_coordinator(settings, core=core) as coordinator, Consumers(settings) as pool:
        victim = pool.subscribe("Work", max_backlog=2)
        produce(settings.bootstrap_servers, work, [b"a", b"b"])
        held = victim.receive(2)
        thief = pool.new("Work", consumer_id=victim.consumer_id)
        # Asking for deliveries on a topic of its own: refused, the topic not created, and the
        # refusal written to the consumer id's own delivery topic (protocol 7: qlayer names
        # delivery topics), which the thief reads here, without ACLs; the victim's SDK ignores
        # it: another session's request.
        inbox = TopicNames(settings.topic_prefix).delivery("thief-inbox")
        refused = thief.subscribe(delivery_topic=inbox)
        assert refused.status is SubscribeStatus.INVALID_REQUEST
        admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
        assert inbox not in admin.list_topics(timeout=10).topics
        # Under its own topic, the live session is what refuses it; the refusal does not name
        # the victim's session.
        refused = thief.subscribe()
        assert refused.status is SubscribeStatus.INVALID_REQUEST
        assert "live session" in (refused.message or "")
        assert victim.session_id not in (refused.message or "")
        # The victim's session is intact: it acks its leases and gets the next messages.
        victim.ack(held)
        produce(settings.bootstrap_servers, work, [b"c"])
        (later,) = victim.receive(1)
        assert later.value == b"c"
        assert (SESSION, victim.session_id.encode()) in later.headers  # not the thief's
        victim.ack([later])
        wait_for_counters(settings, "Work", acked=3)
        assert victim.ack_results() == []
        assert coordinator.counters["identity_refused_subscribe_session_live"] == 2
        assert coordinator.counters["subscribe_invalid_request"] == 2
        with Store(settings.database_url) as store:
            (row,) = [r for r in store.load_consumers() if r.consumer_id == victim.consumer_id]
        assert row.session_id == victim.session_id and row.delivery_topic == victim.delivery_topic
        assert row.secret_hash is not None and victim.secret is not None
        assert victim.secret not in row.secret_hash


@pytest.mark.parametrize("forgery", ["unsubscribe", "heartbeat", "replace"])
def test_forged_control_records_in_the_victims_name_change_nothing(
        core: str, settings: Settings, journal: Callable[..., str], forgery: str) -> None:
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "60s"})
    with running_coordinator(settings, core=core) as coordinator, Consumers(settings) as pool:
        victim = pool.subscribe("Work", max_backlog=1)
        produce(settings.bootstrap_servers, work, [b"a", b"b"])
        (held,) = victim.receive(1)
        forger = impostor(pool, victim)
        forger.secret = new_session_secret()  # not the victim's
        if forgery == "unsubscribe":
            forger.unsubscribe()
        elif forgery == "heartbeat":
            forger.heartbeat()
        else:
            forger._send_control(Replace(
                consumer_id=victim.consumer_id, session_id=victim.session_id, request_id="r",
                queue="Work", max_backlog=0, delivery_topic=victim.delivery_topic,
                sent_at_ms=int(time.time() * 1000)), forger.proof())

        def counted() -> bool:
            # The victim keeps its session (heartbeats) meanwhile, and gets nothing new.
            assert victim.idle(0.1) == []
            return coordinator.counters[f"identity_refused_{forgery}_wrong_proof"] == 1

        wait_until(counted, what="the forgery counted")
        # The lease is still the victim's: no redelivery while it keeps its session, and
        # its ack applies; backlog 1 still holds (a forged Replace did not change it).
        assert victim.idle(1.0) == []
        victim.ack([held])
        (second,) = victim.receive(1)
        assert second.value == b"b" and second.delivery_count == 1
        victim.ack([second])
        assert victim.ack_results() == []
        wait_for_counters(settings, "Work", acked=2)


def test_an_ack_with_another_consumers_token_settles_nothing(
        core: str, settings: Settings, journal: Callable[..., str]) -> None:
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "60s"})
    with running_coordinator(settings, core=core) as coordinator, Consumers(settings) as pool:
        victim = pool.subscribe("Work", max_backlog=1)
        produce(settings.bootstrap_servers, work, [b"a"])
        (held,) = victim.receive(1)
        thief = pool.subscribe("Work", max_backlog=1)
        thief.ack([held])  # a token read from the victim's delivery topic, in its own record
        (answer,) = thief.wait_for_ack_results(1)
        assert (answer.status, answer.bookmark) == (AckStatus.WRONG_TOKEN, held.bookmark)
        # Acks without the proof, in the victim's own name, are not acted on either.
        forger = impostor(pool, victim)
        forger.secret = None
        forger.ack([held])
        wait_until(lambda: coordinator.counters["identity_refused_ack_no_proof"] == 1,
                   what="the unproven ack counted")
        assert victim.idle(0.5) == []
        victim.ack([held])
        wait_for_counters(settings, "Work", acked=1)
        assert victim.ack_results() == []


def test_ack_records_with_random_ids_create_no_topic(
        core: str, settings: Settings, journal: Callable[..., str]) -> None:
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    topics = TopicNames(settings.topic_prefix)
    admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
    with running_coordinator(settings, core=core) as coordinator, Consumers(settings) as pool:
        victim = pool.subscribe("Work")
        produce(settings.bootstrap_servers, work, [b"a"])
        (held,) = victim.receive(1)
        vandal = pool.new("Work")  # (its own delivery topic is made here, before the count)
        before = set(admin.list_topics(timeout=10).topics)
        for i in range(30):
            vandal.consumer_id = vandal.session_id = f"random-{i}-{time.monotonic_ns()}"
            vandal.ack([held])
        wait_until(lambda: coordinator.counters["identity_refused_ack_unknown_session"] == 30,
                   what="30 ack records of unknown sessions counted")
        time.sleep(1.0)  # a loop iteration or more, for any topic creation to show
        made = {t for t in set(admin.list_topics(timeout=10).topics) - before
                if t.startswith(topics.prefix)}
        assert made == set()
        victim.ack([held])
        wait_for_counters(settings, "Work", acked=1)


def test_an_old_protocol_consumer_works_unless_identity_is_required(
        core: str, settings: Settings, journal: Callable[..., str]) -> None:
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        old = pool.subscribe("Work", identity=False)
        produce(settings.bootstrap_servers, work, [b"a"])
        (held,) = old.receive(1)
        old.ack([held])
        wait_for_counters(settings, "Work", acked=1)
        # Unproven, it cannot take a proven session over.
        proven = pool.subscribe("Work")
        intruder = pool.new("Work", consumer_id=proven.consumer_id, identity=False)
        assert intruder.subscribe().status is SubscribeStatus.INVALID_REQUEST
    with running_coordinator(settings, core=core, require_identity=True), \
            Consumers(settings) as pool:
        refused = pool.new("Work", identity=False).subscribe()
        assert refused.status is SubscribeStatus.INVALID_REQUEST
        assert "requires a session secret" in (refused.message or "")
        pool.subscribe("Work")  # checked OK
