"""A hostile or careless tenant against a real coordinator, broker and PostgreSQL (issue 36,
findings 3, 5 and 6): what it writes to the control and ack topics may cost it, never another
consumer's session, another queue's deliveries, or the shard.

- a Subscribe of a live consumer's id written to another shard's partition neither shadows nor
  deletes the live session (one consumer registry across shards);
- ack records of no session, large ones at that, are dropped before they are decoded: a canary
  queue's deliveries keep coming meanwhile;
- one ack record of a live session with 15,000 bogus items is answered in several replies,
  never one over the broker's record limit (which failed the iteration and rebuilt the shard);
- malformed records are counted once, even when a coordinator SIGKILLed after reading them
  reads them again, and the counts are in ``/metrics`` by reason and principal.
"""

from __future__ import annotations

import itertools
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer

from layer.protocol import AckItem, AckRecord, AckStatus, AckType, Codec, TopicNames
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import (
    Consumers,
    RawConsumer,
    produce,
    put_queues,
    running_coordinator,
    wait_until,
)
from tests.support.processes import CoordinatorSubprocess

pytestmark = pytest.mark.integration

CODEC = Codec()


def test_a_subscribe_on_another_shard_neither_shadows_nor_deletes_a_live_session(
        settings: Settings, journal: Callable[..., str]) -> None:
    """Finding 3: the registry was keyed by consumer id alone; a forged Subscribe accepted on
    shard 1 overwrote the victim's row, timed out, and deleted it."""
    a, b = journal("A", partitions=1), journal("B", partitions=1)
    put_queues(settings, {"name": "A", "underlying_topic": a, "shard": 0},
               {"name": "B", "underlying_topic": b, "shard": 1})
    with running_coordinator(settings) as coordinator, Consumers(settings) as pool:
        # Two minutes: on a loaded machine (six test workers on two cores) the steps below took
        # more than 20 s once, and a session not heard from for its timeout is one a Subscribe
        # may take over (by design): the victim must be live by any clock throughout.
        victim = pool.subscribe("A", max_backlog=5, session_timeout_ms=120_000)
        produce(settings.bootstrap_servers, a, [b"1"])
        (held,) = victim.receive(1)
        # A message of B waits first: when shard 1's view of the registry is older than the
        # victim's row, the step that accepts the forger also leases it that message, and the
        # store's refusal of the row must stop that delivery too (it reached the victim's
        # delivery topic in a CI run of stop 42).
        produce(settings.bootstrap_servers, b, [b"x"])
        # Its own secret, a short session timeout, queue B, and shard 1's partition.
        forger = pool.new("B", consumer_id=victim.consumer_id, session_timeout_ms=1_000)
        forger.send_subscribe(partition=1)
        # Well past the forger's session timeout (and a catalog load): nothing of the victim's
        # may have gone, and nothing of queue B reached its consumer id.
        assert victim.idle(3.0) == []
        with Store(settings.database_url) as store:
            rows = [r for r in store.load_consumers() if r.consumer_id == victim.consumer_id]
        assert [(r.session_id, r.queue) for r in rows] == [(victim.session_id, "A")]
        assert rows[0].shard == 0
        assert coordinator.counters["session_timeouts"] == 0
        # Refused once: by shard 1's check of the registry, or, when its view of the registry
        # was older than the victim's row (a loaded machine), by the guarded write of the row,
        # which counts the refusal and a registry conflict (control.py): never accepted.
        assert coordinator.refusals[("subscribe", "consumer_id_live_elsewhere", "anonymous")] == 1
        assert coordinator.counters["registry_conflicts"] in (0, 1)
        # Its lease, and its next messages, are still its own.
        victim.ack([held])
        produce(settings.bootstrap_servers, a, [b"2"])
        (later,) = victim.receive(1)
        assert later.value == b"2"
        victim.ack([later])
        assert victim.ack_results() == []


def _canary(settings: Settings, queue: str, topic: str, stop: threading.Event,
            arrivals: list[float]) -> None:
    """A consumer of ``queue`` taking what a publisher writes to ``topic`` 20 times a second,
    noting when each delivery arrives."""
    consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, queue,
                           max_backlog=50)
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "linger.ms": 0})
    try:
        consumer.subscribe()
        n = 0
        next_publish = time.monotonic()
        while not stop.is_set():
            if time.monotonic() >= next_publish:
                producer.produce(topic, str(n).encode())
                producer.poll(0)
                n += 1
                next_publish += 0.05
            got = consumer.poll(0.02)
            if got:
                now = time.monotonic()
                arrivals.extend(now for _ in got)
                consumer.ack(got)
    finally:
        producer.flush(10)
        consumer.close()


def _worst_gap(arrivals: list[float], start: float, end: float) -> float:
    inside = [t for t in arrivals if start <= t <= end]
    points = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(points))


# Alone (after the parallel workers, `make test`), as the soak's canary: a 1 s canary and the
# coordinator share this process, and beside five busy workers on two cores its gap was 1.11 s
# in a CI run (stop 41) with no flood to blame; the stall it guards against was 15.7 s.
@pytest.mark.alone
def test_an_ack_flood_without_a_session_does_not_stop_another_queue(
        settings: Settings, journal: Callable[..., str]) -> None:
    """Finding 5: ack records were decoded before their session was checked (~0.5 s per
    960 KB record); 30 of them stalled every queue of the process for 15.7 s."""
    canary_topic = journal("Canary", partitions=1)
    put_queues(settings, {"name": "Canary", "underlying_topic": canary_topic, "shard": 0})
    topics = TopicNames(settings.topic_prefix)
    item = AckItem(queue="Canary", bookmark=f"{canary_topic}/0/0", lease="x" * 32,
                   type=AckType.ACCEPT)
    forged = CODEC.encode_ack(AckRecord(consumer_id="nobody", session_id="none", sent_at_ms=0,
                                        items=(item,) * 9_000))
    assert 900_000 < len(forged) < 1_000_000
    arrivals: list[float] = []
    stop = threading.Event()
    with running_coordinator(settings) as coordinator:
        canary = threading.Thread(target=_canary, args=(settings, "Canary", canary_topic, stop,
                                                        arrivals), daemon=True)
        canary.start()
        wait_until(lambda: len(arrivals) >= 40 or None, timeout=30, what="the canary runs")
        flooder = Producer({"bootstrap.servers": settings.bootstrap_servers, "linger.ms": 5,
                            "message.max.bytes": 2_000_000})
        started = time.monotonic()
        for i in range(30):  # to every shard's partition, as fast as the producer takes them
            flooder.produce(topics.ack, forged, key=b"nobody", partition=i % 4)
        assert flooder.flush(60) == 0
        wait_until(lambda: coordinator.counters["identity_refused_ack_unknown_session"] >= 30
                   or None, timeout=60, what="the 30 records dropped")
        ended = time.monotonic()
        time.sleep(0.5)
        stop.set()
        canary.join(30)
    worst = _worst_gap(arrivals, started, ended)
    assert worst <= 1.0, f"the canary waited {worst:.2f}s while the flood was read"
    assert coordinator.counters["malformed_ack_records"] == 0
    assert coordinator.counters["iteration_failures"] == 0


def test_a_reply_too_large_for_one_record_is_split_not_a_rebuild(
        settings: Settings, journal: Callable[..., str]) -> None:
    """Finding 5: a live session's one ack of 15,000 bogus items made a reply over the
    broker's 1 MB limit; the iteration failed and the shard was rebuilt (results lost)."""
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    with running_coordinator(settings) as coordinator, Consumers(settings) as pool:
        consumer = pool.subscribe("Work", max_backlog=1)
        # Items naming a queue no shard serves: each answered UNKNOWN_ENTRY with a message
        # that names the queue again, so the answers (1.8 MB) outgrow the record (0.9 MB).
        unknown = "Q" * 200
        bogus = [AckItem(queue=unknown, bookmark=f"w0/0/{10_000 + i}", lease="t",
                         type=AckType.ACCEPT) for i in range(4_000)]
        consumer.send_items(bogus)
        results = consumer.wait_for_ack_results(4_000, timeout=60)
        assert len(results) == 4_000
        assert {r.status for r in results} == {AckStatus.UNKNOWN_ENTRY}
        assert len([r for r in consumer.replies if hasattr(r, "items")]) > 1
        assert coordinator.counters["replies_split"] >= 1
        assert coordinator.counters["iteration_failures"] == 0
        # And the session goes on.
        produce(settings.bootstrap_servers, work, [b"after"])
        (message,) = consumer.receive(1)
        assert message.value == b"after"


def _stored(settings: Settings, name: str) -> int:
    with Store(settings.database_url) as store:
        return sum(c.get(name, 0) for c in store.all_shard_counters().values())


def _metric(port: int, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:  # not listening yet (URLError is an OSError)
        return None
    total = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total = (total or 0.0) + sample.value
    return total


def test_malformed_records_are_counted_once_across_a_sigkill_and_shown_by_principal(
        settings: Settings, tmp_path: Path) -> None:
    """Finding 6: a shard's fault counters were written with its periodic report, apart from
    the input positions: records read again after a crash were counted twice."""
    from tests.integration.coordinator.test_metrics_endpoint import free_port

    topics = TopicNames(settings.topic_prefix)
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
    port = free_port()
    first = CoordinatorSubprocess(settings, tmp_path, "c1", "--metrics-port", str(port))
    try:
        wait_until(lambda: _metric(port, "qlayer_coordinator_ready") == 1.0 or None,
                   timeout=60, what="the coordinator ready")
        # Three malformed control records of shard 0, in three iterations within a second.
        for _ in range(3):
            producer.produce(topics.control, b"not avro at all", partition=0)
            producer.flush(10)
            time.sleep(0.3)
        wait_until(lambda: _stored(settings, "malformed_control_records") == 3 or None,
                   timeout=30, what="three malformed records counted and stored")
        first.kill()
        second = CoordinatorSubprocess(settings, tmp_path, "c2", "--metrics-port", str(port))
        try:
            wait_until(lambda: _metric(port, "qlayer_shard_epoch", shard="0") or None,
                       timeout=60, what="the second coordinator runs shard 0")
            time.sleep(2.0)  # it has read the control partitions from the stored positions
            assert _stored(settings, "malformed_control_records") == 3
            # By reason and principal too, in /metrics (once its first snapshot is out).
            wait_until(lambda: _metric(port, "qlayer_refusals_total", kind="control",
                                       reason="malformed", principal="anonymous") or None,
                       timeout=30, what="the refusals in /metrics")
            assert _metric(port, "qlayer_refusals_total", kind="control", reason="malformed",
                           principal="anonymous") == 3.0
        finally:
            second.stop()
    finally:
        first.stop()
