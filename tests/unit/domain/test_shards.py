"""Where queues go: explicit shard, shard_group, or a stable hash of the name."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layer.domain.definitions import QueueDefinition
from layer.domain.errors import QueueConfigError
from layer.domain.shards import shard_count_problem, shard_for, shard_key


def test_placement_is_explicit_then_group_then_name() -> None:
    assert shard_for("Work", shard=5, shard_group="orders", shard_count=16) == 5
    assert shard_for("Work", shard=None, shard_group="orders",
                     shard_count=16) == zlib.crc32(b"orders") % 16
    assert shard_for("Work", shard=None, shard_group=None,
                     shard_count=16) == zlib.crc32(b"Work") % 16
    assert shard_key(7) == "7"


def test_a_shard_beyond_the_count_names_the_range() -> None:
    with pytest.raises(ValueError, match=r"shard 16 does not exist.*0\.\.15"):
        shard_for("Work", shard=16, shard_group=None, shard_count=16)


@given(st.text(min_size=1, max_size=40), st.integers(min_value=1, max_value=1024))
def test_a_name_always_lands_on_one_existing_shard(name: str, count: int) -> None:
    placed = shard_for(name, shard=None, shard_group=None, shard_count=count)
    assert 0 <= placed < count
    assert placed == shard_for(name, shard=None, shard_group=None, shard_count=count)


@given(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=10, unique=True),
       st.integers(min_value=1, max_value=64))
def test_queues_of_one_group_share_a_shard(names: list[str], count: int) -> None:
    assert len({shard_for(n, shard=None, shard_group="g", shard_count=count)
                for n in names}) == 1


def test_shard_counts() -> None:
    assert shard_count_problem(16) is None
    assert "between 1 and 1024" in (shard_count_problem(0) or "")
    assert "between 1 and 1024" in (shard_count_problem(1025) or "")
    assert "whole number" in (shard_count_problem(True) or "")


def test_definitions_take_shard_or_shard_group_not_both() -> None:
    assert QueueDefinition.from_mapping({"name": "A", "shard": "3"}).shard == 3
    assert QueueDefinition.from_mapping({"name": "A", "shard_group": " orders "}
                                        ).shard_group == "orders"
    with pytest.raises(QueueConfigError, match="not both"):
        QueueDefinition.from_mapping({"name": "A", "shard": 1, "shard_group": "orders"})
    with pytest.raises(QueueConfigError, match="shard"):
        QueueDefinition.from_mapping({"name": "A", "shard": -1})
    with pytest.raises(QueueConfigError, match="shard_group"):
        QueueDefinition.from_mapping({"name": "A", "shard_group": ""})
