"""A journal deleted while read and made again is read anew by the same owner (found by the
fault soak: the shard never read the journal made again until it changed owner)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient

from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
    wait_until,
)
from tests.support.kafka import create_topic

from .test_options_expiry_and_backoff import core

__all__ = ["core"]

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("made_again", ["at-once", "later"])
def test_a_journal_deleted_and_made_again_is_read_by_the_same_owner(
        core: str, settings: Settings, unique_name: Callable[[str], str], made_again: str) -> None:
    doomed, busy = unique_name("Doomed"), unique_name("Busy")
    create_topic(settings.bootstrap_servers, doomed, 1)
    create_topic(settings.bootstrap_servers, busy, 4)
    # A busy journal read by the same shard, as the soak's are: the reader keeps fetching.
    put_queues(settings, {"name": "Doomed", "underlying_topic": doomed, "lease_period": "60s",
                          "shard": 0},
               {"name": "Busy", "underlying_topic": busy, "shard": 0})
    stop = threading.Event()
    publisher = threading.Thread(target=_publish_until, args=(settings, busy, stop),
                                 daemon=True)
    publisher.start()
    # The coordinator's own settings (a topic listing every 10 s, lag offsets every 5 s), as
    # the soak runs it.
    with running_coordinator(settings, core=core, topic_check_interval=10.0,
                             refresh_interval=2.0) as coordinator:
        produce(settings.bootstrap_servers, doomed, [b'{"d": %d}' % i for i in range(100)],
                partition=0)
        assert wait_for_counters(settings, "Doomed", enqueued=100)["enqueued"] == 100
        with Consumers(settings) as pool:
            holder = pool.subscribe("Doomed", max_backlog=10)
            assert len(holder.receive(10)) == 10
            admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
            for future in admin.delete_topics([doomed]).values():
                future.result(30)
            if made_again == "at-once":
                # As a broker that creates topics on first use does, the moment anything asks.
                wait_until(lambda: _made(settings, doomed), timeout=60)
            assert wait_for_counters(settings, "Doomed", timeout=60, journal_deleted=100)[
                "journal_deleted"] == 100
            if made_again == "later":
                wait_until(lambda: _made(settings, doomed), timeout=60)
            produce(settings.bootstrap_servers, doomed,
                    [b'{"n": %d}' % i for i in range(100)], partition=0)
            assert wait_for_counters(settings, "Doomed", timeout=60, enqueued=200)[
                "enqueued"] == 200
            holder.unsubscribe()
            fresh = pool.subscribe("Doomed", max_backlog=10)
            got: list[bytes] = []
            while len(got) < 100:
                batch = fresh.receive(min(10, 100 - len(got)), timeout=60)
                fresh.ack(batch)
                got.extend(d.value or b"" for d in batch)
            assert sorted(got) == sorted(b'{"n": %d}' % i for i in range(100))
        assert coordinator.counters["iteration_failures"] == 0
    stop.set()
    publisher.join(10)


def _publish_until(settings: Settings, topic: str, stop: threading.Event) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "linger.ms": 5})
    n = 0
    while not stop.is_set():
        producer.produce(topic, b'{"b": %d}' % n, partition=n % 4)
        producer.poll(0)
        n += 1
        time.sleep(0.0025)
    producer.flush(10)


def _made(settings: Settings, name: str) -> bool | None:
    from confluent_kafka import KafkaException

    try:
        create_topic(settings.bootstrap_servers, name, 1, exist_ok=True)
    except KafkaException:
        return None
    time.sleep(0.1)
    return True


def test_a_renewed_reader_goes_on_where_the_old_one_was_without_a_gap_or_a_repeat(
        settings: Settings, unique_name: Callable[[str], str]) -> None:
    from layer.kafka import JournalReader

    journal = unique_name("Renewed")
    create_topic(settings.bootstrap_servers, journal, 2)
    produce(settings.bootstrap_servers, journal, [b"%d" % i for i in range(60)], partition=0)
    produce(settings.bootstrap_servers, journal, [b"%d" % i for i in range(60)], partition=1)
    reader = JournalReader({"bootstrap.servers": settings.bootstrap_servers},
                           unique_name("g"), prefetch_records=100)
    got: dict[int, list[int]] = {0: [], 1: []}

    def take(records: list) -> None:  # type: ignore[type-arg]
        for r in records:
            got[r.partition].append(r.offset)

    try:
        reader.assign({(journal, 0): 0, (journal, 1): 10})
        deadline = time.monotonic() + 30
        while sum(map(len, got.values())) < 40 and time.monotonic() < deadline:
            take(reader.poll(20, 0.5))
        assert reader.wait(5.0)  # a record taken from the old consumer and not handed out
        reader.renew()
        deadline = time.monotonic() + 30
        while sum(map(len, got.values())) < 110 and time.monotonic() < deadline:
            take(reader.poll(50, 0.5))
    finally:
        reader.close()
    assert got == {0: list(range(60)), 1: list(range(10, 60))}
