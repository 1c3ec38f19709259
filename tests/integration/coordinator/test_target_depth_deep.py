"""A deep queue with a small `target_queue_depth`, through a running coordinator on the real
broker, on both shard cores: records past the depth are kept as positions only and read back
from the journal when there is room (docs/engine.md "Target queue depth").

The reference (advanced-configuration, "Limiting Currently Deliverable Messages"): inactive
messages "are not read from the transaction log until needed", and "As messages are
acknowledged from the queue, AMPS will add messages to the active part of the queue until
the active part of the queue once again reaches the TargetQueueDepth"; "AMPS keeps a list of
acknowledgments that have been received for messages that are not in the queue".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from layer.protocol import Bookmark
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    Delivered,
    RawConsumer,
    counters,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration

RECORDS = 5_000
DEPTH = 10
#: Acknowledged before they were ever delivered (they are deep past the depth then).
EARLY = [*range(1_000, 1_050), *range(3_990, 4_010)]


@pytest.fixture(params=["python", "native"])
def core(request: pytest.FixtureRequest) -> str:
    if request.param == "native":
        from layer.domain.native import native_available

        if not native_available():
            pytest.skip("the qlayer_native extension is not installed")
    return str(request.param)


def _offset(d: Delivered) -> int:
    return Bookmark.parse(d.bookmark).offset


def _early_ack(consumer: RawConsumer, topic: str, offsets: list[int]) -> None:
    consumer.ack([Delivered("Deep", f"{topic}/0/{o}", "0" * 32, None, None, 0, False, [])
                  for o in offsets])


def test_a_deep_queue_delivers_every_record_once_in_journal_order_across_a_restart(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    work = journal("Deep", partitions=1)
    put_queues(settings, {"name": "Deep", "underlying_topic": work, "target_queue_depth": DEPTH,
                          "leasing": "permissive", "lease_period": "60s"})
    produce(settings.bootstrap_servers, work, [f"m{i}".encode() for i in range(RECORDS)])
    order: list[int] = []
    seen: dict[int, str] = {}  # offset -> the lease token it was first delivered with
    resent: dict[int, tuple[str, str]] = {}

    def consume(consumer: RawConsumer, until: int, timeout: float = 120.0) -> None:
        """Take deliveries and acknowledge them until ``until`` distinct entries came. After
        the restart the coordinator sends the deliveries of restored leases again (a
        delivery count of 1 still: the same lease, not a redelivery); those are recorded
        apart and acknowledged again (a duplicate ack changes nothing)."""
        deadline = time.monotonic() + timeout
        while len(order) < until:
            assert time.monotonic() < deadline, f"{len(order)} of {until} delivered"
            got = consumer.poll(0.2)
            for d in got:
                offset = _offset(d)
                assert d.delivery_count == 1, f"{d.bookmark} delivered again"
                if offset in seen:
                    resent[offset] = (seen[offset], d.lease)
                    continue
                seen[offset] = d.lease
                order.append(offset)
            consumer.ack(got)

    expected = [o for o in range(RECORDS) if o not in set(EARLY)]
    with Consumers(settings) as pool:
        with running_coordinator(settings, core=core):
            c = pool.subscribe("Deep", max_backlog=DEPTH)
            consume(c, 1)
            # Deep past the depth: answered at once, and never delivered.
            _early_ack(c, work, EARLY)
            wait_for_counters(settings, "Deep", acked=len(EARLY))
            assert c.ack_results() == []
            consume(c, 2_000)
            # The queue's position waits at the first record not settled: the restart reads
            # on from there, however deep the queue is.
            point = recovery_points(settings, "Deep")[(work, 0)]
            assert point <= 2_000 + DEPTH + len(EARLY)
        # Stopped in the middle (leases held, acks in flight), then started again.
        with running_coordinator(settings, core=core):
            consume(c, len(expected))
            assert [d for d in c.idle(1.0) if _offset(d) not in seen] == []
            wait_until(lambda: recovery_points(settings, "Deep").get((work, 0)) == RECORDS,
                       timeout=60, what="every record to leave the queue")
    assert order == expected, "every record exactly once, in journal order"
    # Only leases held across the restart are sent again (at most a backlog's worth), with
    # the token they were first delivered with (the consumer drops such a repeat by it).
    assert len(resent) <= DEPTH, resent
    assert all(first == again for first, again in resent.values()), resent
    totals = counters(settings, "Deep")
    assert totals["delivered"] == len(expected)
    assert totals["acked"] == RECORDS


def test_a_purge_empties_the_deferred_part_too(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`qlayer queue purge` on a deep queue: "every entry leaves the queue" -- the records
    deferred past the depth too, each with its ACKED event (source admin), read back from the
    journal without being delivered; records produced after it are delivered as usual."""
    from layer.services.queues import QueueService

    work = journal("Deep", partitions=1)
    put_queues(settings, {"name": "Deep", "underlying_topic": work, "target_queue_depth": DEPTH,
                          "lease_period": "60s"})
    produce(settings.bootstrap_servers, work, [f"m{i}".encode() for i in range(2_000)])
    with running_coordinator(settings, core=core), Consumers(settings) as pool, \
            QueueService.from_settings(settings) as service:
        c = pool.subscribe("Deep", max_backlog=2)
        held = c.receive(2)
        service.purge("Deep", wait=20)
        wait_for_counters(settings, "Deep", acked=2_000, timeout=60)
        wait_until(lambda: recovery_points(settings, "Deep").get((work, 0)) == 2_000,
                   timeout=60, what="the purge to pass every record")
        c.ack(held)  # their leases ended with the purge: answered DUPLICATE
        assert c.idle(1.0) == []
        produce(settings.bootstrap_servers, work, [b"after"])
        (after,) = c.receive(1)
        assert after.value == b"after"
        c.ack([after])
        # The ack is on its way through the ack topic; a coordinator stopped before it reads
        # it leaves it there for the next one, so wait for it here.
        wait_for_counters(settings, "Deep", acked=2_001, timeout=30)
    totals = counters(settings, "Deep")
    assert (totals["delivered"], totals["acked"]) == (3, 2_001)
