"""The demo's queue file and which queues of earlier runs it clears (pure, no services)."""

from __future__ import annotations

from layer.demo.run import DemoOptions, demo_queues, earlier_demo_queues
from layer.settings import Settings


def test_each_run_gets_its_own_queues_and_journals() -> None:
    first = demo_queues("d000001")
    second = demo_queues("d000002")
    assert {q.name for q in first}.isdisjoint(q.name for q in second)
    assert {q.underlying_topic for q in first}.isdisjoint(q.underlying_topic for q in second)
    assert all(q.name.endswith("_d000001") for q in first)


def test_run_ids_have_the_shape_earlier_runs_are_recognised_by() -> None:
    run = DemoOptions(settings=Settings()).run_id
    assert earlier_demo_queues([f"Jobs_{run}"], "d000000") == [f"Jobs_{run}"]


def test_only_queues_of_other_demo_runs_are_cleared() -> None:
    names = ["Jobs_d123abc", "Jobs_dabcdef", "Jobs", "MyJobs_d123456", "ORDERS_RISK_d000000",
             "FailedJobs_d12345", "Work_d999999x", "Work_D999999"]
    assert earlier_demo_queues(names, "dabcdef") == ["Jobs_d123abc", "ORDERS_RISK_d000000"]
