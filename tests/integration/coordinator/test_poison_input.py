"""Poison input is isolated to its record or queue, through a running coordinator on both
cores (issue 15, items 2a, 2b, 5): a journal record larger than the coordinator can deliver is
dead-lettered (reason ``too_large``) without ever reaching the producer; a journal deleted while
read expires its entries (reason ``journal_deleted``) and, made again, is read from its new
start. Neither costs the shard a rebuild (its epoch stays), the other queues carry on, and the
shard's counters reach `qlayer stats --json`."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import pytest
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from typer.testing import CliRunner

from layer.protocol import Event, EventType, TopicNames
from layer.protocol.headers import DLQ_REASON, DLQ_VALUE_OMITTED
from layer.settings import Settings
from layer.store.store import Store
from layer_cli.main import app
from tests.support.coordinator import (
    Consumers,
    EventReader,
    TopicReader,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_for_counters,
    wait_until,
)
from tests.support.coordinator import (
    counters as queue_counters,
)
from tests.support.kafka import create_topic

from .test_options_expiry_and_backoff import core

__all__ = ["core"]  # the fixture, imported to run every test on both cores

pytestmark = pytest.mark.integration


def _epochs(settings: Settings) -> dict[str, int]:
    with Store(settings.database_url) as store:
        return {o.shard: o.epoch for o in store.owners()}


def _create(settings: Settings, name: str, config: dict[str, str] | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
    for future in admin.create_topics([NewTopic(name, 1, 1, config=config or {})]).values():
        future.result(30)
    wait_until(lambda: name in admin.list_topics(timeout=10).topics or None)


def _shard_counters(settings: Settings) -> dict[str, int]:
    out = CliRunner().invoke(app, [
        "stats", "--json", "--interval", "0.1", "--bootstrap-servers",
        settings.bootstrap_servers, "--database-url", settings.database_url,
        "--topic-prefix", settings.topic_prefix])
    assert out.exit_code == 0, out.output
    totals: dict[str, int] = {}
    for counters in json.loads(out.stdout)["shards"].values():
        for name, n in counters.items():
            totals[name] = totals.get(name, 0) + n
    return totals


def test_a_record_too_large_to_deliver_is_dead_lettered_and_the_shard_goes_on(
    core: str, settings: Settings, unique_name: Callable[[str], str]
) -> None:
    big, small = unique_name("Big"), unique_name("Small")
    # The journal takes records of 3 MB; the coordinator's producer writes 1 MB at most.
    _create(settings, big, {"max.message.bytes": "3000000"})
    _create(settings, small)
    put_queues(settings, {"name": "Big", "underlying_topic": big},
               {"name": "Healthy", "underlying_topic": small})
    oversize = os.urandom(1_500_000)
    with running_coordinator(settings, core=core) as _coordinator:
        before = _epochs(settings)
        producer = Producer({"bootstrap.servers": settings.bootstrap_servers,
                             "message.max.bytes": 3_000_000})
        for value in (b'{"n": 0}', oversize, b'{"n": 2}'):
            producer.produce(big, value, partition=0)
        assert producer.flush(30) == 0
        produce(settings.bootstrap_servers, small, [b'{"h": %d}' % i for i in range(5)],
                partition=0)
        with Consumers(settings) as pool:
            healthy = pool.subscribe("Healthy", max_backlog=10)
            got = healthy.receive(5)
            healthy.ack(got)
            assert healthy.ack_results() == []
            assert wait_for_counters(settings, "Healthy", acked=5)["acked"] == 5
            worker = pool.subscribe("Big", max_backlog=10)
            delivered = worker.receive(2)
            assert [d.value for d in delivered] == [b'{"n": 0}', b'{"n": 2}']
            worker.ack(delivered)
            assert wait_for_counters(settings, "Big", acked=2)["acked"] == 2
            assert worker.ack_results() == [], "no ack refused"

        dlq = TopicReader(settings.bootstrap_servers, TopicNames(settings.topic_prefix)
                          .dead_letter("Big"))
        try:
            [letter] = dlq.read_until(lambda rs: len(rs) >= 1)
        finally:
            dlq.close()
        headers = dict(letter.headers or [])
        assert headers[DLQ_REASON] == b"too_large"
        assert headers[DLQ_VALUE_OMITTED] == b"1500000"
        assert not letter.value
        events = EventReader(settings)
        try:
            seen = events.read_until(lambda es: any(
                e.type is EventType.EXPIRED and e.reason == "too_large" for e in es))
        finally:
            events.close()
        assert [(e.type, e.bookmark.offset if e.bookmark else None) for e in seen
                if e.queue == "Big" and e.reason == "too_large"] == [
            (EventType.DEAD_LETTERED, 1), (EventType.EXPIRED, 1)]
        assert _epochs(settings) == before, "no shard was rebuilt"
        counted = wait_until(lambda: _shard_counters(settings).get("too_large") == 1 or None,
                             timeout=20)
        assert counted


def test_a_journal_deleted_while_read_expires_its_entries_and_made_again_is_read_anew(
    core: str, settings: Settings, unique_name: Callable[[str], str]
) -> None:
    doomed, other = unique_name("Doomed"), unique_name("Other")
    _create(settings, doomed)
    _create(settings, other)
    put_queues(settings, {"name": "Doomed", "underlying_topic": doomed},
               {"name": "Other", "underlying_topic": other})
    with running_coordinator(settings, core=core):
        before = _epochs(settings)
        produce(settings.bootstrap_servers, doomed, [b'{"d": %d}' % i for i in range(5)],
                partition=0)
        with Consumers(settings) as pool:
            lost = pool.subscribe("Doomed", max_backlog=2)
            assert len(lost.receive(2)) == 2  # leased, never acked
            admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
            for future in admin.delete_topics([doomed]).values():
                future.result(30)
            events = EventReader(settings)
            try:
                seen = events.read_until(lambda es: sum(
                    e.type is EventType.EXPIRED and e.reason == "journal_deleted"
                    for e in es) >= 5, timeout=40)
            finally:
                events.close()
            assert sorted(e.bookmark.offset for e in seen if e.bookmark is not None
                          and e.reason == "journal_deleted") == [0, 1, 2, 3, 4]
            # The queue's mark: its counter, in stats and describe.
            assert wait_for_counters(settings, "Doomed", journal_deleted=5)[
                "journal_deleted"] == 5
            described = CliRunner().invoke(app, [
                "queue", "describe", "Doomed", "--database-url", settings.database_url,
                "--bootstrap-servers", settings.bootstrap_servers,
                "--topic-prefix", settings.topic_prefix], env={"COLUMNS": "250"})
            assert described.exit_code == 0, described.output
            assert "a journal partition was deleted while the queue read it: 5 entries" in (
                " ".join(described.stdout.split()))

            # The other queue of the shard carries on: deliveries flow, acks are accepted.
            produce(settings.bootstrap_servers, other, [b'{"o": 1}', b'{"o": 2}'],
                    partition=0)
            worker = pool.subscribe("Other", max_backlog=10)
            got = worker.receive(2)
            worker.ack(got)
            assert wait_for_counters(settings, "Other", acked=2)["acked"] == 2
            assert worker.ack_results() == [], "no ack refused"

            # Made again: its records (offsets from 0 again) are delivered.
            time.sleep(1.0)
            _create(settings, doomed)
            produce(settings.bootstrap_servers, doomed, [b'{"new": 1}', b'{"new": 2}'],
                    partition=0)
            fresh = pool.subscribe("Doomed", max_backlog=10)
            assert sorted(d.value or b"" for d in fresh.receive(2, timeout=40)) == [
                b'{"new": 1}', b'{"new": 2}']
        assert _epochs(settings) == before, "no shard was rebuilt"
        counted = wait_until(
            lambda: _shard_counters(settings).get("journal_deleted") == 5 or None, timeout=20)
        assert counted


def test_a_journal_deleted_and_made_again_before_the_listing_sees_it_expires_its_entries(
    core: str, settings: Settings, unique_name: Callable[[str], str]
) -> None:
    """Found by the soak: the journal deleted and made again (by an operator, or by a broker
    that creates topics on first use) between two listings, with nothing acked yet (recovery
    point 0). The reader meets its position (5) past the new log's end (2): that is a log made
    again, never retention (which moves a log's start, not its end), even though the recovery
    point (0) is inside the new log. It was taken for retention: the shard rebuilt, and the
    old entries never expired."""
    doomed = unique_name("Remade")
    _create(settings, doomed)
    put_queues(settings, {"name": "Remade", "underlying_topic": doomed})
    # Listings far apart: only the reader's out-of-range position can tell.
    with running_coordinator(settings, core=core, topic_check_interval=60.0):
        before = _epochs(settings)
        produce(settings.bootstrap_servers, doomed, [b'{"d": %d}' % i for i in range(5)],
                partition=0)
        assert wait_for_counters(settings, "Remade", enqueued=5)["enqueued"] == 5
        admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
        for future in admin.delete_topics([doomed]).values():
            future.result(30)
        wait_until(lambda: doomed not in admin.list_topics(timeout=10).topics or None)
        made = wait_until(lambda: _made_again(settings, doomed), timeout=60)
        assert made
        produce(settings.bootstrap_servers, doomed, [b'{"new": 1}', b'{"new": 2}'],
                partition=0)
        assert wait_for_counters(settings, "Remade", timeout=40, journal_deleted=5)[
            "journal_deleted"] == 5
        with Consumers(settings) as pool:
            fresh = pool.subscribe("Remade", max_backlog=10)
            assert sorted(d.value or b"" for d in fresh.receive(2, timeout=40)) == [
                b'{"new": 1}', b'{"new": 2}']
        assert _epochs(settings) == before, "no shard was rebuilt"


def _made_again(settings: Settings, name: str) -> bool | None:
    """Creates the topic (made already: a broker that creates topics on first use); None
    (tried again) while Kafka still deletes the old one."""
    try:
        create_topic(settings.bootstrap_servers, name, 1, exist_ok=True)
    except KafkaException:
        return None
    return True


def _lease_then_stop(settings: Settings, queue: str, topic: str, count: int,
                     leased: int) -> None:
    """Coordinator A admits ``count`` records of the journal, leases ``leased`` of them to a
    consumer that never acks, and stops: the shard has no owner."""
    with running_coordinator(settings):
        produce(settings.bootstrap_servers, topic, [b'{"old": %d}' % i for i in range(count)],
                partition=0)
        assert wait_for_counters(settings, queue, enqueued=count)["enqueued"] == count
        with Consumers(settings) as pool:
            holder = pool.subscribe(queue, max_backlog=leased)
            assert len(holder.receive(leased)) == leased  # leased, never acked
            assert wait_for_counters(settings, queue, delivered=leased)["delivered"] == leased
    admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
    for future in admin.delete_topics([topic]).values():
        future.result(30)
    wait_until(lambda: topic not in admin.list_topics(timeout=10).topics or None)


def _expired_as_deleted(events: list[Event]) -> list[int]:
    return sorted(e.bookmark.offset for e in events if e.type is EventType.EXPIRED
                  and e.reason == "journal_deleted" and e.bookmark is not None)


@pytest.mark.parametrize("made_again", [True, False], ids=["made-again", "gone"])
def test_a_journal_deleted_while_its_shard_has_no_owner_expires_every_entry_at_the_next_owner(
    core: str, made_again: bool, settings: Settings, unique_name: Callable[[str], str]
) -> None:
    """Found by the soak: the journal deleted while its shard had no owner (the owner stopped
    or was SIGKILLed), and made again empty (a broker creating topics on first use) before
    the next owner loads the shard -- or not made again. The next owner finds the stored
    ``admitted`` offset (20) past the new log's end (3), or the partition no longer listed:
    the 20 old entries (3 leased, 17 queued and never leased, which have no row) expire once
    each, reason ``journal_deleted``, and the records of the journal made again are new
    entries (ENQUEUED), delivered as such. It used to start reading the new log at the stored
    recovery point (0): no old entry ever expired, and the new records were taken for the old
    entries at the same offsets."""
    doomed = unique_name("Orphaned")
    _create(settings, doomed)
    put_queues(settings, {"name": "Orphaned", "underlying_topic": doomed})
    _lease_then_stop(settings, "Orphaned", doomed, 20, 3)
    if made_again:
        assert wait_until(lambda: _made_again(settings, doomed), timeout=60)
        produce(settings.bootstrap_servers, doomed, [b'{"new": %d}' % i for i in range(3)],
                partition=0)
    events = EventReader(settings)
    try:
        with running_coordinator(settings, core=core):
            taken = _epochs(settings)
            seen = events.read_until(lambda es: len(_expired_as_deleted(es)) >= 20, timeout=40)
            assert wait_for_counters(settings, "Orphaned", journal_deleted=20)[
                "journal_deleted"] == 20
            if made_again:
                with Consumers(settings) as pool:
                    fresh = pool.subscribe("Orphaned", max_backlog=10)
                    got = fresh.receive(3, timeout=40)
                    assert sorted(d.value or b"" for d in got) == [
                        b'{"new": %d}' % i for i in range(3)]
                    fresh.ack(got)
                    assert wait_for_counters(settings, "Orphaned", acked=3)["acked"] == 3
                seen = events.read_until(lambda es: sum(
                    e.type is EventType.ENQUEUED and e.queue == "Orphaned"
                    and e.bookmark is not None and e.bookmark.topic == doomed
                    for e in es) >= 23, timeout=20)
            else:
                # The stored positions of the partition start over: nothing is left of it.
                assert wait_until(lambda: recovery_points(settings, "Orphaned").get(
                    (doomed, 0)) == 0 or None)
            assert _epochs(settings) == taken, "no shard was rebuilt"
            # Once each: the counters of the queue say so too.
            assert _expired_as_deleted(seen) == list(range(20))
            totals = queue_counters(settings, "Orphaned")
            assert totals["enqueued"] == (23 if made_again else 20)
            assert totals["journal_deleted"] == 20
            # The shard's fault counters (`qlayer stats`), reported periodically.
            assert wait_until(lambda: _shard_counters(settings).get("journal_deleted") == 20
                              or None, timeout=20)
    finally:
        events.close()
    enqueued = sorted(o for e in seen if e.type is EventType.ENQUEUED and e.bookmark is not None
                      for o in [e.bookmark.offset])
    assert enqueued == sorted([*range(20), *(range(3) if made_again else [])])
