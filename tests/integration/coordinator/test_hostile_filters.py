"""Hostile subscription filters against a real `qlayer coordinator run` process, broker and
PostgreSQL (issue 36, finding 2): a 4.6 KB filter of 200 LIKE patterns froze every shard of the
process for 15-27 s and kept 300-600 MiB after its subscriber left.

- each hostile filter (too long, too many LIKE patterns, patterns too large for their RE2
  budget) is refused, INVALID_FILTER naming the limit, while a canary queue on another shard
  of the same process keeps its deliveries coming: no gap over one second;
- a filter within the limits and as heavy as they allow (16 patterns whose DFAs fill their
  memory budget on the queue's records), subscribed and unsubscribed again and again, leaves
  the coordinator's memory within 50 MiB of where it was (docs/expressions.md, "Limits").

The coordinator is a subprocess so that its RSS is its own; the benchmark with the figures
before and after is benchmarks/hostile_filter.py.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from layer import QueueConsumer
from layer.protocol import SubscribeStatus
from layer.sdk.errors import InvalidFilterError
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import RawConsumer, produce, put_queues, wait_until
from tests.support.processes import CoordinatorSubprocess

pytestmark = pytest.mark.integration

NAME = "hf"

#: The report's filters: 200 patterns whose RE2 programs each filled most of the old 8 MiB
#: budget (4.6 KB), and 299 of them then one RE2 refuses (6.9 KB).
REPORTED_A = "/r = 0 AND (" + " OR ".join(["/f0 LIKE '\\pL{140}'"] * 200) + ")"
REPORTED_B = "/r = 0 AND (" + " OR ".join(["/g0 LIKE '\\pL{140}'"] * 299
                                          + ["/g0 LIKE '\\pL{999}'"]) + ")"

HOSTILE = {
    "too long": (REPORTED_A, "characters long; the limit is 4,096"),
    "too long, refused by RE2 at the end": (REPORTED_B, "characters long; the limit is 4,096"),
    # Within the length: 180 patterns, counted before any is compiled.
    "too many LIKE patterns": (" OR ".join(["/f LIKE '\\pL{140}'"] * 180),
                               "180 LIKE patterns; the limit is 16"),
    "a pattern too large for its RE2 budget": ("/f LIKE '\\pL{999}'", "pattern too large"),
    "patterns too large together": (" OR ".join(["/f LIKE '\\pL{5}'"] * 2),
                                    "RE2 instructions; the limit is 10,000"),
}


def heavy_filter(round_: int) -> str:
    """16 patterns (the most a filter may have) with 2^20+ DFA states that never match the
    records below, so each is run over every record whole and its DFA fills its budget."""
    return " OR ".join(f"/h LIKE '{round_}x|a[ab]{{{20 + i}}}c'" for i in range(16))


def _running(settings: Settings) -> bool:
    with Store(settings.database_url) as store:
        owners = [o.owner_id for o in store.owners()]
        return len(owners) == store.shard_count() and set(owners) == {NAME}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def _worst_gap(arrivals: list[float], start: float, end: float) -> float:
    inside = [t for t in arrivals if start <= t <= end]
    points = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(points))


def _canary(settings: Settings, topic: str, stop: threading.Event,
            arrivals: list[float]) -> None:
    """A consumer of queue Canary taking what a publisher writes to ``topic`` 20 times a
    second, noting when each delivery arrives."""
    consumer = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Canary",
                           max_backlog=50)
    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "linger.ms": 0})
    try:
        consumer.subscribe()
        n = 0
        next_publish = time.monotonic()
        while not stop.is_set():
            if time.monotonic() >= next_publish:
                producer.produce(topic, json.dumps({"n": n}).encode())
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


@pytest.fixture
def coordinator(settings: Settings, journal: Callable[..., str], tmp_path: Path
                ) -> Iterator[tuple[CoordinatorSubprocess, list[float], str]]:
    """A coordinator process running every shard, queue Canary on shard 0 with its canary
    running, and queue Target on shard 1 (its journal's name is yielded)."""
    canary_topic, target_topic = journal("Canary", partitions=1), journal("Target", partitions=1)
    put_queues(settings, {"name": "Canary", "underlying_topic": canary_topic, "shard": 0},
               {"name": "Target", "underlying_topic": target_topic, "shard": 1,
                "lease_period": "60s"})
    process = CoordinatorSubprocess(settings, tmp_path, NAME)
    arrivals: list[float] = []
    stop = threading.Event()
    canary = threading.Thread(target=_canary, args=(settings, canary_topic, stop, arrivals),
                              daemon=True)
    try:
        wait_until(lambda: _running(settings), timeout=90, what="the coordinator runs every shard")
        canary.start()
        # A generous warm-up: the first iterations, fetches and catalog loads are slower.
        wait_until(lambda: len(arrivals) >= 100 or None, timeout=60, what="the canary runs")
        yield process, arrivals, target_topic
    finally:
        stop.set()
        canary.join(30)
        process.stop()


def test_the_sdk_refuses_a_hostile_filter_before_sending_it() -> None:
    with pytest.raises(InvalidFilterError, match="the limit is 4,096"):
        QueueConsumer("Target", "127.0.0.1:1", filter=REPORTED_A)


def test_hostile_filters_are_refused_without_stalling_another_queue(
        settings: Settings,
        coordinator: tuple[CoordinatorSubprocess, list[float], str]) -> None:
    _, arrivals, _ = coordinator
    for what, (text, says) in HOSTILE.items():
        hostile = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Target",
                              filter=text)
        try:
            started = time.monotonic()
            reply = hostile.subscribe()
            answered = time.monotonic()
        finally:
            hostile.close()
        assert reply.status is SubscribeStatus.INVALID_FILTER, (what, reply)
        assert says in (reply.message or ""), (what, reply.message)
        time.sleep(0.5)  # deliveries the loop owed meanwhile arrive after the answer
        worst = _worst_gap(arrivals, started, answered + 0.5)
        assert worst <= 1.0, f"{what}: the canary waited {worst:.2f}s"


def test_a_heavy_filter_within_the_limits_gives_its_memory_back_when_it_leaves(
        settings: Settings,
        coordinator: tuple[CoordinatorSubprocess, list[float], str]) -> None:
    process, arrivals, target_topic = coordinator
    rng = random.Random(7)
    # Records the heavy filter never matches, each scanned whole by its 16 patterns.
    produce(settings.bootstrap_servers, target_topic,
            [json.dumps({"h": "".join(rng.choice("ab") for _ in range(1000))}).encode()
             for _ in range(30)])
    time.sleep(3.0)  # the records read into the Target queue's view
    before = _rss_mib(process.pid)
    after_each = []
    for round_ in range(5):  # a new text each time, as a hostile client would send
        hostile = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Target",
                              filter=heavy_filter(round_), max_backlog=10)
        try:
            reply = hostile.subscribe()
            assert reply.status is SubscribeStatus.OK, reply
            assert hostile.idle(1.0) == []  # matched against every record, delivered none
            hostile.unsubscribe()
        finally:
            hostile.close()
        time.sleep(1.0)
        after_each.append(_rss_mib(process.pid))
    assert max(after_each) - before <= 50, (
        f"the coordinator's RSS went from {before:.0f} MiB to {after_each} MiB")
    assert len(arrivals) > 0
