"""Replacing a subscription through a running coordinator keeps its leases (AMPS, "Replacing
Queue Subscriptions"): "AMPS does not break message leases or adjust the number of
currently-unacknowledged messages for the subscription, even if the messages no longer match
the current subscription. AMPS makes no assumptions about the state of the messages, and
requires the subscriber to acknowledge them or allow the lease to expire.\""""

from __future__ import annotations

from collections.abc import Callable

import pytest

from layer.protocol import SubscribeStatus
from layer.settings import Settings
from tests.support.coordinator import (
    RawConsumer,
    counters,
    produce,
    put_queues,
    running_coordinator,
    wait_until,
)

pytestmark = pytest.mark.integration


def test_a_replace_to_another_queue_keeps_the_leases_of_the_first(
    settings: Settings, journal: Callable[..., str]
) -> None:
    first, second = journal("First", partitions=1), journal("Second", partitions=1)
    put_queues(settings, {"name": "First", "underlying_topic": first, "lease_period": "5m"},
               {"name": "Second", "underlying_topic": second, "lease_period": "5m"})
    produce(settings.bootstrap_servers, first, [f"f{i}".encode() for i in range(5)])
    produce(settings.bootstrap_servers, second, [f"s{i}".encode() for i in range(5)])
    with running_coordinator(settings):
        mover = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "First",
                            max_backlog=3)
        other = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "First",
                            max_backlog=5)
        try:
            mover.subscribe()
            held = mover.receive(3)
            assert {d.queue for d in held} == {"First"}
            other.subscribe()
            rest = other.receive(2)
            assert not {d.bookmark for d in rest} & {d.bookmark for d in held}

            reply = mover.replace("Second", max_backlog=3)
            assert reply.status is SubscribeStatus.OK
            # "... the consumer may still have 10 messages outstanding ... and no new
            # messages will be delivered until that number drops below the current maximum":
            # three held in First fill a backlog of three in Second.
            assert mover.idle(1.0) == []
            # Nobody else is offered what the mover holds, even with room.
            other.ack(rest)
            assert other.idle(1.0) == []

            mover.ack(held)  # its holder settles them after the replace
            assert mover.ack_results() == [], "none refused"
            got = mover.receive(3)
            assert {d.queue for d in got} == {"Second"}
            wait_until(lambda: counters(settings, "First").get("acked") == 5,
                       what="First's five acked")
            assert not mover.ack_results()
        finally:
            mover.close()
            other.close()
