"""One backlog for a subscription over several queues (a regex subscription).

AMPS (amps-understanding-queues.txt, "Backlog"): when a subscription matches several queues,
the backlog is "the minimum MaxPerSubscriptionBacklog setting for the queues matched by the
subscription", and the subscriber's max_backlog counts across every queue it matches. Each
queue's engine keeps its own consumer record; the records share one `BacklogShare`.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layer.domain.consumers import BacklogShare
from layer.domain.engine import QueueEngine
from tests.support.examples import examples

from .engine_helpers import engine, leases, offer, settle

pytestmark = pytest.mark.usefixtures("engine_implementation")


def subscribe_shared(queues: list[QueueEngine], share: BacklogShare, max_backlog: int) -> None:
    for queue in queues:
        queue.subscribe("regex", "regex-session", 0.0, delivery_topic="d.regex",
                        max_backlog=max_backlog, share=share)


def test_a_subscription_over_two_queues_holds_its_max_backlog_in_all_not_in_each() -> None:
    first, second = engine(), engine(seed=8)
    offer(first, range(10))
    offer(second, range(10))
    share = BacklogShare()
    subscribe_shared([first, second], share, max_backlog=2)

    from_first = leases(first.dispatch(0.0))
    from_second = leases(second.dispatch(0.0))
    # Before: each queue granted its own backlog of 2, so the consumer held 4.
    assert len(from_first) + len(from_second) == 2
    assert share.room() == 0
    assert first.dispatch(0.0) == [] and second.dispatch(0.0) == []

    # Settling one frees one slot, which either queue may fill.
    if from_first:
        settle(first, from_first[0])
    else:
        settle(second, from_second[0])
    again = leases(first.dispatch(0.0)) + leases(second.dispatch(0.0))
    assert len(again) == 1


def test_the_shared_backlog_is_the_smallest_queue_limit() -> None:
    small = engine(max_per_subscription_backlog=1)
    large = engine(seed=8, max_per_subscription_backlog=50)
    offer(small, range(10))
    offer(large, range(10))
    share = BacklogShare()
    subscribe_shared([large, small], share, max_backlog=10)

    held = leases(large.dispatch(0.0)) + leases(small.dispatch(0.0))
    # min(max_backlog 10, MaxPerSubscriptionBacklog 1 and 50) = 1, across both queues.
    assert len(held) == 1


def test_leaving_one_queue_takes_it_out_of_the_share() -> None:
    first, second = engine(), engine(seed=8)
    offer(first, range(5))
    offer(second, range(5))
    share = BacklogShare()
    subscribe_shared([first, second], share, max_backlog=3)
    assert len(leases(first.dispatch(0.0))) == 3
    first.unsubscribe("regex", 0.0)  # its leases are broken, its record leaves the share
    assert share.queue_count() == 1
    assert len(leases(second.dispatch(0.0))) == 3


@settings(max_examples=examples(60), deadline=None)
@given(backlog=st.integers(min_value=0, max_value=6),
       sizes=st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=4),
       acks=st.lists(st.integers(min_value=0, max_value=20), max_size=12))
def test_never_more_leases_than_the_one_backlog(backlog: int, sizes: list[int],
                                                 acks: list[int]) -> None:
    queues = [engine(seed=i) for i in range(len(sizes))]
    for queue, size in zip(queues, sizes, strict=True):
        offer(queue, range(size))
    share = BacklogShare()
    subscribe_shared(queues, share, max_backlog=backlog)
    held: list[tuple[QueueEngine, object]] = []
    settled = 0
    for pick in [None, *acks]:
        if pick is not None and held:
            queue, lease = held.pop(pick % len(held))
            settle(queue, lease)  # type: ignore[arg-type]
            settled += 1
        for queue in queues:
            held.extend((queue, lease) for lease in leases(queue.dispatch(0.0)))
        assert len(held) <= backlog
        if len(held) < backlog:
            # Below the one backlog, nothing is held back: every entry is leased or settled.
            assert all(q.dispatch(0.0) == [] for q in queues)
            assert len(held) + settled == sum(sizes)
