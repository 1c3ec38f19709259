"""Partitioned queues (issue 32, docs/coordinator.md "Partitioned queues"): one queue split by
journal partition into parts on several shards, consumed by name through the public SDK with
one backlog over its parts. A real coordinator, broker and database."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from layer.domain.errors import QueueConfigError
from layer.sdk import Message, QueueConsumer
from layer.services.queues import InvalidQueueFileError, PartitionedQueueError, QueueService
from layer.settings import Settings
from layer.store.store import Store
from layer_cli.main import app
from tests.support.coordinator import put_queues, running_coordinator, wait_until
from tests.support.processes import (
    ConsumerWorker,
    CoordinatorSubprocess,
    audit,
    produce_numbers,
    read_events,
)

pytestmark = pytest.mark.integration


def _drain(consumer: QueueConsumer, want: int, got: list[tuple[str, str]],
           timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        message = consumer.receive(timeout=0.5)
        if message is not None:
            got.append((message.queue, str(message.bookmark)))
            message.ack()


def _hold(consumer: QueueConsumer, count: int, timeout: float = 60) -> list[Message]:
    """``count`` messages received and not settled (fails the test when fewer come)."""
    held: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(held) < count and time.monotonic() < deadline:
        message = consumer.receive(timeout=0.5)
        if message is not None:
            held.append(message)
    assert len(held) == count
    return held


def test_a_queue_of_four_parts_is_served_by_four_shards_and_consumed_by_name_with_one_backlog(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """Parts 0..3 of a queue over an 8-partition journal on shards 0..3 (the first part is
    pinned to shard 0); a consumer of the queue by name with max_backlog 3 holds at most 3
    over all the parts, and gets every message once; every part's shard acks its own."""
    topic = journal("parts", partitions=8)
    put_queues(settings, {"name": "Split", "underlying_topic": topic, "parts": 4, "shard": 0,
                          "lease_period": "120s"})
    total = 200
    with running_coordinator(settings):
        produce_numbers(settings.bootstrap_servers, topic, total)
        with QueueConsumer("Split", max_backlog=3, bootstrap_servers=settings.bootstrap_servers,
                           topic_prefix=settings.topic_prefix) as consumer:
            held = _hold(consumer, 3)
            assert consumer.receive(timeout=2.0) is None, "a fourth came while three were held"
            got = [(m.queue, str(m.bookmark)) for m in held]
            for message in held:
                message.ack()
            _drain(consumer, total, got)
            assert len(got) == total, f"{total - len(got)} never delivered"
            assert len(set(got)) == total, "a message was delivered twice"
            partitions = Counter(int(b.split("/")[1]) for _, b in got)
            assert set(partitions) == set(range(8))
        with Store(settings.database_url) as store:
            deadline = time.monotonic() + 30
            while (sum(store.load_recovery_points("Split").values()) < total
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            points = store.load_recovery_points("Split")
            assert sum(points.values()) == total
            assert sorted(k.partition for k in points) == list(range(8))
        # The operator sees each part, its shard, its holder and its partitions.
        described = _qlayer(settings, "queue", "describe", "Split", "--json")
        assert described.exit_code == 0, described.output
        parts = json.loads(described.stdout)["parts"]
        assert [(p["part"], p["shard"], p["partitions"], p["journal_backlog"])
                for p in parts] == [(k, k, [k, k + 4], 0) for k in range(4)]
        assert all(p["owner"] is not None and p["owner"]["running"] for p in parts)
        text = _qlayer(settings, "queue", "describe", "Split").stdout
        assert "part 3" in text and "shard 3, partitions 3, 7, backlog 0" in text
        # `qlayer coordinators` shows which parts each shard serves.
        listed = CliRunner().invoke(app, ["coordinators", "--json", "--database-url",
                                          settings.database_url], catch_exceptions=False)
        assert listed.exit_code == 0, listed.output
        shards = json.loads(listed.stdout)["shards"]
        assert [(s["shard"], s["parts"], s["queues"]) for s in shards] == [
            (k, [f"Split[{k}]"], 1) for k in range(4)]
    acked, late = audit(read_events(settings, {"Split"}))
    assert len(acked) == total and max(acked.values()) == 1
    assert late == []


def test_refused_combinations_and_operations_of_a_partitioned_queue_say_why_in_one_line(
    settings: Settings, journal: Callable[..., str]
) -> None:
    topic = journal("refused", partitions=4)
    put_queues(settings, {"name": "Parted", "underlying_topic": topic, "parts": 2})
    with QueueService.from_settings(settings) as service:
        with pytest.raises(QueueConfigError, match=r"parts.*cannot change on a live queue"):
            service.apply(f"queues:\n  - name: Parted\n    underlying_topic: {topic}\n"
                          "    parts: 3\n")
        with pytest.raises(QueueConfigError, match=r"5 parts need 5 shards.*has 4"):
            service.apply(f"queues:\n  - name: TooMany\n    underlying_topic: {topic}\n"
                          "    parts: 5\n")
        with pytest.raises(InvalidQueueFileError, match="cannot be combined with barrier"):
            service.apply(f"queues:\n  - name: Barred\n    underlying_topic: {topic}\n"
                          "    parts: 2\n    barrier_expression: /b = 1\n")
        for refused in (lambda: service.purge("Parted"), lambda: service.ack("Parted", "/a = 1"),
                        lambda: service.reset("Parted", "beginning")):
            with pytest.raises(PartitionedQueueError, match="queue Parted has 2 parts"):
                refused()
    # The command line says it in one line, and fails.
    purged = subprocess.run(
        [str(Path(sys.executable).parent / "qlayer"), "queue", "purge", "Parted",
         "--database-url", settings.database_url], capture_output=True, text=True, timeout=60,
        check=False)
    assert purged.returncode == 1
    [line] = purged.stderr.splitlines()
    assert line.startswith("error: queue Parted has 2 parts: a purge of a queue of several "
                           "parts is not supported yet"), line


def _qlayer(settings: Settings, *args: str) -> Result:
    flags = ["--bootstrap-servers", settings.bootstrap_servers,
             "--database-url", settings.database_url, "--topic-prefix", settings.topic_prefix]
    return CliRunner().invoke(app, [*args, *flags], catch_exceptions=False,
                              env={"COLUMNS": "250"})


def test_a_key_groups_queue_of_parts_keeps_one_in_flight_per_key_and_its_cap_over_the_parts(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """A key is in one journal partition, so in one part: a consumer holding many messages
    of a key-groups queue of 2 parts holds at most one of each key. The queue's
    max_per_subscription_backlog (40) holds over both parts together (each part's shard
    applies it to its part; the SDK to the whole queue), not 40 per part."""
    topic = journal("keyed", partitions=4)
    put_queues(settings, {"name": "Keyed", "underlying_topic": topic, "parts": 2,
                          "key_groups": True, "lease_period": "120s",
                          "max_per_subscription_backlog": 40})
    total = 120  # keys 0..96: 23 keys have two messages
    with running_coordinator(settings):
        produce_numbers(settings.bootstrap_servers, topic, total)
        with QueueConsumer("Keyed", max_backlog=100,
                           bootstrap_servers=settings.bootstrap_servers,
                           topic_prefix=settings.topic_prefix) as consumer:
            held = _hold(consumer, 40)
            assert consumer.receive(timeout=2.0) is None, "more than 40 held over the parts"
            keys = Counter(m.key for m in held)
            assert max(keys.values()) == 1, "two messages of one key in flight"
            assert {m.bookmark.partition % 2 for m in held} == {0, 1}  # from both parts
            got = [(m.queue, str(m.bookmark)) for m in held]
            for message in held:
                message.ack()
            _drain(consumer, total, got)
            assert len(set(got)) == len(got) == total


def test_a_queue_of_four_parts_over_two_processes_loses_nothing_when_one_is_sigkilled(
    settings: Settings, journal: Callable[..., str], tmp_path: Path,
    processes: list[CoordinatorSubprocess | ConsumerWorker],
) -> None:
    """Issue 32: 4 parts on the 4 shards of two coordinator processes, 4 consumer processes
    (max_backlog 50 each) on the queue by name; SIGKILL one coordinator mid-stream: the
    other takes its parts. Every message is received, none is acked twice or delivered after
    its ack, and no consumer holds more than 50 leases over the parts at any sampled
    instant."""
    topic = journal("busy", partitions=8)
    put_queues(settings, {"name": "Busy", "underlying_topic": topic, "parts": 4, "shard": 0,
                          "max_per_subscription_backlog": 50, "lease_period": "30s"})
    coordinators = [CoordinatorSubprocess(settings, tmp_path, f"p{i}") for i in range(2)]
    processes.extend(coordinators)
    total = 4000
    with Store(settings.database_url) as store:
        def owners() -> dict[int, str | None]:
            return {int(o.shard): o.owner_id for o in store.owners()}

        wait_until(lambda: len(owners()) == 4 and len(set(owners().values())) == 2, 90,
                   what="2 processes running the 4 shards")
        workers = [ConsumerWorker(settings, tmp_path, f"b{i}", ["Busy"]) for i in range(4)]
        processes.extend(workers)

        def received() -> int:
            return sum(len(w.received()) for w in workers)

        most = 0

        def sample() -> None:
            nonlocal most
            held = Counter(r.lease_consumer for r in store.load_entries("Busy")
                           if r.state == "LEASED")
            most = max([most, *held.values()])

        produce_numbers(settings.bootstrap_servers, topic, total // 2)
        deadline = time.monotonic() + 120
        while received() < total // 4 and time.monotonic() < deadline:
            sample()
        victim = coordinators[1]
        lost = {s for s, o in owners().items() if o == victim.name}
        assert lost, "the victim ran no shard"
        victim.kill()
        produce_numbers(settings.bootstrap_servers, topic, total // 2, start=total // 2)
        wait_until(lambda: all(owners().get(s) == coordinators[0].name for s in lost), 60,
                   what="the killed process's parts taken over")
        deadline = time.monotonic() + 180
        while len({v for w in workers for _, v in w.received()}) < total \
                and time.monotonic() < deadline:
            sample()
            time.sleep(0.1)
        values = {v for w in workers for _, v in w.received()}
        assert values == {str(i) for i in range(total)}, f"{total - len(values)} never came"
        assert most <= 50, f"a consumer held {most} leases over the parts"
        wait_until(lambda: sum(store.load_recovery_points("Busy").values()) == total, 60,
                   what="every message acked")
    acked, late = audit(read_events(settings, {"Busy"}))
    assert len(acked) == total
    assert max(acked.values()) == 1, "an entry was acked twice"
    assert late == [], "an entry was delivered after its ack"


def test_moving_a_queue_of_parts_is_refused_in_one_line_and_changes_nothing(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """A move would end the consumers' sessions over the parts under their leases (found by
    a test that held leases across one): refused, by `qlayer queue move` and by a queue file
    asking for another shard, until it is made safe."""
    topic = journal("moving", partitions=4)
    put_queues(settings, {"name": "MovingParts", "underlying_topic": topic, "parts": 2,
                          "shard": 0})
    with Store(settings.database_url) as store:
        before = {o.shard: o.epoch for o in store.owners()}
        with pytest.raises(QueueConfigError, match="a queue of 2 parts cannot be moved yet"):
            store.move_queue("MovingParts", 2, time.time())
        with QueueService.from_settings(settings) as service, \
                pytest.raises(QueueConfigError, match="cannot be moved yet"):
            service.apply(f"queues:\n  - name: MovingParts\n    underlying_topic: {topic}\n"
                          "    parts: 2\n    shard: 2\n")
        record = store.get_queue("MovingParts")
        assert record is not None and record.shard == 0
        assert {o.shard: o.epoch for o in store.owners()} == before  # nobody fenced
    moved = subprocess.run(
        [str(Path(sys.executable).parent / "qlayer"), "queue", "move", "MovingParts",
         "--shard", "2", "--database-url", settings.database_url], capture_output=True,
        text=True, timeout=60, check=False)
    assert moved.returncode == 1
    [line] = moved.stderr.splitlines()
    assert "a queue of 2 parts cannot be moved yet" in line, line


def test_acks_sent_to_another_parts_shard_are_passed_on_and_applied_once(
    settings: Settings, journal: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer that does not know where the parts are (another client, or the SDK before
    the directory shows the queue) sends every ack to the shard that granted the queue last:
    that shard passes each ack of another part's partition on to its part's shard."""
    import layer.sdk.spanning

    monkeypatch.setattr(layer.sdk.spanning, "learn_parts", lambda c: None)
    topic = journal("forwarded", partitions=4)
    put_queues(settings, {"name": "Forwarded", "underlying_topic": topic, "parts": 4,
                          "shard": 0})
    total = 100
    with running_coordinator(settings) as coordinator, Store(settings.database_url) as store:
        produce_numbers(settings.bootstrap_servers, topic, total)
        with QueueConsumer("Forwarded", max_backlog=10,
                           bootstrap_servers=settings.bootstrap_servers,
                           topic_prefix=settings.topic_prefix) as consumer:
            got: list[tuple[str, str]] = []
            _drain(consumer, total, got)
            assert len(set(got)) == len(got) == total
            wait_until(lambda: sum(store.load_recovery_points("Forwarded").values()) == total,
                       30, what="every message acked")
            assert consumer.stats.ack_failures == 0
        assert coordinator.counters["forwarded"] >= 1
