"""A transactional consumer's leases wait for a fence (exactly-once processing, docs/sdk.md
"Exactly-once processing"): the consumer settles inside its own Kafka transaction, so a lease
that runs out may still have a committed ACCEPT on its way. Nothing of it is given to another
consumer until the coordinator has fenced the consumer's producer and applied what it
committed (`fenced`)."""

from __future__ import annotations

import pytest

from layer.domain.events import ConsumerLeft, EntryLeased, LeaseBroken, LeaseExpired
from layer.domain.states import AckOutcome, EntryState, LeaveReason

from .engine_helpers import bm, engine, leases, of_type, offer, settle, subscribe

pytestmark = pytest.mark.usefixtures("engine_implementation")


def _two_consumers(session_timeout: float = 1e6):  # type: ignore[no-untyped-def]
    queue = engine(lease_period="10s", session_timeout=session_timeout)
    offer(queue, ["0", "1", "2"])
    subscribe(queue, "tx", session=None, max_backlog=2)
    assert queue.set_transactional("tx")
    held = leases(queue.dispatch(0.0))
    subscribe(queue, "other", session=None, max_backlog=5)
    queue.drain()
    return queue, held


def test_a_transactional_lease_that_runs_out_is_held_until_the_fence() -> None:
    queue, (first, second) = _two_consumers()
    for now in (10.0, 11.0):
        queue.heartbeat("tx", now)
        queue.heartbeat("other", now)
        queue.tick(now)
        queue.dispatch(now)
    # Past its deadline, still leased to tx: nothing went to the other consumer but the
    # entry nobody held.
    assert queue.entry(first.bookmark).state is EntryState.LEASED
    assert queue.entry(second.bookmark).state is EntryState.LEASED
    assert queue.take_fences() == ["tx"]
    assert queue.take_fences() == []  # handed out once
    # The ACCEPT the consumer committed before it was fenced still settles its entry.
    assert settle(queue, first, now=11.5) is AckOutcome.APPLIED
    queue.drain()
    assert queue.fenced("tx", 12.0)
    events = queue.drain().events
    # The lease that ran out expires as any lease does; the session ends and the rest break.
    assert [e.bookmark for e in of_type(events, LeaseExpired)] == [second.bookmark]
    (left,) = of_type(events, ConsumerLeft)
    assert left.reason is LeaveReason.SESSION_TIMEOUT  # type: ignore[attr-defined]
    assert queue.entry(first.bookmark).state is EntryState.ACKED
    redelivered = leases(queue.dispatch(12.0))
    assert second.bookmark in [d.bookmark for d in redelivered]
    assert {d.consumer_id for d in redelivered} == {"other"}


def test_leases_still_running_are_broken_when_the_session_ends_after_the_fence() -> None:
    queue, (first, second) = _two_consumers()
    settle(queue, first, now=1.0)
    queue.drain()
    queue.tick(10.0)
    assert queue.take_fences() == ["tx"]
    queue.fenced("tx", 10.0)
    events = queue.drain().events
    assert [e.bookmark for e in of_type(events, LeaseExpired)] == [second.bookmark]
    assert not of_type(events, LeaseBroken)
    assert [c.consumer_id for c in queue.consumers()] == ["other"]


def test_a_transactional_session_that_times_out_waits_for_the_fence() -> None:
    queue, (first, _second) = _two_consumers(session_timeout=5.0)
    queue.heartbeat("other", 6.0)
    queue.tick(6.0)
    assert [c.consumer_id for c in queue.consumers()] == ["tx", "other"]
    assert queue.take_fences() == ["tx"]
    # The loop is not woken again and again for a held consumer's deadlines.
    deadline = queue.next_deadline()
    assert deadline is not None and deadline > 6.0
    queue.fenced("tx", 6.5)
    events = queue.drain().events
    (left,) = of_type(events, ConsumerLeft)
    assert left.consumer_id == "tx"  # type: ignore[attr-defined]
    assert {e.bookmark for e in of_type(events, LeaseBroken)} == {first.bookmark, bm(1)}
    assert queue.entry(first.bookmark).state is EntryState.AVAILABLE


def test_a_plain_consumer_loses_its_lease_at_the_deadline_as_before() -> None:
    queue = engine(lease_period="10s")
    offer(queue, ["0"])
    subscribe(queue, "plain", session=None)
    (lease,) = leases(queue.dispatch(0.0))
    queue.tick(10.0)
    assert queue.entry(lease.bookmark).state is EntryState.AVAILABLE
    assert queue.take_fences() == []
    assert not queue.fenced("plain-gone", 10.0)


def test_a_consumer_that_unsubscribes_while_held_needs_no_fence_any_more() -> None:
    queue, _held = _two_consumers()
    queue.tick(10.0)
    queue.unsubscribe("tx", 10.5)
    assert queue.take_fences() == []
    assert not queue.fenced("tx", 11.0)
    assert not [e for e in queue.drain().events if isinstance(e, EntryLeased)]
    assert not queue.set_transactional("nobody")
