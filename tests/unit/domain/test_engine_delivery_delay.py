"""A queue-wide delivery delay (`delivery_delay`, SQS's DelaySeconds: "the length of time, in
seconds, for which the delivery of all messages in the queue is delayed")."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from layer.domain.definitions import QueueDefinition
from layer.domain.states import EntryState

from .engine_helpers import bm, engine, leases, record, subscribe

pytestmark = pytest.mark.usefixtures("engine_implementation")


def test_entries_wait_the_delay_from_their_record_timestamp() -> None:
    queue = engine(delivery_delay="10s")
    queue.enqueue([record(0, "a", timestamp=100.0), record(1, "b", timestamp=103.0)], 104.0)
    subscribe(queue, "c", max_backlog=5, now=104.0)
    assert leases(queue.dispatch(104.0)) == []
    assert queue.entry(bm(0)).state is EntryState.DELAYED
    queue.tick(110.0)
    assert [d.bookmark.offset for d in leases(queue.dispatch(110.0))] == [0]
    queue.tick(113.0)
    assert [d.bookmark.offset for d in leases(queue.dispatch(113.0))] == [1]


def test_a_record_older_than_the_delay_is_available_at_once() -> None:
    """A replay after a restart: the delay counts from the record, not from the replay."""
    queue = engine(delivery_delay="10s")
    queue.enqueue([record(0, "old", timestamp=50.0)], 200.0)
    subscribe(queue, "c", now=200.0)
    assert [d.bookmark.offset for d in leases(queue.dispatch(200.0))] == [0]


def test_a_later_deliver_at_of_the_record_wins() -> None:
    queue = engine(delivery_delay="5s")
    queue.enqueue([record(0, "x", timestamp=0.0, deliver_at=60.0),
                   record(1, "y", timestamp=0.0, deliver_at=1.0)], 0.0)
    subscribe(queue, "c", max_backlog=5)
    queue.tick(5.0)
    assert [d.bookmark.offset for d in leases(queue.dispatch(5.0))] == [1]
    queue.tick(60.0)
    assert [d.bookmark.offset for d in leases(queue.dispatch(60.0))] == [0]


@pytest.mark.parametrize("value", ["-1s", "25h", "soon"])
def test_a_delay_out_of_bounds_is_refused(value: str) -> None:
    with pytest.raises(ValidationError, match="delivery_delay"):
        QueueDefinition(name="Q", underlying_topic="Work", delivery_delay=value)


def test_no_delay_by_default() -> None:
    assert QueueDefinition(name="Q", underlying_topic="Work").delivery_delay == 0.0
