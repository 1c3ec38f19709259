"""The soak's figures from what it recorded, without I/O (tests/unit/test_soak_report.py):
the table per fault, the shard failures in the coordinators' JSON logs, and the verdict of
`qlayer pipeline reconcile --json`.

Times are seconds since the soak's first record was published, like the fault schedule's.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from typing import Any

#: The coordinator's error line when a shard fails (an iteration or taking it), and the
#: warning when it runs again: `layer/coordinator/process.py`, `_failed` and `_run_slot`.
_FAILED = re.compile(r"; rebuilding from stored state, retried with back-off")
_RUNS_AGAIN = re.compile(r"^shard (\d+) runs again, [\d.]+s and (\d+) failures after it first")
#: A run also ends when the shard is given up (another process takes it) or the process
#: starts again (the soak SIGKILLed it): not a loop, though it never said it ran again.
_GIVES_UP = re.compile(r"^coordinator \S+ gives up shard (\d+):")
_STARTS = "shard core: "


@dataclass(frozen=True)
class ShardFailure:
    """One run of failures of one shard: when it began and how many failures (rebuilds) it
    had before the shard ran again; ``ended`` False when it never ran again in that log."""

    at: float
    shard: int
    failures: int
    ended: bool


def shard_failures(lines: Iterable[str], origin: float) -> list[ShardFailure]:
    """The shard failures in one coordinator's ``--log-format json`` log (the processes of
    one name, one after another); ``origin`` is the epoch second that is time 0. Lines that
    are not JSON (a traceback) are passed over. A run still open at the end of the log is
    ``ended=False``: the shard failed until the soak stopped the process."""
    open_: dict[int, float] = {}
    found: list[ShardFailure] = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        message = str(record.get("message", ""))
        at = datetime.fromisoformat(str(record.get("time", "")).replace("Z", "+00:00"))
        t = at.timestamp() - origin
        if _FAILED.search(message) and isinstance(record.get("shard"), int):
            # Logged when failures start or change kind: a change of kind goes on the run.
            open_.setdefault(record["shard"], t)
            continue
        again = _RUNS_AGAIN.match(message)
        if again:
            shard, count = int(again.group(1)), int(again.group(2))
            if shard in open_:
                found.append(ShardFailure(open_.pop(shard), shard, count, ended=True))
            continue
        given_up = _GIVES_UP.match(message)
        if given_up and int(given_up.group(1)) in open_:
            shard = int(given_up.group(1))
            found.append(ShardFailure(open_.pop(shard), shard, 1, ended=True))
        elif message.startswith(_STARTS):
            found.extend(ShardFailure(at, shard, 1, ended=True) for shard, at in open_.items())
            open_.clear()
    found.extend(ShardFailure(t, shard, 1, ended=False) for shard, t in open_.items())
    return sorted(found, key=lambda f: f.at)


@dataclass(frozen=True)
class FaultRow:
    """What followed one fault, up to the next one (or the end of the soak)."""

    at: float
    kind: str
    #: At-least-once records published in this window never processed.
    lost: int
    #: At-least-once records processed again in this window (the second processing's time).
    duplicated: int
    #: At-most-once records published in this window never processed (leased to a consumer
    #: that was SIGKILLed: what at-most-once allows) and processed twice (never allowed).
    amo_not_processed: int
    amo_twice: int
    #: The longest time without an ACKED event from the fault to the first ack after the
    #: window, and when acks flowed again after it (since the fault); None: no ack after.
    ack_pause: float | None
    recovery: float | None
    #: Shard failures (each one a rebuild from stored state) begun in the window.
    shard_failures: int

    def cells(self) -> list[str]:
        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}s"

        return [f"{self.at:.1f}", self.kind, str(self.lost), str(self.duplicated),
                str(self.amo_not_processed), str(self.amo_twice), s(self.ack_pause),
                s(self.recovery), str(self.shard_failures)]


TABLE_HEADER = ["t (s)", "fault", "lost", "duplicated", "amo not processed", "amo twice",
                "pause in acks", "recovery", "shard failures"]


@dataclass
class Timeline:
    """Times (seconds since the first record) of what the soak counts."""

    acks: list[float] = field(default_factory=list)
    lost: list[float] = field(default_factory=list)
    duplicated: list[float] = field(default_factory=list)
    amo_not_processed: list[float] = field(default_factory=list)
    amo_twice: list[float] = field(default_factory=list)
    failures: list[ShardFailure] = field(default_factory=list)


def fault_rows(faults: Sequence[tuple[float, str]], timeline: Timeline,
               end: float) -> list[FaultRow]:
    """A row per fault over ``[its time, the next fault's)`` (the last one's up to ``end``);
    a first row ``before faults`` when anything was counted before the first fault."""
    acks = sorted(timeline.acks)
    starts = [(0.0, "before faults")] if faults else []
    windows = [*starts, *faults] if faults and faults[0][0] > 0 else list(faults)
    rows = []
    for i, (at, kind) in enumerate(windows):
        until = windows[i + 1][0] if i + 1 < len(windows) else end

        def count(times: list[float], lo: float = at, hi: float = until) -> int:
            return sum(1 for t in times if lo <= t < hi)

        pause, recovery = _pause(acks, at, until)
        failures = sum(f.failures for f in timeline.failures if at <= f.at < until)
        row = FaultRow(at, kind, count(timeline.lost), count(timeline.duplicated),
                       count(timeline.amo_not_processed), count(timeline.amo_twice),
                       pause, recovery, failures)
        if kind == "before faults" and not (row.lost or row.duplicated or row.amo_twice
                                            or row.amo_not_processed or row.shard_failures):
            continue
        rows.append(row)
    return rows


def _pause(acks: list[float], at: float, until: float) -> tuple[float | None, float | None]:
    """The longest gap in [at, first ack at or after until] between the fault and the acks,
    and how long after the fault that gap ended; when no ack came after ``until`` (the last
    fault), up to the last ack; None when no ack came after the fault at all."""
    lo = bisect_left(acks, at)
    hi = bisect_left(acks, until)
    points = [at, *acks[lo:hi]]
    if hi < len(acks):
        points.append(acks[hi])
    elif hi == lo:
        return None, None
    best, ended = 0.0, at
    for a, b in pairwise(points):
        if b - a > best:
            best, ended = b - a, b
    return best, ended - at


def table(rows: Sequence[FaultRow]) -> list[str]:
    """The rows as a Markdown table (also how the soak prints them)."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |",
             "|" + "|".join("---" for _ in TABLE_HEADER) + "|"]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return lines


@dataclass(frozen=True)
class AuditVerdict:
    """`qlayer pipeline reconcile --json` of one queue: its counts and its violations
    (name, bookmark), or why it did not run (``error``)."""

    queue: str
    done: int = 0
    pending: int = 0
    violations: tuple[tuple[str, str], ...] = ()
    error: str | None = None


def audit_verdict(queue: str, exit_status: int, stdout: str, stderr: str) -> AuditVerdict:
    """The verdict from the command's output: its JSON document (status 0 or 3), else the
    command's error."""
    start = stdout.find("{")
    document: Any = None
    if exit_status in (0, 3) and start >= 0:
        try:
            document = json.loads(stdout[start:])
        except ValueError:
            document = None
    if not isinstance(document, dict):
        last = [line for line in (stderr or stdout).strip().splitlines() if line.strip()]
        return AuditVerdict(queue, error=f"exit {exit_status}: "
                            f"{last[-1] if last else 'no output'}")
    return AuditVerdict(queue, int(document["done"]), int(document["pending"]),
                        tuple((str(v["violation"]), str(v["bookmark"]))
                              for v in document["violations"]))
