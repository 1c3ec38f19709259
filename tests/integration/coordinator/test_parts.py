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
from tests.support.coordinator import put_queues, running_coordinator
from tests.support.processes import audit, produce_numbers, read_events

pytestmark = pytest.mark.integration


def _drain(consumer: QueueConsumer, want: int, got: list[tuple[str, str]],
           timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        message = consumer.receive(timeout=0.5)
        if message is not None:
            got.append((message.queue, str(message.bookmark)))
            message.ack()


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
            held: list[Message] = []
            deadline = time.monotonic() + 60
            while len(held) < 3 and time.monotonic() < deadline:
                message = consumer.receive(timeout=0.5)
                if message is not None:
                    held.append(message)
            assert len(held) == 3
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
