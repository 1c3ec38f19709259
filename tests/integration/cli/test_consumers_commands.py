"""`qlayer consumers [QUEUE]` and `qlayer consumers evict ID` against the real services."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from typer.testing import Result

from layer.protocol import SessionEnded, SessionEndReason
from layer.settings import Settings
from layer.store.store import Store
from tests.integration.cli.conftest import Completed, attach_consumer
from tests.support.coordinator import RawConsumer, produce, running_coordinator, wait_until

pytestmark = pytest.mark.integration


def test_consumers_lists_every_subscription_or_those_of_one_queue(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed]
) -> None:
    assert invoke("queue", "create", "Jobs", "--max-backlog", "4").exit_code == 0
    assert invoke("queue", "create", "Mail").exit_code == 0
    attach_consumer(settings, "w1", "Jobs", max_backlog=10, filter="/kind = 'x'",
                    heartbeat_age=12)
    attach_consumer(settings, "w2", "Jobs")
    attach_consumer(settings, "m1", "Mail", max_backlog=3)

    everyone = run_cli("consumers", "--json")
    assert everyone.code == 0, everyone.stderr
    assert [c["consumer_id"] for c in json.loads(everyone.stdout)] == ["w1", "w2", "m1"]

    jobs = run_cli("consumers", "Jobs", "--json")
    assert jobs.code == 0, jobs.stderr
    by_id = {c["consumer_id"]: c for c in json.loads(jobs.stdout)}
    assert set(by_id) == {"w1", "w2"}
    # The queue caps the backlog at 4; a consumer that asked for none gets 1 (DESIGN §4).
    assert (by_id["w1"]["max_backlog"], by_id["w1"]["backlog_limit"]) == (10, 4)
    assert (by_id["w2"]["max_backlog"], by_id["w2"]["backlog_limit"]) == (None, 1)
    assert by_id["w1"]["filter"] == "/kind = 'x'"
    assert 11 <= by_id["w1"]["heartbeat_age"] < 60
    assert by_id["w1"]["delivery_topic"] == f"{settings.topic_prefix}delivery.w1"

    table = run_cli("consumers", "Mail")
    assert table.code == 0
    assert "m1" in table.stdout and "w1" not in table.stdout
    # No coordinator runs anything here: nobody to name.
    assert {c["owner_id"] for c in json.loads(everyone.stdout)} == {None}


def test_consumers_of_an_unknown_queue_and_evicting_an_unknown_id_say_what_to_do(
    run_cli: Callable[..., Completed]
) -> None:
    listed = run_cli("consumers", "Nope")
    assert (listed.code, listed.stderr) == (
        1, "error: no queue named Nope; see `qlayer queue list`\n")
    evicted = run_cli("consumers", "evict", "nobody")
    assert (evicted.code, evicted.stderr) == (
        1, "error: no consumer with id nobody; see `qlayer consumers`\n")


def test_evict_is_recorded_without_a_coordinator(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed]
) -> None:
    assert invoke("queue", "create", "Jobs").exit_code == 0
    attach_consumer(settings, "w1", "Jobs")
    done = run_cli("consumers", "evict", "w1")
    assert done.code == 0, done.stderr
    assert "eviction of consumer w1 requested" in done.stdout
    with Store(settings.database_url) as store:
        (row,) = store.load_consumers()
    assert row.evict_requested_at is not None
    waited = run_cli("consumers", "evict", "w1", "--wait", "--timeout", "0.5")
    assert waited.code == 1
    assert "no coordinator carried it out within 0.5s" in waited.stderr


def test_evict_moves_the_consumers_leases_to_another_consumer(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed],
    journal: Callable[..., str]
) -> None:
    work = journal("work", partitions=1)
    assert invoke("queue", "create", "Work", "--underlying-topic", work,
                  "--lease-period", "120s").exit_code == 0
    produce(settings.bootstrap_servers, work, [f"job {i}".encode() for i in range(4)])
    with running_coordinator(settings) as coordinator:
        # Neither heartbeats while the CLI runs (seconds a command on a loaded machine, where
        # the default 10 s session once timed out before `evict` found the victim): a minute.
        victim = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Work",
                             max_backlog=4, consumer_id="victim", session_timeout_ms=60_000)
        other = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Work",
                            max_backlog=4, consumer_id="other", session_timeout_ms=60_000)
        try:
            victim.subscribe()
            held = victim.receive(4)
            other.subscribe()
            listed = json.loads(run_cli("consumers", "Work", "--json").stdout)
            assert sorted(c["consumer_id"] for c in listed) == ["other", "victim"]
            # Where each session lives: the queue's shard, and the process running it.
            shard = json.loads(run_cli("queue", "describe", "Work", "--json").stdout)["shard"]
            owner = coordinator.options.owner_id
            assert {(c["shard"], c["owner_id"]) for c in listed} == {(shard, owner)}
            assert f"{shard} ({owner})" in run_cli("consumers", "Work").stdout

            evicted = run_cli("consumers", "evict", "victim", "--wait", "--timeout", "30")
            assert evicted.code == 0, evicted.stderr
            assert evicted.stdout.startswith("evicted consumer victim")
            # Long before the 120 s leases would end, the entries go to the other consumer.
            moved = other.receive(4, timeout=20)
            assert sorted(d.bookmark for d in moved) == sorted(d.bookmark for d in held)

            def told() -> bool:
                victim.poll(0.2)  # replies arrive on its delivery topic
                return any(isinstance(r, SessionEnded) and r.reason is SessionEndReason.EVICTED
                           for r in victim.replies)

            wait_until(told, what="SessionEnded(EVICTED) for the victim")
            remaining = json.loads(run_cli("consumers", "--json").stdout)
            assert [c["consumer_id"] for c in remaining] == ["other"]
        finally:
            victim.close()
            other.close()
