"""Journal records read with a fault that stays with the record, through a running
coordinator on both cores: each is decided as the reference says and counted in the queue's
stored counters, so `qlayer stats` shows it after any restart.

- A value that is not JSON, read by the queue's filter: "a filter that cannot be evaluated is
  false" (not an entry); by its priority: the lowest ("NULL and non-numeric values ... have
  the lowest priority"). Counted as `unparseable`, logged at most once a minute per queue.
- A delete (a tombstone): "Only publish messages are added to the queue." Counted as `deletes`.
- An unreadable `qlayer.deliver-at` / `qlayer.expiration` header: ignored, counted as
  `malformed_headers`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from layer.settings import Settings
from layer_cli.main import app
from tests.support.coordinator import (
    Consumers,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
)

from .test_options_expiry_and_backoff import core

__all__ = ["core"]  # the fixture, imported to run every test on both cores

pytestmark = pytest.mark.integration


def test_faulty_records_are_decided_by_the_reference_and_counted_per_queue(
    core: str, settings: Settings, journal: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    orders = journal("Orders", partitions=1)
    put_queues(settings,
               {"name": "Filtered", "underlying_topic": orders, "filter": "/kind = 'order'"},
               {"name": "Ranked", "underlying_topic": orders, "priority": "/rank"},
               {"name": "Plain", "underlying_topic": orders})
    caplog.set_level(logging.WARNING, logger="layer.coordinator")
    with running_coordinator(settings, core=core):
        produce(settings.bootstrap_servers, orders,
                [b'{"kind": "order", "rank": 1}', b"<order/>", None, b"\xff\xfe"], partition=0)
        produce(settings.bootstrap_servers, orders, [b'{"kind": "order", "rank": 5}'],
                headers=[("qlayer.deliver-at", b"soon")], partition=0)
        filtered = wait_for_counters(settings, "Filtered", enqueued=2, deletes=1,
                                     unparseable=2, malformed_headers=1)
        assert (filtered["enqueued"], filtered["unparseable"], filtered["deletes"],
                filtered["malformed_headers"]) == (2, 2, 1, 1)
        # Ranked keeps every publish (no filter), the two that are not JSON ranked lowest.
        ranked = wait_for_counters(settings, "Ranked", enqueued=4, unparseable=2)
        assert (ranked["enqueued"], ranked["deletes"], ranked["malformed_headers"]) == (4, 1, 1)
        # A queue with no expression never reads the values: nothing is "not JSON" to it.
        plain = wait_for_counters(settings, "Plain", enqueued=4, deletes=1)
        assert (plain["unparseable"], plain["malformed_headers"]) == (0, 1)

        with Consumers(settings) as pool:
            worker = pool.subscribe("Ranked", max_backlog=4)
            delivered = worker.receive(4)
            got = [d.value for d in delivered]
            assert got == [b'{"kind": "order", "rank": 5}', b'{"kind": "order", "rank": 1}',
                           b"<order/>", b"\xff\xfe"], "not JSON: the lowest priority"
            worker.ack(delivered)

    said = [r.getMessage() for r in caplog.records if "not JSON" in r.getMessage()]
    assert sorted(m.split(":")[0] for m in said) == ["queue Filtered", "queue Ranked"], said
    assert f"{orders}[0]@1" in said[0]

    stats = CliRunner().invoke(app, [
        "stats", "Filtered", "--json", "--interval", "0.1",
        "--bootstrap-servers", settings.bootstrap_servers, "--database-url",
        settings.database_url, "--topic-prefix", settings.topic_prefix])
    assert stats.exit_code == 0, stats.output
    (queue,) = json.loads(stats.stdout)["queues"]
    assert {k: queue["counters"][k] for k in ("unparseable", "deletes", "malformed_headers")} == {
        "unparseable": 2, "deletes": 1, "malformed_headers": 1}
