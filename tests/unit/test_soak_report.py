"""The soak's figures (tests/soak/report.py): the table per fault, the shard failures read
from the coordinators' JSON logs and the fault each is charged to (exact windows), and the
verdict of `qlayer pipeline reconcile --json`. The set checks: tests/unit/test_soak_checks.py."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from layer.coordinator.logformat import JsonFormatter, fields
from tests.soak.report import (
    FAULT_KINDS,
    NO_FAULT,
    AuditVerdict,
    Fault,
    ShardFailure,
    Timeline,
    audit_verdict,
    charged_to,
    fault_rows,
    quiet_from,
    shard_failures,
    table,
)
from tests.soak.run import Soak, SoakPlan

ORIGIN = datetime(2026, 11, 25, 12, 0, tzinfo=UTC).timestamp()


def _line(at: float, message: str, level: int = logging.ERROR, **extra: object) -> str:
    """A log line exactly as a coordinator with --log-format json writes it."""
    record = logging.LogRecord("layer.coordinator.process", level, __file__, 1, message,
                               None, None)
    record.created = ORIGIN + at
    record.__dict__.update(fields(**extra))
    return JsonFormatter().format(record)


def _failed(at: float, shard: int) -> str:
    return _line(at, f"an iteration of shard {shard} failed: kafka: broker down; rebuilding "
                 "from stored state, retried with back-off up to 30s (logged again when it "
                 "runs or fails otherwise)", shard=shard, reason="kafka")


def _runs_again(at: float, shard: int, failures: int) -> str:
    return _line(at, f"shard {shard} runs again, 4.5s and {failures} failures after it first "
                 "failed", logging.WARNING)


def _runs(found: list[ShardFailure]) -> list[tuple[float, int, int, bool]]:
    return [(f.at, f.shard, f.failures, f.ended) for f in found]


def test_shard_failures_are_runs_of_failures_with_their_count_and_an_unended_run_is_said() -> None:
    lines = [_failed(10.0, 2), "Traceback (not JSON)", _line(11.0, "coordinator took shards"),
             _failed(11.5, 2),  # the same run, of another kind
             _runs_again(14.5, 2, 5), _failed(30.0, 3)]
    found = shard_failures(lines, ORIGIN, source="coordinator0.log")
    assert _runs(found) == [(10.0, 2, 5, True), (30.0, 3, 1, False)]
    # The evidence a report quotes: the first failure's reason, message and log.
    assert (found[0].reason, found[0].source) == ("kafka", "coordinator0.log")
    assert found[0].message.startswith("an iteration of shard 2 failed: kafka: broker down")
    assert "never ended" in found[1].said() and "t=30.000s" in found[1].said()


def test_a_failure_keeps_its_exact_time_to_the_millisecond() -> None:
    # The log's time has milliseconds: 13.171 s is not 13.2 s.
    (found,) = shard_failures([_failed(13.171, 1)], ORIGIN)
    assert found.at == pytest.approx(13.171, abs=1e-6)


def test_a_run_of_failures_ends_when_the_shard_is_given_up_or_the_process_starts_again(
) -> None:
    lines = [_failed(10.0, 1), _failed(11.0, 2),
             _line(12.0, "coordinator c0 gives up shard 1: the coordinators' group gave the "
                   "shard to another process", logging.WARNING, shard=1),
             # SIGKILLed while shard 2 failed; the next process of this name starts:
             _line(20.0, "shard core: native", logging.INFO)]
    assert _runs(shard_failures(lines, ORIGIN)) == [(10.0, 1, 1, True), (11.0, 2, 1, True)]


def test_a_run_of_failures_ends_when_the_shard_is_taken_again_or_kafka_answers_again() -> None:
    # The CI's soak: shard 1 failed after the broker's restart, the process's Kafka outage
    # handling started it again, and it was taken again: no "runs again" line, no loop.
    lines = [_failed(10.0, 1), _failed(10.5, 2),
             _line(12.0, "Kafka answers again, 18.0s after the first failure; the shards start "
                   "again from stored state", logging.WARNING),
             _failed(13.0, 3),
             _line(15.0, "coordinator c1 took shard 3 at epoch 3: assigned again by the "
                   "coordinators' group", logging.INFO),
             _failed(20.0, 4)]
    assert _runs(shard_failures(lines, ORIGIN)) == [
        (10.0, 1, 1, True), (10.5, 2, 1, True), (13.0, 3, 1, True), (20.0, 4, 1, False)]


def test_a_run_ends_when_the_group_takes_the_shards_or_gives_them_back_together() -> None:
    # The soak of 2026-11-29: shard 1 failed just after the broker's restart; the group lost
    # shards 1 and 3 (only 3, running, was given up by name), gave both back in one line
    # ("took shards 1, 3"), then revoked 1 for the other process. Not a loop.
    lines = [_failed(10.0, 1), _failed(10.25, 3),
             _line(15.75, "coordinator group lost shards [1, 3]", logging.INFO),
             _failed(16.0, 1), _failed(16.25, 5), _failed(16.5, 6),
             _line(16.75, "coordinator c1 took shards 1, 5 at epoch 2: assigned again by the "
                   "coordinators' group", logging.INFO),
             _failed(17.0, 7),
             _line(17.5, "coordinator group revoked shards [6]", logging.INFO),
             _line(18.0, "coordinator c1 took shards 0, 2 at epochs 5, 4: assigned by the "
                   "coordinators' group", logging.INFO)]
    assert _runs(shard_failures(lines, ORIGIN)) == [
        (10.0, 1, 1, True), (10.25, 3, 1, True), (16.0, 1, 1, True), (16.25, 5, 1, True),
        (16.5, 6, 1, True), (17.0, 7, 1, False)]


def _fault(at: float, kind: str, end: float | None = None) -> Fault:
    return Fault(at, at + 1.0 if end is None else end, kind)


def _failure(at: float, failures: int = 1) -> ShardFailure:
    return ShardFailure(at, 1, failures, ended=True, reason="StoreError")


def test_each_fault_gets_what_followed_it_until_the_next_one() -> None:
    acks = [x * 0.1 for x in range(0, 100)] + [14.0 + x * 0.1 for x in range(60)]
    timeline = Timeline(acks=acks, unconfirmed=[10.1, 10.2], lost=[],
                        duplicated=[12.0, 15.5, 15.6], amo_not_processed=[10.2], amo_twice=[],
                        failures=[ShardFailure(10.5, 1, 3, ended=True)], processed=acks)
    rows = fault_rows([_fault(5.0, "consumer"), _fault(10.0, "broker", 12.0),
                       _fault(16.0, "poison")], timeline, end=30.0)
    assert [(r.kind, r.unconfirmed, r.duplicated, r.amo_not_processed, r.shard_failures)
            for r in rows] == [("consumer", 0, 0, 0, 0), ("broker", 2, 3, 1, 3),
                               ("poison", 0, 0, 0, 0)]
    broker = rows[1]
    # No ack from 9.9 s to 14.0 s: the pause after the fault is 4.0 s, ended 4.0 s after it.
    assert broker.ack_pause is not None and broker.recovery is not None
    assert round(broker.ack_pause, 3) == 4.0 and round(broker.recovery, 3) == 4.0
    # Acks end at 19.9 s, in the last fault's window: measured up to the last ack.
    assert rows[2].ack_pause is not None and round(rows[2].ack_pause, 3) == 0.1
    late = fault_rows([_fault(25.0, "broker")], Timeline(acks=acks), end=30.0)
    assert [(r.kind, r.ack_pause, r.recovery) for r in late] == [("broker", None, None)]
    lines = table(rows)
    assert lines[0].startswith("| t (s) | fault | window (s) | unconfirmed | lost |")
    # The broker's window: from its start to its end (12.0) and 30 s of settling. Its canary
    # gap is over that window: nothing processed from 19.9 s to its end at 42.0 s.
    assert lines[3] == ("| 10.0 | broker | 10.0-42.0 | 2 | 0 | 3 | 1 | 0 | 4.0s | 4.0s | 3 "
                        "| 22.10s |")
    # A consumer's SIGKILL has no window: over its row's span, 5.0 to 10.0 s.
    assert rows[0].canary_gap is not None and round(rows[0].canary_gap, 3) == 0.1
    assert lines[2].split(" | ")[2] == "-"  # a consumer's SIGKILL has no window


def test_what_happened_before_the_first_fault_gets_a_row_only_when_it_counted_something(
) -> None:
    quiet = fault_rows([_fault(5.0, "consumer")], Timeline(acks=[1.0, 6.0, 40.0]), end=30.0)
    assert [r.kind for r in quiet] == ["consumer"]
    early = fault_rows([_fault(5.0, "consumer")],
                       Timeline(acks=[1.0, 6.0, 40.0], lost=[2.0]), end=30.0)
    assert [(r.kind, r.lost) for r in early] == [("before faults", 1), ("consumer", 0)]


def test_a_failure_is_charged_by_its_exact_time_not_its_time_rounded_to_a_tenth() -> None:
    # The false fail the rounding made: a poison record at 11.1 s, PostgreSQL crashed at
    # 13.16 s (printed 13.2), a shard failing 10 ms later, at 13.17 s. Rounded, the crash
    # began after the failure and the poison record was charged with it.
    poison, crash = _fault(11.1, "poison", 12.0), _fault(13.16, "postgres", 25.0)
    assert charged_to([poison, crash], 13.17) == 1
    assert charged_to([poison, replace(crash, at=13.2)], 13.17) == 0  # as rounding did
    # And the other way: a failure the poison record caused at 20.02 s stays the poison's
    # when the next fault began at 20.04 s (printed 20.0).
    nxt = _fault(20.04, "coordinator")
    assert charged_to([poison, nxt], 20.02) == 0
    assert charged_to([poison, nxt], 20.05) == 1


def test_a_window_is_the_action_and_its_settle_time_and_a_failure_outside_every_one_is_none(
) -> None:
    kill = _fault(5.0, "coordinator", 6.0)  # settles 20 s: window [5.0, 26.0]
    assert [charged_to([kill], t) for t in (4.999, 5.0, 26.0, 26.001)] == [None, 0, 0, None]
    # A consumer's SIGKILL has no window: a shard failure then is charged to no fault.
    assert charged_to([_fault(5.0, "consumer")], 5.5) is None
    # Within two windows, the fault that started last takes it.
    assert charged_to([kill, _fault(10.0, "broker", 20.0)], 12.0) == 1
    rows = fault_rows([kill], Timeline(failures=[_failure(5.5, 2), _failure(27.0, 3)]),
                      end=40.0)
    assert [(r.kind, r.shard_failures) for r in rows] == [("coordinator", 2), (NO_FAULT, 3)]
    assert rows[1].at == 27.0


def test_an_input_fault_waits_for_outages_windows_and_nothing_starts_in_its_window() -> None:
    crash = _fault(13.1, "postgres", 25.0)  # window [13.1, 55.0]
    kill = _fault(30.0, "coordinator", 31.0)  # window [30.0, 51.0]
    # The poison record waits until PostgreSQL's late failures are charged to PostgreSQL ...
    assert quiet_from("poison", [crash, kill]) == 55.0
    assert quiet_from("journal_deleted", [crash]) == 55.0
    # ... but not for a coordinator's window: the journal may be deleted while its shard
    # changes owner (docs/development.md); a failure then is charged to the deletion.
    assert quiet_from("journal_deleted", [kill]) == 0.0
    # Other faults may overlap outages, and none starts in an input fault's window.
    assert quiet_from("coordinator", [crash]) == 0.0
    poison = _fault(56.0, "poison", 70.0)
    assert quiet_from("coordinator", [crash, poison]) == 80.0
    assert quiet_from("consumer", [poison]) == 80.0
    # So a PostgreSQL failure just before the poison record is PostgreSQL's, and one just
    # after the poison record started is the poison record's.
    assert charged_to([crash, kill, poison], 54.9) == 0
    assert charged_to([crash, kill, poison], 56.1) == 2


def test_every_kind_of_fault_has_a_count_in_the_plan_and_an_action() -> None:
    plan = SoakPlan()
    for kind in FAULT_KINDS:
        assert isinstance(getattr(plan, kind.plan_field), int), kind
        assert callable(getattr(Soak, Soak.ACTIONS[kind.name])), kind
    assert set(Soak.ACTIONS) == {k.name for k in FAULT_KINDS}
    drawn = [kind for _, kind in plan.faults()]
    assert {k.name: drawn.count(k.name) for k in FAULT_KINDS} == {
        k.name: getattr(plan, k.plan_field) for k in FAULT_KINDS}


def test_the_audit_verdict_is_read_from_the_json_document_or_says_why_there_is_none() -> None:
    document = {"queue": "Q", "done": 7, "pending": 1, "ok": False, "output": "/tmp/r",
                "violations": [{"bookmark": "j/0/4", "violation": "acked_twice"}]}
    assert audit_verdict("Q", 3, "note: x\n" + json.dumps(document, indent=2), "") == (
        AuditVerdict("Q", 7, 1, (("acked_twice", "j/0/4"),), output="/tmp/r"))
    # A document without the verdict's fields is said, not a crash.
    odd = audit_verdict("Q", 0, json.dumps({"queue": "Q"}), "")
    assert odd.error is not None and "'done'" in odd.error
    failed = audit_verdict("Q", 1, "", "Traceback...\nerror: the reconcile job failed: boom\n")
    assert failed == AuditVerdict("Q", error="exit 1: error: the reconcile job failed: boom")
