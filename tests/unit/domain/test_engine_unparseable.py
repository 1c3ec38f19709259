"""Records whose value is not JSON, read by the queue's own expressions: decided as the
reference says ("a filter that cannot be evaluated is false"; AMPS reads a priority that is
"NULL and non-numeric" as the lowest) and counted for the coordinator (`take_unparseable`)."""

from __future__ import annotations

import pytest

from layer.domain.expressions import RawDocument
from layer.domain.states import EntryState

from .engine_helpers import bm, engine, leases, record, subscribe

pytestmark = pytest.mark.usefixtures("engine_implementation")


def raw(value: bytes) -> RawDocument:
    return RawDocument(value)


def test_a_queue_filter_refuses_a_value_that_is_not_json_and_counts_it() -> None:
    queue = engine(filter="/kind = 'job'")
    queue.enqueue([record(0, raw(b'{"kind": "job"}')), record(1, raw(b"<xml/>")),
                   record(2, raw(b"null")), record(3, raw(b"\xff\xfe"))], 0.0)
    assert queue.entry(bm(0)).state is EntryState.AVAILABLE
    assert queue.entry(bm(1)) is None and queue.entry(bm(3)) is None
    # `null` is JSON: refused by the filter, but not a value that cannot be parsed.
    assert queue.take_unparseable() == (2, bm(1))
    assert queue.take_unparseable() == (0, None)


def test_an_unparseable_value_gets_the_lowest_priority_and_is_counted() -> None:
    queue = engine(priority="/p")
    queue.enqueue([record(0, raw(b"garbage")), record(1, raw(b'{"p": 1}')),
                   record(2, raw(b'{"p": 9}'))], 0.0)
    subscribe(queue, "c", max_backlog=3)
    assert [d.bookmark.offset for d in leases(queue.dispatch(0.0))] == [2, 1, 0]
    assert queue.take_unparseable() == (1, bm(0))


def test_a_queue_without_expressions_never_parses_so_counts_nothing() -> None:
    queue = engine()
    queue.enqueue([record(0, raw(b"garbage"))], 0.0)
    subscribe(queue, "c")
    assert [d.bookmark.offset for d in leases(queue.dispatch(0.0))] == [0]
    assert queue.take_unparseable() == (0, None)
