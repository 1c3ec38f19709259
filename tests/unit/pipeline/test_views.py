"""AMPS views over a queue's available entries, on hand-built frames; definition errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pyspark.sql import SparkSession

from layer.domain.errors import ExpressionError
from layer.pipeline.transforms import available_entries, view
from layer.pipeline.views import parse_view
from tests.unit.pipeline.frames import T0, acked, ev, frame, journal, leased

ORDERS = {
    0: {"region": "east", "price": 10, "qty": 2, "status": "new"},
    1: {"region": "east", "price": "2.5", "qty": 4, "status": "new"},  # a number as text
    2: {"region": "west", "price": 7, "qty": 1, "status": "new"},
    3: {"region": "west", "price": 100, "qty": 1, "status": "new"},  # leased
    4: {"region": "east", "price": 1000, "qty": 1, "status": "new"},  # acked
    5: {"region": "west", "price": 3, "qty": 3, "status": "test"},
    6: {"region": "north", "price": 50, "qty": 1, "status": "new"},  # delayed
    7: {"region": "north", "qty": 5, "status": "new"},  # no price
    8: {"region": "west", "price": 9, "qty": 9, "status": "new"},  # released: available
}


def order_events() -> list[dict[str, Any]]:
    events = [ev("ENQUEUED", 0, o) for o in ORDERS if o != 6]
    return [
        *events,
        ev("ENQUEUED", 0, 6, available_at_ms=T0 + 60_000),
        leased(10, 3, "a", 1),
        leased(10, 4, "a", 1), acked(20, 4, "a", 1),
        leased(10, 8, "b", 1), ev("RELEASED", 15, 8, consumer_id="b", delivery_count=1),
    ]


def orders(spark: SparkSession) -> Any:
    return journal(spark, range(9), values={o: json.dumps(d) for o, d in ORDERS.items()})


def rows(frame_: Any) -> dict[Any, dict[str, Any]]:
    return {r[1]: r.asDict() for r in frame_.collect()}


def test_available_entries_are_pending_not_leased_not_delayed(spark: SparkSession) -> None:
    available = available_entries(frame(spark, order_events()), as_of_ms=T0 + 1000)
    assert sorted(r["offset"] for r in available.collect()) == [0, 1, 2, 5, 7, 8]
    pending = available_entries(frame(spark, order_events()), T0 + 1000, include_leased=True)
    assert sorted((r["offset"], r["leased"]) for r in pending.collect()) == [
        (0, False), (1, False), (2, False), (3, True), (5, False), (6, False), (7, False),
        (8, False)]
    # Before the lease of offset 3 and the ack of 4 they were both available.
    earlier = available_entries(frame(spark, order_events()), as_of_ms=T0 + 5)
    assert {3, 4} <= {r["offset"] for r in earlier.collect()}


def test_total_value_of_unprocessed_orders_per_region(spark: SparkSession) -> None:
    definition = parse_view(
        ["/region", "SUM(/price * /qty) AS /total", "COUNT(*) AS /orders",
         "max(/price) as /top"],
        group_by=["/region"], where="/status <> 'test'")
    entries = available_entries(frame(spark, order_events()), as_of_ms=T0 + 1000)
    result = rows(view(entries, orders(spark), definition))
    assert result == {
        "east": {"queue": "Q", "region": "east", "total": 30.0, "orders": 2, "top": 10.0},
        "west": {"queue": "Q", "region": "west", "total": 88.0, "orders": 2, "top": 9.0},
        # No price: null in the product, so SUM and MAX have nothing; still one order.
        "north": {"queue": "Q", "region": "north", "total": None, "orders": 1, "top": None},
    }


def test_expressions_in_groups_and_filters(spark: SparkSession) -> None:
    definition = parse_view(
        ["/qty > 2 AS /bulk", "AVG(/price) AS /avg_price", "COUNT_DISTINCT(/region) AS /regions"],
        group_by=["/qty > 2"],
        where="/region IN ('east', 'west') AND /price BETWEEN 1 AND 50 AND /region LIKE '^[ew]'")
    entries = available_entries(frame(spark, order_events()), as_of_ms=T0 + 1000)
    result = rows(view(entries, orders(spark), definition))
    assert result == {
        False: {"queue": "Q", "bulk": False, "avg_price": 8.5, "regions": 2},
        True: {"queue": "Q", "bulk": True, "avg_price": 4.833333333333333, "regions": 2},
    }


def test_a_view_without_groups_is_one_row(spark: SparkSession) -> None:
    definition = parse_view(["SUM(/qty) AS /units", "COUNT(/price) AS /priced"])
    entries = available_entries(frame(spark, order_events()), as_of_ms=T0 + 1000)
    assert [r.asDict() for r in view(entries, orders(spark), definition).collect()] == [
        {"queue": "Q", "units": 24.0, "priced": 5}]


@pytest.mark.parametrize(("fields", "group_by", "where", "message"), [
    (["SUM(/price * ) AS /t"], [], None, "syntax error: unexpected ')' at column 14"),
    (["/price * /qty"], [], None, "a computed field needs a name: add AS /name"),
    (["/price"], ["/region"], None, "must be one of the grouping expressions"),
    (["MEDIAN(/price) AS /m"], [], None, "unknown function MEDIAN"),
    (["SUM(SUM(/price)) AS /s"], [], None, "aggregates do not nest"),
    (["SUM(/price) AS /a", "COUNT(*) AS /a"], [], None, "two fields are named /a"),
    (["COUNT(*) AS /n"], ["COUNT(/x)"], None, "a grouping cannot contain an aggregate"),
    (["COUNT(*) AS /n"], [], "/price + 1", "a filter must be a condition"),
    (["COUNT(*) AS /n"], [], "SUM(/price) > 3", "a filter cannot contain an aggregate"),
    ([], [], None, "a view needs at least one field"),
])
def test_bad_definitions_are_refused_with_the_reason(
    fields: list[str], group_by: list[str], where: str | None, message: str,
) -> None:
    with pytest.raises(ExpressionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_view(fields, group_by, where)


def test_keywords_case_and_spaces_do_not_matter() -> None:
    definition = parse_view(["/region", "sum(/qty) as /units"], ["  /region "],
                            "not (/qty < 0) AND /region is not null")
    assert [f.name for f in definition.fields] == ["region", "units"]
    assert [f.group for f in definition.fields] == [0, None]
