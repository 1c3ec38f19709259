"""The soak's figures (tests/soak/report.py): the table per fault, the shard failures read
from the coordinators' JSON logs, and the verdict of `qlayer pipeline reconcile --json`."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from layer.coordinator.logformat import JsonFormatter, fields
from tests.soak.report import (
    AuditVerdict,
    ShardFailure,
    Timeline,
    audit_verdict,
    fault_rows,
    shard_failures,
    table,
)

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


def test_shard_failures_are_runs_of_failures_with_their_count_and_an_unended_run_is_said() -> None:
    lines = [_failed(10.0, 2), "Traceback (not JSON)", _line(11.0, "coordinator took shards"),
             _failed(11.5, 2),  # the same run, of another kind
             _runs_again(14.5, 2, 5), _failed(30.0, 3)]
    assert shard_failures(lines, ORIGIN) == [
        ShardFailure(10.0, 2, 5, ended=True), ShardFailure(30.0, 3, 1, ended=False)]


def test_a_run_of_failures_ends_when_the_shard_is_given_up_or_the_process_starts_again(
) -> None:
    lines = [_failed(10.0, 1), _failed(11.0, 2),
             _line(12.0, "coordinator c0 gives up shard 1: the coordinators' group gave the "
                   "shard to another process", logging.WARNING, shard=1),
             # SIGKILLed while shard 2 failed; the next process of this name starts:
             _line(20.0, "shard core: native", logging.INFO)]
    assert shard_failures(lines, ORIGIN) == [
        ShardFailure(10.0, 1, 1, ended=True), ShardFailure(11.0, 2, 1, ended=True)]


def test_each_fault_gets_what_followed_it_until_the_next_one() -> None:
    acks = [x * 0.1 for x in range(0, 100)] + [14.0 + x * 0.1 for x in range(60)]
    timeline = Timeline(acks=acks, lost=[], duplicated=[12.0, 15.5, 15.6],
                        amo_not_processed=[10.2], amo_twice=[],
                        failures=[ShardFailure(10.5, 1, 3, ended=True)])
    rows = fault_rows([(5.0, "consumer"), (10.0, "broker"), (16.0, "poison")], timeline,
                      end=30.0)
    assert [(r.kind, r.duplicated, r.amo_not_processed, r.shard_failures) for r in rows] == [
        ("consumer", 0, 0, 0), ("broker", 3, 1, 3), ("poison", 0, 0, 0)]
    broker = rows[1]
    # No ack from 9.9 s to 14.0 s: the pause after the fault is 4.0 s, ended 4.0 s after it.
    assert broker.ack_pause is not None and broker.recovery is not None
    assert round(broker.ack_pause, 3) == 4.0 and round(broker.recovery, 3) == 4.0
    # Acks end at 19.9 s, in the last fault's window: measured up to the last ack.
    assert rows[2].ack_pause is not None and round(rows[2].ack_pause, 3) == 0.1
    late = fault_rows([(25.0, "broker")], Timeline(acks=acks), end=30.0)
    assert [(r.kind, r.ack_pause, r.recovery) for r in late] == [("broker", None, None)]
    lines = table(rows)
    assert lines[0].startswith("| t (s) | fault | lost | duplicated |")
    assert lines[3] == "| 10.0 | broker | 0 | 3 | 1 | 0 | 4.0s | 4.0s | 3 |"


def test_what_happened_before_the_first_fault_gets_a_row_only_when_it_counted_something(
) -> None:
    quiet = fault_rows([(5.0, "consumer")], Timeline(acks=[1.0, 6.0, 40.0]), end=30.0)
    assert [r.kind for r in quiet] == ["consumer"]
    early = fault_rows([(5.0, "consumer")], Timeline(acks=[1.0, 6.0, 40.0], lost=[2.0]),
                       end=30.0)
    assert [(r.kind, r.lost) for r in early] == [("before faults", 1), ("consumer", 0)]


def test_the_audit_verdict_is_read_from_the_json_document_or_says_why_there_is_none() -> None:
    document = {"queue": "Q", "done": 7, "pending": 1, "ok": False, "output": None,
                "violations": [{"bookmark": "j/0/4", "violation": "acked_twice"}]}
    assert audit_verdict("Q", 3, "note: x\n" + json.dumps(document, indent=2), "") == (
        AuditVerdict("Q", 7, 1, (("acked_twice", "j/0/4"),)))
    failed = audit_verdict("Q", 1, "", "Traceback...\nerror: the reconcile job failed: boom\n")
    assert failed == AuditVerdict("Q", error="exit 1: error: the reconcile job failed: boom")
