"""Deleting the delivery topics no session uses (`layer.coordinator.topicsweep`)."""

from __future__ import annotations

import pytest

from layer.coordinator.catalog import Catalog
from layer.coordinator.core import ShardCore
from layer.coordinator.options import CoordinatorOptions
from layer.coordinator.ports import FakeTopicAdmin
from layer.coordinator.sessions import Session
from layer.coordinator.topicsweep import DeliveryTopicSweep, OrphanClock, sweep_interval
from layer.protocol import TopicNames

TOPICS = TopicNames("qt.")


def test_a_topic_goes_once_no_session_used_it_for_the_retention() -> None:
    clock = OrphanClock(60.0)
    assert clock.due(["d.a", "d.b"], {"d.b"}, now=100.0) == []
    assert clock.due(["d.a", "d.b"], {"d.b"}, now=159.0) == []
    assert clock.due(["d.a", "d.b"], {"d.b"}, now=160.0) == ["d.a"]


def test_a_topic_used_again_starts_its_clock_afresh() -> None:
    clock = OrphanClock(60.0)
    clock.due(["d.a"], set(), now=0.0)
    clock.due(["d.a"], {"d.a"}, now=50.0)  # the same consumer id subscribed again
    assert clock.due(["d.a"], set(), now=70.0) == []
    assert clock.due(["d.a"], set(), now=130.0) == ["d.a"]


def test_a_topic_in_use_is_never_due() -> None:
    clock = OrphanClock(1.0)
    for now in range(0, 10_000, 100):
        assert clock.due(["d.live"], {"d.live"}, now=float(now)) == []


def test_a_retention_of_zero_is_not_a_clock() -> None:
    with pytest.raises(ValueError, match="positive"):
        OrphanClock(0.0)
    with pytest.raises(ValueError, match="never delete"):
        CoordinatorOptions(delivery_topic_retention=-1.0)


def test_topics_are_listed_at_most_once_a_second_and_at_least_once_a_minute() -> None:
    assert sweep_interval(0.5) == 1.0
    assert sweep_interval(10.0) == 5.0
    assert sweep_interval(3600.0) == 60.0


def _core(admin: FakeTopicAdmin) -> ShardCore:
    return ShardCore(0, CoordinatorOptions(owner_id="test", core="python"), topics=TOPICS,
                     catalog=lambda: Catalog.of(1, [], [], now=0.0), admin=admin,
                     tokens=lambda: "tok", owner_id="test")


def test_the_sweep_deletes_only_orphaned_delivery_topics_and_counts_them() -> None:
    admin = FakeTopicAdmin({"qt.delivery.gone": 1, "qt.delivery.stored": 1,
                            "qt.delivery.here": 1, "qt.control": 2, "orders": 3,
                            "other.delivery.x": 1})
    core = _core(admin)
    core.known_topics = {"qt.delivery.gone", "qt.delivery.here"}
    # A session of this shard not stored yet, and one of another shard that is.
    core.sessions["here"] = Session("here", "s1", "Work", False, None, None,
                                    "qt.delivery.here", 30.0, 0.0, ["Work"])
    sweep = DeliveryTopicSweep(core, admin, lambda: {"qt.delivery.stored"}, retention=10.0)
    assert sweep.run_once(now=0.0) == []
    assert sweep.run_once(now=4.0) == [], "not due for another listing"
    assert sweep.run_once(now=10.0) == ["qt.delivery.gone"]
    assert set(admin.partitions) == {"qt.delivery.stored", "qt.delivery.here", "qt.control",
                                     "orders", "other.delivery.x"}
    assert core.counters["delivery_topics_deleted"] == 1
    assert "qt.delivery.gone" not in core.known_topics
    assert sweep.run_once(now=100.0) == []
