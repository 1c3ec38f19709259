"""A stored queue definition that no longer validates (written by an older qlayer, or into
PostgreSQL by hand) is that queue's fault alone: the coordinator serves every other queue, says
so once per version (not at every catalog refresh), `qlayer stats` shows the other queues'
figures and names the problem, `qlayer queue describe` says why, and applying a valid
definition brings the queue back."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import pytest
from typer.testing import CliRunner, Result

from layer.protocol import SubscribeStatus
from layer.settings import Settings
from layer_cli.main import app
from tests.support.coordinator import (
    Consumers,
    produce,
    put_queues,
    running_coordinator,
)

pytestmark = pytest.mark.integration


def qlayer(settings: Settings, *args: str) -> Result:
    flags = ["--bootstrap-servers", settings.bootstrap_servers,
             "--database-url", settings.database_url, "--topic-prefix", settings.topic_prefix]
    return CliRunner().invoke(app, [*args, *flags], catch_exceptions=False,
                              env={"COLUMNS": "250"})


def test_an_invalid_stored_definition_costs_only_its_own_queue(
    settings: Settings, journal: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    good, broken = journal("Good", partitions=1), journal("Broken", partitions=1)
    put_queues(settings, {"name": "Good", "underlying_topic": good},
               {"name": "Broken", "underlying_topic": broken, "max_deliveries": "lots"})
    caplog.set_level(logging.ERROR, logger="layer.coordinator")
    with running_coordinator(settings, refresh_interval=0.3), Consumers(settings) as pool:
        worker = pool.subscribe("Good", max_backlog=5)
        produce(settings.bootstrap_servers, good, [b'{"n": 1}', b'{"n": 2}'])
        delivered = worker.receive(2)
        assert sorted(d.value for d in delivered) == [b'{"n": 1}', b'{"n": 2}']
        worker.ack(delivered)
        time.sleep(2.0)  # several catalog refreshes (every 0.3 s)
        said = [r.getMessage() for r in caplog.records if "Broken" in r.getMessage()]
        assert len(said) == 1, f"said once per version, not at every refresh: {said}"
        assert "invalid stored definition" in said[0] and "max_deliveries" in said[0]

        stats = qlayer(settings, "stats", "--json", "--interval", "0.1")
        assert stats.exit_code == 0, stats.output
        queues = {q["queue"]: q for q in json.loads(stats.stdout)["queues"]}
        assert queues["Good"]["problem"] is None
        assert queues["Good"]["counters"]["acked"] == 2
        assert "max_deliveries" in queues["Broken"]["problem"]
        table = qlayer(settings, "stats", "--interval", "0.1")
        assert table.exit_code == 0, table.output
        assert "queue Broken: not served: its stored definition is invalid" in table.output

        described = qlayer(settings, "queue", "describe", "Broken", "--json")
        assert described.exit_code == 0, described.output
        assert "max_deliveries" in json.loads(described.stdout)["definition_problem"]
        assert "not served: the stored definition is invalid" in qlayer(
            settings, "queue", "describe", "Broken").output

        # Fixed: the coordinator serves it at its next refresh.
        put_queues(settings, {"name": "Broken", "underlying_topic": broken,
                              "max_deliveries": 3})
        fixed = pool.new("Broken", max_backlog=5)
        deadline = time.monotonic() + 20
        # Until the next catalog refresh the coordinator answers UNKNOWN_QUEUE.
        while fixed.subscribe().status is not SubscribeStatus.OK:
            assert time.monotonic() < deadline, "the fixed queue is not served after 20 s"
            time.sleep(0.3)
        produce(settings.bootstrap_servers, broken, [b'{"n": 3}'])
        (message,) = fixed.receive(1)
        assert message.value == b'{"n": 3}'
        fixed.ack([message])
    assert json.loads(qlayer(settings, "queue", "describe", "Broken", "--json").stdout)[
        "definition_problem"] is None
