"""Several queues over one journal track it independently (DESIGN §1: each queue is its own
view; an entry's identity is (queue, bookmark))."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from layer.protocol import AckItem, AckStatus, AckType, SubscribeStatus
from layer.settings import Settings
from tests.support.coordinator import (
    Consumers,
    RawConsumer,
    collect,
    counters,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_until,
)

pytestmark = pytest.mark.integration

N = 12


def test_queues_over_one_journal_deliver_and_settle_independently(
    settings: Settings, journal: Callable[..., str]
) -> None:
    orders = journal("Orders")
    put_queues(
        settings,
        {"name": "Billing", "underlying_topic": orders, "max_per_subscription_backlog": N},
        {"name": "Shipping", "underlying_topic": orders, "max_per_subscription_backlog": N},
        # The same journal again, filtered: only even order numbers enter this queue.
        {"name": "Audit", "underlying_topic": orders, "filter": "/n % 2 = 0",
         "max_per_subscription_backlog": N},
    )
    values = [json.dumps({"n": i}).encode() for i in range(N)]
    produce(settings.bootstrap_servers, orders, values, keys=[b"k%d" % i for i in range(N)])
    with running_coordinator(settings), Consumers(settings) as pool:
        billing = pool.subscribe("Billing", max_backlog=N)
        got = collect([billing], N)[billing.consumer_id]
        assert sorted(d.value for d in got) == sorted(values)
        billing.ack(got)
        wait_until(lambda: sum(recovery_points(settings, "Billing").values()) == N,
                   what="Billing done with every entry")

        # Billing finished the journal; Shipping still has every entry, with its own
        # delivery counts and leases (and the payloads, though Billing let go of them).
        shipping = pool.subscribe("Shipping", max_backlog=N)
        shipped = collect([shipping], N)[shipping.consumer_id]
        assert sorted(d.value for d in shipped) == sorted(values)
        assert {d.bookmark for d in shipped} == {d.bookmark for d in got}
        assert all(d.delivery_count == 1 and d.queue == "Shipping" for d in shipped)
        assert {d.lease for d in shipped}.isdisjoint({d.lease for d in got})
        # An ack names its queue: Billing's token means nothing to Shipping, and acking
        # Billing's delivery again is a duplicate there, not a settlement here.
        first = got[0]
        shipping.send_items([AckItem(queue="Shipping", bookmark=first.bookmark,
                                     lease=first.lease, type=AckType.ACCEPT)])
        billing.ack([first])
        (wrong,) = shipping.wait_for_ack_results(1)
        (duplicate,) = billing.wait_for_ack_results(1)
        assert (wrong.status, wrong.queue) == (AckStatus.WRONG_TOKEN, "Shipping")
        assert (duplicate.status, duplicate.queue) == (AckStatus.DUPLICATE, "Billing")
        shipping.ack([d for d in shipped if json.loads(d.value or b"")["n"] < N // 2])
        shipping.ack([d for d in shipped if json.loads(d.value or b"")["n"] >= N // 2],
                     AckType.RELEASE)
        again = shipping.receive(N // 2)
        assert all(d.delivery_count == 2 for d in again)
        shipping.ack(again)

        audit = pool.subscribe("Audit", max_backlog=N)
        audited = collect([audit], N // 2)[audit.consumer_id]
        assert sorted(json.loads(d.value or b"")["n"] for d in audited) == list(range(0, N, 2))
        assert audit.idle(0.3) == [], "odd orders never entered Audit"
        audit.ack(audited)

        wait_until(lambda: counters(settings, "Audit").get("acked") == N // 2,
                   what="Audit acks recorded")
        wait_until(lambda: counters(settings, "Shipping").get("acked") == N,
                   what="Shipping acks recorded")
        billing_totals = counters(settings, "Billing")
        shipping_totals = counters(settings, "Shipping")
        audit_totals = counters(settings, "Audit")
        assert (billing_totals["enqueued"], billing_totals["acked"],
                billing_totals["redelivered"]) == (N, N, 0)
        assert (shipping_totals["enqueued"], shipping_totals["released"],
                shipping_totals["redelivered"]) == (N, N // 2, N // 2)
        assert (audit_totals["enqueued"], audit_totals["acked"]) == (N // 2, N // 2)
        for queue in ("Shipping", "Audit"):
            wait_until(lambda q=queue: sum(recovery_points(settings, q).values()) == N,
                       what=f"{queue} done with every entry")


def test_a_queue_created_later_reads_the_journal_from_its_own_recovery_point(
    settings: Settings, journal: Callable[..., str]
) -> None:
    """The coordinator reads the journal once for all queues; a queue defined while it runs
    (recovery_point beginning) gets the records the others finished long ago."""
    orders = journal("Orders")
    put_queues(settings, {"name": "Billing", "underlying_topic": orders,
                          "max_per_subscription_backlog": N})
    values = [json.dumps({"n": i}).encode() for i in range(N)]
    produce(settings.bootstrap_servers, orders, values)
    with running_coordinator(settings), Consumers(settings) as pool:
        billing = pool.subscribe("Billing", max_backlog=N)
        got = collect([billing], N)[billing.consumer_id]
        billing.ack(got)
        wait_until(lambda: sum(recovery_points(settings, "Billing").values()) == N,
                   what="Billing done with every entry")

        put_queues(settings, {"name": "Shipping", "underlying_topic": orders,
                              "max_per_subscription_backlog": N},
                   {"name": "Recent", "underlying_topic": orders, "recovery_point": "end"})
        shipping = wait_until(lambda: _subscribed(pool, "Shipping"), what="Shipping to exist")
        recent = wait_until(lambda: _subscribed(pool, "Recent"), what="Recent to exist")
        shipped = collect([shipping], N)[shipping.consumer_id]
        assert sorted(d.value for d in shipped) == sorted(values)
        shipping.ack(shipped)
        assert recent.idle(0.3) == [], "recovery_point end: nothing from before"
        assert billing.idle(0.1) == [], "Billing does not see its entries again"

        produce(settings.bootstrap_servers, orders, [b'{"n": 99}'])
        for consumer in (billing, shipping, recent):
            (fresh,) = consumer.receive(1)
            assert fresh.value == b'{"n": 99}'
            consumer.ack([fresh])


def _subscribed(pool: Consumers, queue: str) -> RawConsumer | None:
    """A subscribed consumer of ``queue`` once the coordinator knows the queue, else None."""
    consumer = pool.new(queue, max_backlog=N)
    ok = consumer.subscribe(timeout=10).status is SubscribeStatus.OK
    return consumer if ok else None
