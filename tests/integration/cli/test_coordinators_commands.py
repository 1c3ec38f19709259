"""`qlayer coordinators`, `qlayer queue move` and the unowned-shard warning of `qlayer stats`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import Result

from layer.settings import Settings
from layer.store.store import Store

pytestmark = pytest.mark.integration


def _work_queue(invoke: Callable[..., Result], shard: int) -> None:
    result = invoke("queue", "create", "Work", "--set", f"shard={shard}")
    assert result.exit_code == 0, result.output


def test_coordinators_lists_processes_shards_and_warns_of_unowned_ones(
    invoke: Callable[..., Result], settings: Settings
) -> None:
    _work_queue(invoke, 2)
    now = time.time()
    with Store(settings.database_url) as store:
        epoch = store.take_shard("1", "proc-a", now)
        store.report_shard("1", "proc-a", epoch, 17, now)
        store.report_process("proc-a", "host-a", 4242, now - 60, [1], now)

    result = invoke("coordinators", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["shard_count"] == 4
    assert [(p["owner_id"], p["shards"], p["live"]) for p in document["processes"]] == [
        ("proc-a", [1], True)]
    shards = {s["shard"]: s for s in document["shards"]}
    assert (shards[1]["owner_id"], shards[1]["epoch"], shards[1]["lag"]) == ("proc-a", epoch, 17)
    # Shard 2 holds Work and nobody runs it.
    assert document["unowned_shards"] == [2]

    table = invoke("coordinators")
    assert table.exit_code == 0, table.output
    assert "proc-a" in table.stdout and "host-a" in table.stdout
    assert "shards [2] hold queues and no running coordinator" in table.stderr


def test_stats_warns_when_a_shard_with_queues_has_no_running_owner(
    invoke: Callable[..., Result]
) -> None:
    _work_queue(invoke, 3)
    result = invoke("stats", "--interval", "0.1", "--json")
    assert result.exit_code == 0, result.output
    assert "shards [3] hold queues" in result.stderr
    assert json.loads(result.stdout)["queues"][0]["queue"] == "Work"


def test_queue_move_moves_and_says_so(invoke: Callable[..., Result],
                                      run_cli: Callable[..., Any], settings: Settings) -> None:
    _work_queue(invoke, 0)
    result = invoke("queue", "move", "Work", "--shard", "3", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"queue": "Work", "from_shard": 0, "to_shard": 3,
                                         "version": 2}
    again = invoke("queue", "move", "Work", "--shard", "3")
    assert again.exit_code == 0 and "on shard 3 already" in again.stdout
    bad = run_cli("queue", "move", "Work", "--shard", "9")
    assert bad.code != 0
    assert "shard 9 does not exist" in bad.stderr and "0..3" in bad.stderr
    unknown = run_cli("queue", "move", "Nope", "--shard", "1")
    assert unknown.code != 0 and "Nope" in unknown.stderr
    with Store(settings.database_url) as store:
        record = store.get_queue("Work")
        assert record is not None and record.shard == 3
