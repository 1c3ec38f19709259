"""Queue options through a running coordinator: `key_groups`, `leasing: permissive` and
`target_queue_depth`, observed the way a user observes them (what arrives on the delivery
topic, which acks are refused, what the counters say).

Real coordinator loop, real Kafka and PostgreSQL; consumers built from the wire protocol only
(`RawConsumer`). Every test runs on both shard cores: the Python reference and the native one
(`CoordinatorOptions.core`), which must not differ in anything a user can see.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable

import pytest

from layer.protocol import AcceptGroup, AcceptRecord, AckStatus, AckType, Bookmark
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    Delivered,
    RawConsumer,
    collect,
    counters,
    forged,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration

#: A lease token no consumer was ever given.
MADE_UP_TOKEN = "0" * 32


@pytest.fixture(params=["python", "native"])
def core(request: pytest.FixtureRequest) -> str:
    """The shard core the coordinator runs (CoordinatorOptions.core)."""
    if request.param == "native":
        from layer.domain.native import native_available

        if not native_available():  # the native core is an optional build
            pytest.skip("the qlayer_native extension is not installed")
    return str(request.param)


def offset_of(delivery: Delivered) -> int:
    return Bookmark.parse(delivery.bookmark).offset


def values(deliveries: Iterable[Delivered]) -> list[bytes | None]:
    return sorted((d.value for d in deliveries), key=lambda v: v or b"")


def quiet(consumers: Iterable[RawConsumer], seconds: float) -> list[Delivered]:
    """Everything any of ``consumers`` received within ``seconds`` (each kept alive)."""
    group = list(consumers)
    got: list[Delivered] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for c in group:
            got.extend(c.poll(0.05))
    return got


def send_accept_record(consumer: RawConsumer, deliveries: list[Delivered]) -> None:
    """ACCEPT in an AcceptRecord (protocol 3, what the SDK sends for batch deliveries)."""
    groups: dict[tuple[str, str, int], tuple[list[int], list[str]]] = {}
    for d in deliveries:
        b = Bookmark.parse(d.bookmark)
        offsets, leases = groups.setdefault((d.queue, b.topic, b.partition), ([], []))
        offsets.append(b.offset)
        leases.append(d.lease)
    record = AcceptRecord(
        consumer_id=consumer.consumer_id, session_id=consumer.session_id,
        sent_at_ms=int(time.time() * 1000),
        groups=tuple(AcceptGroup(queue=q, topic=t, partition=p, offsets=tuple(o),
                                 leases=tuple(ls))
                     for (q, t, p), (o, ls) in groups.items()))
    consumer.producer.produce(consumer.topics.ack, consumer.codec.encode_accept(record),
                              key=consumer.consumer_id.encode(), headers=consumer.proof(),
                              **consumer._route())  # type: ignore[arg-type]
    consumer.producer.flush(10)


def accept(consumer: RawConsumer, deliveries: list[Delivered], form: str) -> None:
    """ACCEPT ``deliveries`` as AckRecord items (``items``) or as an AcceptRecord."""
    if form == "items":
        consumer.ack(deliveries)
    else:
        send_accept_record(consumer, deliveries)


def unreferenced(journal_topic: str, offset: int, queue: str) -> Delivered:
    """A bookmark the consumer never received (known from the journal, e.g. by `qlayer view`),
    with a token nobody was given."""
    return Delivered(queue, f"{journal_topic}/0/{offset}", MADE_UP_TOKEN, None, None, 0, False,
                     [])


# --------------------------------------------------------------------------- key_groups


def test_key_groups_lease_one_entry_per_key_at_a_time_in_journal_order(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`key_groups` (beyond AMPS). DESIGN §4: "key groups (at most one in-flight entry per
    record key, for ordered processing with parallelism)". docs/queue-configuration.md:
    "At most one leased entry per record key at a time: ordered processing per key, parallel
    across keys." docs/engine.md: "a key's entries go in journal order ... A later entry of
    the key waits even when an older one is DELAYED after a release ... Records without a key
    are not grouped."
    """
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "key_groups": True,
                          "lease_period": "60s"})
    #           offset: 0      1      2      3      4      5      6     7
    keys: list[bytes | None] = [b"a", b"a", b"b", b"a", b"b", b"c", None, None]
    vals = [b"a0", b"a1", b"b0", b"a2", b"b1", b"c0", b"n0", b"n1"]
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        x = pool.subscribe("Work", max_backlog=5)
        y = pool.subscribe("Work", max_backlog=5)
        both = [x, y]
        produce(settings.bootstrap_servers, work, vals, keys=keys)

        holder: dict[bytes, tuple[RawConsumer, Delivered]] = {}  # by value
        first_delivery_order: list[bytes | None] = []

        def take(got: dict[str, list[Delivered]]) -> list[Delivered]:
            """Record who holds what; at most one outstanding entry per key, ever."""
            out = []
            for consumer in both:
                for d in got[consumer.consumer_id]:
                    if d.key is not None:
                        busy = [v for v, (_, h) in holder.items() if h.key == d.key]
                        assert busy == [], (
                            f"{d.value!r} (key {d.key!r}) leased while {busy} of the same key "
                            "is still in flight")
                    assert d.value is not None
                    holder[d.value] = (consumer, d)
                    if d.delivery_count == 1:
                        first_delivery_order.append(d.value)
                    out.append(d)
            return out

        def settle(value: bytes, type: AckType = AckType.ACCEPT) -> None:
            consumer, d = holder.pop(value)
            consumer.ack([d], type)

        # Room for ten, but only the first entry of each key (and both keyless ones) go out.
        first = take(collect(both, 5))
        assert values(first) == [b"a0", b"b0", b"c0", b"n0", b"n1"]
        assert quiet(both, 1.0) == [], "a1, a2, b1 must wait for the entries of their key"

        settle(b"a0")
        (next_a,) = take(collect(both, 1))
        assert (next_a.value, next_a.delivery_count) == (b"a1", 1)
        assert quiet(both, 0.5) == [], "a2 waits for a1"

        # A returned entry keeps its key's turn: a1 again, not a2.
        settle(b"a1", AckType.RELEASE)
        (again,) = take(collect(both, 1))
        assert (again.value, again.delivery_count) == (b"a1", 2)
        assert again.bookmark == next_a.bookmark

        settle(b"a1")
        settle(b"b0")
        take(collect(both, 2))
        assert sorted(holder) == [b"a2", b"b1", b"c0", b"n0", b"n1"]
        for value in list(holder):
            settle(value)
        assert quiet(both, 0.3) == []

        by_key: dict[bytes, list[bytes]] = {}
        for first_value in first_delivery_order:
            assert first_value is not None
            by_key.setdefault(first_value[:1], []).append(first_value)
        assert by_key[b"a"] == [b"a0", b"a1", b"a2"], "journal order within key a"
        assert by_key[b"b"] == [b"b0", b"b1"], "journal order within key b"
        totals = wait_for_counters(settings, "Work", acked=8)
        assert (totals["acked"], totals["released"], totals["delivered"]) == (8, 1, 9)
        assert x.ack_results() == [] and y.ack_results() == [], "no ack refused"


# --------------------------------------------------------------------------- leasing


@pytest.mark.parametrize("form", ["items", "accept-record"])
@pytest.mark.parametrize("leasing", ["strict", "permissive"])
def test_permissive_leasing_lets_another_consumer_ack_a_leased_entry(
    leasing: str, form: str, core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`leasing` [Leasing]. The reference: "The ``Leasing`` parameter on the queue specifies
    whether AMPS allows a client to successfully acknowledge messages that it does not have
    currently leased." docs/queue-configuration.md: "Strict: only the lease holder's token
    acknowledges an entry. Permissive: any consumer of the queue may." docs/engine.md:
    "anyone may ACCEPT or REJECT an entry still in the queue, leased or not (the holder's
    backlog is freed); RELEASE and RENEW still need the holder's token".
    """
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "leasing": leasing,
                          "lease_period": "60s"})
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        holder = pool.subscribe("Work")  # max_backlog 1
        # A consumer of the queue that takes nothing itself (its filter matches no job).
        other = pool.subscribe("Work", max_backlog=5, filter="/job = 'never'")
        jobs = [json.dumps({"job": n}).encode() for n in ("m0", "m1")]
        produce(settings.bootstrap_servers, work, jobs)
        (m0,) = holder.receive(1)
        assert json.loads(m0.value or b"") == {"job": "m0"}

        # `other` acknowledges the entry `holder` has leased, with a token of its own.
        accept(other, [forged(m0, MADE_UP_TOKEN)], form)

        if leasing == "strict":
            (refused,) = other.wait_for_ack_results(1)
            assert (refused.status, refused.bookmark) == (AckStatus.WRONG_TOKEN, m0.bookmark)
            assert holder.idle(1.0) == [], "the holder's backlog is still full"
            assert counters(settings, "Work").get("acked", 0) == 0
            holder.ack([m0])
            (m1,) = holder.receive(1)
        else:
            # Applied silently, and the holder's backlog is freed: it gets the next job.
            (m1,) = holder.receive(1)
            assert other.ack_results() == [], "a permissive ack must not be refused"
            wait_for_counters(settings, "Work", acked=1)
            # The holder's own ack now finds the entry gone.
            holder.ack([m0])
            (late,) = holder.wait_for_ack_results(1)
            assert (late.status, late.bookmark) == (AckStatus.DUPLICATE, m0.bookmark)
        assert json.loads(m1.value or b"") == {"job": "m1"}

        # RELEASE acts on the lease itself: only the holder's token, whatever the leasing.
        other.ack([forged(m1, MADE_UP_TOKEN)], AckType.RELEASE)
        results = other.wait_for_ack_results(2 if leasing == "strict" else 1)
        assert (results[-1].status, results[-1].bookmark) == (AckStatus.WRONG_TOKEN,
                                                              m1.bookmark)
        assert holder.idle(0.5) == [], "a refused RELEASE returns nothing"
        holder.ack([m1])
        totals = wait_for_counters(settings, "Work", acked=2)
        assert (totals["acked"], totals["delivered"], totals["released"]) == (2, 2, 0)
        wait_until(lambda: recovery_points(settings, "Work").get((work, 0)) == 2,
                   what="both jobs to leave the queue")


@pytest.mark.parametrize("form", ["items", "accept-record"])
@pytest.mark.parametrize("leasing", ["strict", "permissive"])
def test_permissive_leasing_accepts_an_ack_after_the_lease_ended_if_nobody_took_the_entry(
    leasing: str, form: str, core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`leasing` [Leasing]: "whether AMPS allows a client to successfully acknowledge messages
    that it does not have currently leased". A consumer that finishes after its lease ran out,
    while the entry waits in the queue (here: its redelivery back-off), still acknowledges it
    under permissive leasing (docs/engine.md: "anyone may ACCEPT or REJECT an entry still in
    the queue, leased or not"); under strict leasing the late ack is refused and the entry
    comes back.
    """
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "leasing": leasing,
                          "lease_period": "1s",
                          "redelivery_backoff": {"initial": "4s", "multiplier": 1,
                                                 "maximum": "4s"}})
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        slow = pool.subscribe("Work")
        produce(settings.bootstrap_servers, work, [b"job"])
        (d,) = slow.receive(1)
        wait_for_counters(settings, "Work", lease_expired=1)  # the lease ran out
        accept(slow, [d], form)  # the work is done, a little late

        if leasing == "strict":
            (refused,) = slow.wait_for_ack_results(1)
            assert (refused.status, refused.bookmark) == (AckStatus.LEASE_LOST, d.bookmark)
            (again,) = slow.receive(1, timeout=15)  # after the back-off
            assert (again.bookmark, again.delivery_count) == (d.bookmark, 2)
            slow.ack([again])
            totals = wait_for_counters(settings, "Work", acked=1)
            assert (totals["delivered"], totals["redelivered"]) == (2, 1)
        else:
            totals = wait_for_counters(settings, "Work", acked=1)
            assert slow.ack_results() == [], "a permissive late ack must not be refused"
            # Done: it is not offered again once the back-off has passed.
            assert slow.idle(4.5) == []
            totals = counters(settings, "Work")
            assert (totals["acked"], totals["delivered"], totals["redelivered"]) == (1, 1, 0)
        wait_until(lambda: recovery_points(settings, "Work").get((work, 0)) == 1,
                   what="the job to leave the queue")


# --------------------------------------------------------------------------- target_queue_depth


def test_target_queue_depth_keeps_only_n_entries_deliverable_until_earlier_ones_are_acked(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`target_queue_depth` [TargetQueueDepth]. The reference: "messages beyond the specified
    depth are considered to be inactive (though still part of the queue). Those messages are
    not deliverable to subscribers" and "As messages are acknowledged from the queue, AMPS will
    add messages to the active part of the queue until the active part of the queue once again
    reaches the TargetQueueDepth".
    """
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "target_queue_depth": 2,
                          "lease_period": "60s"})
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        a = pool.subscribe("Work", max_backlog=10)
        b = pool.subscribe("Work", max_backlog=10)
        both = [a, b]
        produce(settings.bootstrap_servers, work, [f"t{i}".encode() for i in range(6)])

        held: dict[int, tuple[RawConsumer, Delivered]] = {}

        def arrive(count: int) -> list[int]:
            got = collect(both, count)
            for consumer in both:
                for d in got[consumer.consumer_id]:
                    held[offset_of(d)] = (consumer, d)
            assert len(held) <= 2, f"more than 2 entries in flight: {sorted(held)}"
            return sorted(offset_of(d) for ds in got.values() for d in ds)

        def ack(*offsets: int) -> None:
            for offset in offsets:
                consumer, d = held.pop(offset)
                consumer.ack([d])

        # Twenty slots of backlog between them, but only the first two entries are active.
        assert arrive(2) == [0, 1]
        assert quiet(both, 1.0) == [], "t2..t5 are inactive"

        # A returned entry stays in the active part; nothing new is activated for it.
        consumer, d = held.pop(0)
        consumer.ack([d], AckType.RELEASE)
        assert arrive(1) == [0]
        assert quiet(both, 0.5) == []

        ack(0)
        assert arrive(1) == [2], "one acked, one activated"
        assert quiet(both, 0.5) == []
        ack(1, 2)
        assert arrive(2) == [3, 4]
        assert quiet(both, 0.5) == []
        ack(3)
        assert arrive(1) == [5]
        ack(4, 5)
        totals = wait_for_counters(settings, "Work", acked=6)
        assert (totals["acked"], totals["delivered"], totals["released"]) == (6, 7, 1)
        assert a.ack_results() == [] and b.ack_results() == []


@pytest.mark.parametrize("leasing", ["strict", "permissive"])
def test_an_ack_for_an_inactive_entry_is_remembered_and_the_entry_never_delivered(
    leasing: str, core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """`target_queue_depth` with `leasing: permissive`. The reference: "AMPS keeps a list of
    acknowledgments that have been received for messages that are not in the queue. When a
    message that would be added to the active part of the queue has already been
    acknowledged, AMPS does not add that message to the queue." docs/engine.md: "Acks for
    entries that are not active are remembered (permissive queues)"; a strict queue refuses
    an ack from anyone but the holder.
    """
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "target_queue_depth": 2,
                          "leasing": leasing, "lease_period": "60s"})
    with running_coordinator(settings, core=core), Consumers(settings) as pool:
        c = pool.subscribe("Work", max_backlog=10)
        produce(settings.bootstrap_servers, work, [f"t{i}".encode() for i in range(5)])
        first = c.receive(2)
        assert sorted(offset_of(d) for d in first) == [0, 1]
        assert c.idle(0.5) == []

        # t3 is read from the journal but inactive; acknowledge it before it is delivered.
        c.ack([unreferenced(work, 3, "Work")])
        if leasing == "strict":
            (refused,) = c.wait_for_ack_results(1)
            assert refused.status is AckStatus.LEASE_LOST
            assert refused.bookmark == f"{work}/0/3"
        else:
            wait_for_counters(settings, "Work", acked=1)
            assert c.ack_results() == [], "the early ack is accepted (remembered)"

        c.ack(first)
        rest = c.receive(2)
        got = sorted(offset_of(d) for d in rest)
        if leasing == "permissive":
            assert got == [2, 4], "t3 was acknowledged already: it never becomes deliverable"
            assert c.idle(1.0) == []
            c.ack(rest)
            totals = wait_for_counters(settings, "Work", acked=5)
            assert (totals["acked"], totals["delivered"]) == (5, 4)
        else:
            assert got == [2, 3]
            c.ack(rest)
            (last,) = c.receive(1)
            assert offset_of(last) == 4
            c.ack([last])
            totals = wait_for_counters(settings, "Work", acked=5)
            assert (totals["acked"], totals["delivered"]) == (5, 5)
        wait_until(lambda: recovery_points(settings, "Work").get((work, 0)) == 5,
                   what="all five to leave the queue")
