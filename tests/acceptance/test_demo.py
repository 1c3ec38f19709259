"""`qlayer demo` end to end, as a real subprocess against the suite's Kafka and PostgreSQL.

The demo is given the suite's endpoints (so it does not start a local stack), an empty
database (so it migrates it) and a topic prefix of its own (so no other test's coordinator
answers its consumers).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from layer.store.store import Store

pytestmark = pytest.mark.acceptance


def demo(bootstrap_servers: str, database_url: str, prefix: str,
         *extra: str, state_home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QLAYER_")}
    if state_home is not None:
        env["XDG_STATE_HOME"] = str(state_home)
    return subprocess.run(
        [sys.executable, "-m", "layer_cli.main", "demo", "--bootstrap-servers", bootstrap_servers,
         "--database-url", database_url, "--topic-prefix", prefix, *extra],
        capture_output=True, text=True, env=env, timeout=170, check=False)


def test_demo_shows_every_headline_feature_and_runs_again(
        bootstrap_servers: str, empty_database_url: str,
        unique_name: Callable[[str], str], tmp_path: Path) -> None:
    prefix = unique_name("demo") + "."
    started = time.monotonic()
    first = demo(bootstrap_servers, empty_database_url, prefix, "--json", state_home=tmp_path)
    took = time.monotonic() - started
    assert first.returncode == 0, first.stderr[-3000:]
    # The SIGKILLed consumer's session secret was kept out of the user's state directory
    # (it never removes its own file; the demo's temporary one went with the demo).
    assert list(tmp_path.rglob("*.secret")) == []
    report: dict[str, Any] = json.loads(first.stdout)
    assert took < 120, f"the demo took {took:.0f}s"

    jobs = report["jobs"]
    dead = {d["id"]: d for d in jobs["dead_letters"]}
    # Every job reached an outcome: acked by a worker, or dead-lettered with its reason.
    assert sorted(jobs["acked"] + list(dead)) == list(range(1, jobs["published"] + 1))
    assert sum(jobs["processed_by"].values()) == len(jobs["acked"])
    assert set(jobs["processed_by"]) == {"worker-1", "worker-2"}
    # The SIGKILLed consumer's leases were broken and its jobs done by the others.
    held = jobs["crashed_held"]
    assert len(held) == 3
    assert set(held) <= set(jobs["acked"])
    assert sorted(int(k) for k in jobs["redelivered_to"]) == sorted(held)
    assert set(jobs["redelivered_to"].values()) <= {"worker-1", "worker-2"}
    assert jobs["counters"]["redelivered"] >= len(held)
    # The rejected job and the one released max_cancels times are dead letters, with reasons.
    assert dead[4]["reason"] == "rejected"
    assert dead[4]["detail"] == "no handler for kind 'poison'"
    assert dead[9]["reason"] == "max_cancels"
    assert jobs["counters"]["dead_lettered"] == 2
    assert jobs["counters"]["acked"] == len(jobs["acked"])

    priority = report["priority"]
    values = priority["values"]
    by_value_then_age = sorted(priority["published_order"],
                               key=lambda n: (-values[n], priority["published_order"].index(n)))
    assert priority["delivered_order"] == by_value_then_age
    assert priority["delivered_order"] != priority["published_order"]

    barrier = report["barrier"]
    assert barrier["acked_before_barrier"] == barrier["earlier"] == 4
    assert barrier["later_delivered_before_barrier"] == 0
    assert barrier["barrier_reached"] == ["teller-1", "teller-2"]
    assert sum(barrier["processed_by"].values()) == 6

    fairness = report["fairness"]
    ratios = {n: fairness["leased"][n] / fairness["max_backlog"][n]
              for n in fairness["max_backlog"]}
    assert set(ratios.values()) == {0.5}, ratios  # proportional: everyone half full

    routes = {r["published_to"]: r for r in report["orders"]}
    assert routes["ORDERS"]["journal"] == "ORDERS"
    assert routes["ORDERS"]["queues"] == ["ORDERS_ANALYTICS", "ORDERS_RISK"]
    assert routes["ORDERS_ANALYTICS"]["journal"] == "ORDERS_ANALYTICS_DIRECT"
    assert routes["ORDERS_ANALYTICS"]["queues"] == ["ORDERS_ANALYTICS"]
    assert routes["ORDERS_RISK"]["journal"] == "ORDERS_RISK_DIRECT"
    assert routes["ORDERS_RISK"]["queues"] == ["ORDERS_RISK"]

    # The demo ran its own coordinator, which stopped with it: it released every shard and
    # left the process registry.
    assert report["own_coordinator"] is True
    with Store(empty_database_url) as store:
        assert store.owners() == []
        assert store.processes() == []
        # The queues stay for looking around, the dead letters waiting in FailedJobs.
        names = {q.name for q in store.list_queues()}
        assert set(report["queues"].values()) <= names

    # Again, on the same database and topics: fresh queues, the same story, told to people.
    second = demo(bootstrap_servers, empty_database_url, prefix)
    assert second.returncode == 0, second.stderr[-3000:]
    text = second.stdout
    # No client library's raw log line in the story (librdkafka's "GETPID [rdkafka#producer-7]
    # ... Coordinator load in progress" leaked once): the coordinator's lines go to a file.
    for run in (first, second):
        assert "rdkafka" not in run.stdout + run.stderr, run.stderr[-3000:]
    assert "crasher (SIGKILLed)" in text
    assert "reason max_cancels" in text and "reason rejected" in text
    assert "delivered C(200) E(100) B(50) F(50) A(10) D(1)" in text
    assert "waited for 4 of 4 earlier trades" in text
    assert "qlayer stats" in text and "qlayer dev down" in text
    second_run = re.search(r"qlayer demo run (d[0-9a-f]{6})", text)
    assert second_run is not None and second_run[1] != report["run"]
    # Only the latest run's queues stay: the first run's were deleted by the second.
    with Store(empty_database_url) as store:
        names = {q.name for q in store.list_queues()}
    assert f"Jobs_{second_run[1]}" in names
    assert names.isdisjoint(report["queues"].values())


def test_demo_without_a_database_says_so_in_one_line(bootstrap_servers: str,
                                                      unique_name: Callable[[str], str]) -> None:
    result = demo(bootstrap_servers, "postgresql+psycopg://postgres@127.0.0.1:1/qlayer",
                  unique_name("demo") + ".")
    assert result.returncode == 1
    assert result.stderr.startswith("error: demo: cannot migrate the database")
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
