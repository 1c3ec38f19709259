"""The fault-injection soak (tests/soak/run.py), a short plan of it, in every CI run.

The soak starts a broker and a PostgreSQL server of its own (it kills them), two coordinators
and four SDK consumer processes; while records are published at a fixed rate it SIGKILLs
coordinators and consumers, SIGKILLs the broker and crashes PostgreSQL, each started again as
a supervisor would. `make soak` runs the issue's full plan (100,000 records, 16 faults).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak.run import Soak, SoakPlan

pytestmark = pytest.mark.integration


def test_a_short_soak_loses_nothing_and_processes_nothing_twice_at_most_once(
    tmp_path: Path,
) -> None:
    plan = SoakPlan(messages=3000, rate=150, coordinator_kills=2, consumer_kills=2,
                    broker_kills=1, postgres_crashes=1, outage=5, drain_timeout=240)
    lines: list[str] = []
    result = Soak(plan, tmp_path, lines.append).run()
    assert [kind for _, kind, _ in result.faults].count("broker") == 1
    assert len(result.faults) == 6
    assert result.published == 3000
    # Every check a user would make: nothing lost (at-least-once), nothing processed or
    # delivered twice (at-most-once), one ACKED event per entry, no coordinator exited.
    assert result.problems() == [], "\n".join(
        [*lines, *(f"{k}: {v}" for k, v in result.histories.items())])
    assert result.alo_processed >= 3000 and result.amo_processed <= 3000
