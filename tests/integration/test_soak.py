"""The fault-injection soak (tests/soak/run.py), a short plan of it, in every CI run.

The soak starts a broker and a PostgreSQL server of its own (it kills them), two coordinators
and four SDK consumer processes; while records are published at a fixed rate it SIGKILLs
coordinators and consumers, SIGKILLs the broker and crashes PostgreSQL, each started again as
a supervisor would; it publishes a poison record, deletes (and makes again) a third queue's
journal, and lets a hostile tenant write to the control and ack topics while the at-least-once
queue is the canary. `make soak` runs the issue's full plan (100,000 records, 18 faults) and
the Spark audit after it.
"""

from __future__ import annotations

import shutil

import pytest

from tests.soak.run import ALO, Soak, SoakPlan, soak_dir

# By itself, after the parallel workers (`make test`): its faults are timed and its canary may
# wait at most 1 s, which five busy workers on two cores do not leave room for.
pytestmark = [pytest.mark.integration, pytest.mark.alone]


def test_a_short_soak_loses_nothing_and_processes_nothing_twice_at_most_once() -> None:
    # No Spark audit here: `qlayer pipeline reconcile` of the two queues took 285 s on this
    # 2-core machine (a JVM and Spark per queue), far over the minute the CI could give it;
    # `make soak` runs it (docs/development.md).
    # 30 s of publishing, and a seed that draws the hostile tenant first (at 3.9 s): its
    # window (once the consumers subscribed, a few seconds of records, 5 s of settling) ends
    # while records still come, or its canary would measure nothing.
    plan = SoakPlan(messages=4500, rate=150, coordinator_kills=2, consumer_kills=2,
                    broker_kills=1, postgres_crashes=1, poison_records=1, journal_deletions=1,
                    hostile_phases=1, outage=5, drain_timeout=240, audit=False, seed=14)
    lines: list[str] = []
    # Not pytest's tmp_path: PostgreSQL refuses a data directory under a private parent.
    state = soak_dir()
    result = Soak(plan, state, lines.append).run()
    kinds = [fault["kind"] for fault in result.faults]
    assert kinds.count("broker") == 1 and len(kinds) == 9
    assert {"poison", "journal_deleted", "hostile"} <= set(kinds)
    # Each fault's window is exact: its action took time, and it ended after it began.
    assert all(fault["end"] > fault["at"] for fault in result.faults)
    assert result.attempted == 4500
    # What had to be processed: every confirmed value, and any unconfirmed one journaled.
    assert result.alo_must_process == 4500 - len(result.unconfirmed_not_journaled)
    # Every check a user would make, as sets (tests/soak/checks.py): nothing lost
    # (at-least-once), nothing processed or delivered twice (at-most-once), exactly one ACKED
    # event per entry of a published value and none for anything else, no coordinator exited;
    # the poison record dead-lettered (too_large) by both queues, every entry of the deleted
    # journal expired (journal_deleted) and the journal made again read; the hostile tenant's
    # records all refused and counted, no soak consumer's session changed by them, the canary
    # waiting at most 1 s in its window; no shard failure charged to an input fault or the
    # hostile tenant, none outside every fault's window.
    assert result.problems() == [], "\n".join(
        [*lines, *(f"{k}: {v}" for k, v in result.histories.items())])
    assert result.alo_entries >= result.alo_must_process  # an entry per journaled value
    assert result.alo_processed >= result.alo_must_process
    assert result.amo_processed <= result.alo_must_process
    assert result.poison_dead_letters[ALO] >= 1  # the dead-letter topic is at-least-once
    assert result.deleted_journal_expired == result.deleted_journal_published > 0
    assert result.deleted_journal_recreated_not_processed == 0
    (hostile,) = result.hostile
    assert hostile["victims"] and hostile["canary_gap"] is not None
    assert hostile["refused_events"] > 0 and not hostile["hostile_events"]
    shutil.rmtree(state, ignore_errors=True)  # kept when a check failed, for its logs
