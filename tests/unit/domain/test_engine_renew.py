"""RENEW with a length (`msg.renew(extend=...)`, protocol 4): the lease ends that long from
now instead of one lease period, longer or shorter, like SQS's ChangeMessageVisibility
("changes the visibility timeout of a specified message ... to a new value")."""

from __future__ import annotations

import pytest

from layer.domain.events import LeaseExpired, LeaseRenewed
from layer.domain.states import AckOutcome, AckType, EntryState

from .engine_helpers import bm, engine, leases, of_type, offer, settle, subscribe

pytestmark = pytest.mark.usefixtures("engine_implementation")


def _held(lease_period: str = "10s"):  # type: ignore[no-untyped-def]
    queue = engine(lease_period=lease_period)
    offer(queue, ["0", "1"])
    subscribe(queue, "a", session=None, max_backlog=2)
    first, second = leases(queue.dispatch(0.0))
    queue.drain()
    return queue, first, second


def test_a_longer_renewal_outlives_the_lease_period() -> None:
    queue, first, second = _held()
    assert settle(queue, first, AckType.RENEW, now=5.0, delay=60.0) is AckOutcome.APPLIED
    (renewed,) = of_type(queue.drain().events, LeaseRenewed)
    assert renewed.deadline == 65.0  # type: ignore[attr-defined]
    queue.heartbeat("a", 20.0)
    queue.tick(20.0)
    # The other lease, taken at the same time and not renewed, ended at 10 s.
    expired = of_type(queue.drain().events, LeaseExpired)
    assert [e.bookmark for e in expired] == [second.bookmark]  # type: ignore[attr-defined]
    assert queue.entry(bm(0)).state is EntryState.LEASED
    queue.heartbeat("a", 64.0)
    queue.tick(64.0)
    assert queue.entry(bm(0)).state is EntryState.LEASED
    assert settle(queue, first, now=64.5) is AckOutcome.APPLIED


def test_a_shorter_renewal_ends_the_lease_sooner() -> None:
    queue, first, _second = _held("60s")
    settle(queue, first, AckType.RENEW, now=1.0, delay=2.0)
    queue.drain()
    queue.tick(2.5)
    assert queue.entry(bm(0)).state is EntryState.LEASED
    queue.tick(3.0)
    expired = of_type(queue.drain().events, LeaseExpired)
    assert [e.bookmark for e in expired] == [first.bookmark]  # type: ignore[attr-defined]
    assert settle(queue, first, now=3.5) is AckOutcome.NOT_LEASED  # the lease is gone


def test_renewing_again_replaces_an_earlier_length() -> None:
    """A short renewal then a plain one: the lease lasts the lease period from the second,
    not the first's earlier end."""
    queue, first, _second = _held("10s")
    settle(queue, first, AckType.RENEW, now=1.0, delay=2.0)  # would end at 3 s
    settle(queue, first, AckType.RENEW, now=2.0)  # ends at 12 s
    queue.tick(5.0)
    assert queue.entry(bm(0)).state is EntryState.LEASED
    assert queue.entry(bm(0)).deadline == 12.0
    settle(queue, first, AckType.RENEW, now=6.0, delay=30.0)  # ends at 36 s
    queue.heartbeat("a", 13.0)
    queue.tick(13.0)
    assert queue.entry(bm(0)).deadline == 36.0
    assert queue.entry(bm(0)).state is EntryState.LEASED
    assert queue.next_deadline() is not None


def test_only_the_holder_renews_with_a_length() -> None:
    queue, first, _second = _held()
    assert settle(queue, first, AckType.RENEW, now=1.0, delay=60.0,
                  token="forged") is AckOutcome.WRONG_TOKEN
    queue.tick(10.0)
    assert queue.entry(bm(0)).state is not EntryState.LEASED
