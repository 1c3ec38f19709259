"""`qlayer view` and `qlayer stats` against a real coordinator: read-only, and right.

`view` must show exactly the AVAILABLE entries (not leased, not acked, not delayed) and lease
nothing: a consumer that subscribes after it still gets every one of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable

import pytest
from typer.testing import CliRunner, Result

from layer.sdk import QueueConsumer
from layer.settings import Settings
from layer.store.store import Store
from layer_cli.main import app
from tests.support.coordinator import produce, put_queues, running_coordinator, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qv{uuid.uuid4().hex[:8]}.")


def qlayer(settings: Settings, *args: str) -> Result:
    flags = ["--bootstrap-servers", settings.bootstrap_servers,
             "--database-url", settings.database_url, "--topic-prefix", settings.topic_prefix]
    return CliRunner().invoke(app, [*args, *flags], catch_exceptions=False,
                              env={"COLUMNS": "250"})


def viewed(settings: Settings, *args: str) -> list[int]:
    result = qlayer(settings, "view", *args, "--json")
    assert result.exit_code == 0, result.output
    return [json.loads(e["value"])["n"] for e in json.loads(result.stdout)["entries"]]


def stored_states(settings: Settings, queue: str) -> dict[int, str]:
    with Store(settings.database_url) as store:
        return {row.offset: row.state for row in store.load_entries(queue)}


def recovery_point(settings: Settings, queue: str) -> int | None:
    with Store(settings.database_url) as store:
        points = list(store.load_recovery_points(queue).values())
    return points[0] if points else None


def consumer(settings: Settings, queue: str, max_backlog: int) -> QueueConsumer:
    return QueueConsumer(queue, settings.bootstrap_servers, topic_prefix=settings.topic_prefix,
                         max_backlog=max_backlog)


def test_view_shows_exactly_the_available_entries_and_leases_nothing_and_stats_agree(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Work"), partitions=1)
    put_queues(settings,
               {"name": "Work", "underlying_topic": work},
               {"name": "Urgent", "underlying_topic": work, "priority": "/p",
                "filter": "/n < 6"})
    priorities = [1, 5, 3, 5, 0, 9]
    produce(settings.bootstrap_servers, work,
            [json.dumps({"n": n, "p": p}).encode() for n, p in enumerate(priorities)])
    with running_coordinator(settings):
        # Delayed by an hour: in the queue, but not available now.
        later = CliRunner().invoke(app, ["publish", work, "--deliver-at", "+1h",
                                         "--bootstrap-servers", settings.bootstrap_servers,
                                         "--topic-prefix", settings.topic_prefix],
                                   input=json.dumps({"n": 6, "p": 100}) + "\n")
        assert later.exit_code == 0, later.output
        holder = consumer(settings, "Work", max_backlog=1)
        try:
            first = holder.receive(timeout=15)
            assert first is not None and first.json()["n"] == 0
            first.ack()
            held = holder.receive(timeout=15)
            assert held is not None and held.json()["n"] == 1
            # The ack moved the recovery point past n=0 (its row is pruned then).
            wait_until(lambda: (stored_states(settings, "Work") == {1: "LEASED"}
                                and recovery_point(settings, "Work") == 1) or None,
                       what="n=0 acked and n=1 leased in PostgreSQL")

            assert viewed(settings, "Work") == [2, 3, 4, 5]
            assert viewed(settings, "Work", "--filter", "/n >= 4") == [4, 5]
            assert viewed(settings, "Work", "--limit", "2") == [2, 3]
            # Priority first (highest), ties by age; the queue's own filter applies.
            assert viewed(settings, "Urgent") == [5, 1, 3, 2, 0, 4]
            table = qlayer(settings, "view", "Urgent")
            assert table.exit_code == 0 and "6 available entries" in table.stdout

            result = qlayer(settings, "stats", "--json")
            assert result.exit_code == 0, result.output
            figures = {q["queue"]: q for q in json.loads(result.stdout)["queues"]}
            work_stats, urgent_stats = figures["Work"], figures["Urgent"]
            # 7 records, 1 acked: 6 not done (one leased, one delayed), one consumer.
            assert (work_stats["depth"], work_stats["leased"], work_stats["consumers"]) == (
                6, 1, 1)
            assert work_stats["counters"]["acked"] == 1
            assert work_stats["counters"]["delivered"] == 2
            assert work_stats["counters"]["enqueued"] == 7
            assert work_stats["partitions"] == [{"topic": work, "partition": 0,
                                                 "recovery_point": 1, "end_offset": 7,
                                                 "lag": 6}]
            assert 0 <= work_stats["oldest_available_age"] < 300
            # One sample, at once: no rates without a second one (--watch).
            assert work_stats["rates"] is None
            assert (urgent_stats["depth"], urgent_stats["leased"],
                    urgent_stats["consumers"]) == (7, 0, 0)
            people = qlayer(settings, "stats", "Work")
            assert people.exit_code == 0 and "recovery-point lag" in people.stdout
            assert "(/s)" not in people.stdout
            # --watch: every sample after the first carries the rates over --interval.
            watch = subprocess.Popen(
                [sys.executable, "-m", "layer_cli.main", "stats", "Work", "--watch", "--json",
                 "--interval", "0.2"], stdout=subprocess.PIPE, text=True,
                env={**os.environ, "QLAYER_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
                     "QLAYER_DATABASE_URL": settings.database_url,
                     "QLAYER_TOPIC_PREFIX": settings.topic_prefix,
                     "QLAYER_CONFIG": os.devnull})
            try:
                assert watch.stdout is not None
                samples = [json.loads(watch.stdout.readline())["queues"][0] for _ in range(2)]
            finally:
                watch.kill()
                watch.wait(10)
            assert samples[0]["rates"] is None
            assert set(samples[1]["rates"]) == {"enqueued", "delivered", "acked",
                                                "redelivered", "rejected", "dead_lettered",
                                                "expired"}
        finally:
            holder.close()

        # Nothing was leased by the views: the next consumers get every available entry.
        with consumer(settings, "Work", max_backlog=10) as late:
            got = [m for m in iter(lambda: late.receive(timeout=5), None)]
            for m in got:
                m.ack()
        assert sorted(m.json()["n"] for m in got) == [1, 2, 3, 4, 5]
        with consumer(settings, "Urgent", max_backlog=10) as late:
            urgent = [m for m in iter(lambda: late.receive(timeout=5), None)]
            for m in urgent:
                m.ack()
        assert sorted(m.json()["n"] for m in urgent) == [0, 1, 2, 3, 4, 5]


def test_view_lists_only_the_active_entries_of_a_queue_with_a_target_depth(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    """AMPS TargetQueueDepth: inactive messages "do not appear in a sow query". With a depth
    of 3, one entry leased and one acked, the active part is the first three entries not
    done; view shows the two of them that are available, never the inactive ones."""
    work = create_topic(unique_name("Deep"), partitions=1)
    put_queues(settings, {"name": "Deep", "underlying_topic": work, "target_queue_depth": 3,
                          "lease_period": "5m"})
    produce(settings.bootstrap_servers, work,
            [json.dumps({"n": n}).encode() for n in range(8)])
    # Before any coordinator ran: the first three records are the active part.
    assert viewed(settings, "Deep") == [0, 1, 2]
    with running_coordinator(settings):
        holder = consumer(settings, "Deep", max_backlog=1)
        try:
            first = holder.receive(timeout=15)
            assert first is not None and first.json()["n"] == 0
            first.ack()
            held = holder.receive(timeout=15)
            assert held is not None and held.json()["n"] == 1
            wait_until(lambda: (stored_states(settings, "Deep") == {1: "LEASED"}
                                and recovery_point(settings, "Deep") == 1) or None,
                       what="n=0 acked and n=1 leased in PostgreSQL")
            # Active: 1 (leased), 2, 3; shown: the available ones.
            assert viewed(settings, "Deep") == [2, 3]
            assert viewed(settings, "Deep", "--filter", "/n > 2") == [3]
            assert viewed(settings, "Deep", "--limit", "1") == [2]
        finally:
            holder.close()


def test_as_a_subprocess_settings_from_the_environment_errors_in_one_line(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Plain"), partitions=2)
    put_queues(settings, {"name": "Plain", "underlying_topic": work})
    produce(settings.bootstrap_servers, work, [b'{"n": 1}', b"not json"])
    env = {**os.environ, "QLAYER_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
           "QLAYER_DATABASE_URL": settings.database_url,
           "QLAYER_TOPIC_PREFIX": settings.topic_prefix, "QLAYER_CONFIG": os.devnull}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "layer_cli.main", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    # No coordinator ever ran: view reads the stored state and the journal all the same.
    shown = run("view", "Plain", "--json")
    assert shown.returncode == 0, shown.stderr
    assert {e["value"] for e in json.loads(shown.stdout)["entries"]} == {'{"n": 1}', "not json"}
    stats = run("stats", "Plain", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["queues"][0]["depth"] == 2

    missing = run("dlq", "list", "Nope")
    assert missing.returncode == 1
    assert missing.stderr == "error: unknown queue 'Nope'\n"
    bad_filter = run("view", "Plain", "--filter", "/n = = 1")
    assert bad_filter.returncode == 1
    assert bad_filter.stderr.startswith("error: ") and bad_filter.stderr.count("\n") == 1
    usage = run("consume", "Plain", "--release", "--reject")
    assert usage.returncode == 2
    assert "give --release or --reject, not both" in usage.stderr
