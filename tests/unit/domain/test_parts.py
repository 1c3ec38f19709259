"""Partitioned queues (`parts: N`, docs/coordinator.md "Partitioned queues"): which part a
journal partition is in, where the parts are served, which definitions are refused, and the
engine of a part taking its parts' partitions only (both cores)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layer.domain.definitions import MAX_PARTS, QueueDefinition
from layer.domain.errors import QueueConfigError
from layer.domain.shards import part_of, part_shards

from .engine_helpers import engine, leases, record, subscribe

pytestmark = pytest.mark.usefixtures("engine_implementation")


def test_partition_p_is_part_p_mod_parts_and_keeps_its_part_when_the_journal_grows() -> None:
    assert [part_of(p, 4) for p in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [part_of(p, 1) for p in range(3)] == [0, 0, 0]


def test_the_parts_are_on_consecutive_shards_from_the_first_parts_shard() -> None:
    assert part_shards(14, 4, 16) == (14, 15, 0, 1)
    assert part_shards(3, 1, 16) == (3,)


@given(st.integers(0, 1023), st.integers(1, 1024), st.integers(1, 1024))
def test_parts_no_more_than_the_shards_are_each_on_a_shard_of_their_own(
        first: int, parts: int, count: int) -> None:
    if parts > count or first >= count:
        return
    shards = part_shards(first, parts, count)
    assert len(set(shards)) == parts and all(0 <= s < count for s in shards)
    assert shards[0] == first


def test_parts_defaults_to_one_and_takes_a_whole_number() -> None:
    assert QueueDefinition.from_mapping({"name": "Q"}).parts == 1
    assert QueueDefinition.from_mapping({"name": "Q", "parts": "4"}).parts == 4
    for bad, why in ((0, "at least 1"), (2.5, "whole number"), (True, "whole number"),
                     (MAX_PARTS + 1, f"at most {MAX_PARTS}")):
        with pytest.raises(QueueConfigError, match=why) as caught:
            QueueDefinition.from_mapping({"name": "Q", "parts": bad})
        assert caught.value.problems[0][0] == "parts"


@pytest.mark.parametrize("field,value", [("barrier_expression", "/kind = 'barrier'"),
                                         ("target_queue_depth", 10)])
def test_rules_of_one_order_over_the_whole_queue_are_refused_with_parts(
        field: str, value: object) -> None:
    with pytest.raises(QueueConfigError) as caught:
        QueueDefinition.from_mapping({"name": "Q", "parts": 4, field: value})
    [(where, why)] = caught.value.problems
    assert where == "parts" and field in why and "no one order" in why
    # One part keeps them.
    assert getattr(QueueDefinition.from_mapping({"name": "Q", field: value}), field) == value


def test_per_part_rules_are_accepted_with_parts() -> None:
    definition = QueueDefinition.from_mapping({
        "name": "Q", "parts": 4, "priority": "/p", "key_groups": True, "max_deliveries": 3,
        "expiration": 60, "filter": "/ok = true"})
    assert definition.parts == 4


def test_an_engine_of_some_parts_takes_the_records_of_their_partitions_only() -> None:
    queue = engine()
    queue.serve_parts(4, frozenset({1, 3}))
    assert [queue.serves(p) for p in range(8)] == [False, True, False, True] * 2
    records = [record(o, {"n": o}, partition=p) for o in range(2) for p in range(8)]
    records.sort(key=lambda r: (r.partition, r.offset))
    assert queue.enqueue(records, 0.0) == 8
    subscribe(queue, "c", max_backlog=100)
    leased = leases(queue.dispatch(0.0))
    assert sorted({d.bookmark.partition for d in leased}) == [1, 3, 5, 7]
    assert len(leased) == 8
    # The recovery points are of its partitions only: the other parts' shards keep theirs.
    assert sorted(p for _, p in queue.recovery_points()) == [1, 3, 5, 7]


def test_an_engine_of_a_queue_of_one_part_takes_every_partition() -> None:
    queue = engine()
    assert all(queue.serves(p) for p in range(4))
    assert queue.enqueue([record(0, {}, partition=p) for p in range(4)], 0.0) == 4
