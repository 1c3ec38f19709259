"""The soak's figures from what it recorded, without I/O (tests/unit/test_soak_report.py):
the kinds of fault and their windows, the table per fault, the shard failures in the
coordinators' JSON logs and the fault each is charged to, and the verdict of `qlayer pipeline
reconcile --json`. The checks on the published set are in `tests/soak/checks.py`.

Times are seconds since the soak's first record was published, like the fault schedule's,
and exact: a fault's start and end are taken from the soak's clock around its action, a shard
failure's from its log line (milliseconds). They are rounded only where a table prints them.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
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
#: ... or the shard is taken again (its owner runs it from stored state under a new epoch), or
#: the process found Kafka answering again after an outage and starts every shard again: a
#: shard that failed and then ran on like that logs no "runs again" (the soak once called such
#: a shard a rebuild loop).
_TAKES = re.compile(r"^coordinator \S+ took shards? ([\d, ]+) at epochs? ")
#: ... or the coordinators' group takes the shard from the process (`layer/kafka/shards.py`):
#: a shard that was failing then is not given up by name (it had no running slot to stop).
_GROUP_TAKES = re.compile(r"^coordinator group (?:lost|revoked) shards \[([\d, ]*)\]")
_KAFKA_BACK = "Kafka answers again"


# --- the kinds of fault -----------------------------------------------------------------


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault (or phase) the soak injects: each has its own rows in the table.

    A new one (a hostile tenant, say) is a `FaultKind` here, a count in `SoakPlan` named by
    ``plan_field``, and an action in `Soak.ACTIONS` (tests/soak/run.py) that does it and
    returns when it is over; its window, the shard failures charged to it and its row follow.
    """

    name: str
    #: The `SoakPlan` field that says how many of this fault the soak injects.
    plan_field: str
    #: How long after its action ended (seconds) a shard failure may still be its doing: its
    #: window is ``[start, end + settle]``. None: it cannot fail a shard at all (it has no
    #: window; a failure then is charged to another fault or to none).
    settle: float | None
    #: An input fault (bad input, not a dead process or server) must cost no shard failure.
    #: So that what is charged to it is its own doing: it starts only once no window of a
    #: ``holds_input`` fault is open, and no fault starts while its window is open.
    input: bool = False
    #: Faults known to fail shards for a while after they end (an outage): an input fault
    #: waits until their window has closed.
    holds_input: bool = False
    #: Its window overlaps no other fault's: it starts only once every earlier fault's window
    #: has closed (a coordinator SIGKILL's too), and no fault starts while its window is open.
    #: For a phase whose effect is measured against a quiet baseline (the hostile tenant's
    #: canary gap): a takeover's stall in its window would be charged to it.
    apart: bool = False


#: The faults of the soak, in the order `SoakPlan.faults` draws them. The settle times are
#: what this machine showed, with room: a SIGKILLed owner's shards are taken by the other
#: process after the group's session timeout (6 s, tests/support/processes.py) and a restore;
#: after an outage a process's pooled PostgreSQL connections, or its Kafka clients, fail
#: once each when next used, and a shard's retries back off up to 30 s; the poison record's
#: and the deleted journal's actions wait until the coordinators have dealt with them, so
#: their settle covers only the iteration that does; so does the hostile tenant's, which waits
#: until the shards counted every record it wrote.
FAULT_KINDS: tuple[FaultKind, ...] = (
    FaultKind("coordinator", "coordinator_kills", settle=20.0),
    # A consumer's death breaks its leases (a session timeout); no shard rebuilds for it.
    FaultKind("consumer", "consumer_kills", settle=None),
    FaultKind("broker", "broker_kills", settle=30.0, holds_input=True),
    FaultKind("postgres", "postgres_crashes", settle=30.0, holds_input=True),
    FaultKind("poison", "poison_records", settle=10.0, input=True),
    FaultKind("journal_deleted", "journal_deletions", settle=10.0, input=True),
    # Hostile records (filters over the limits, an ack flood, forgeries, oversized and
    # malformed records: tests/soak/hostile.py) must cost no shard a failure, like bad input,
    # and are judged by the canary's gap in their window, so nothing else may share it. Its
    # action lasts until the shards stored every record's refusal count, which only an
    # iteration that committed does: a failure it causes comes before that.
    FaultKind("hostile", "hostile_phases", settle=5.0, input=True, apart=True),
)
KINDS: dict[str, FaultKind] = {k.name: k for k in FAULT_KINDS}


@dataclass(frozen=True)
class Fault:
    """One fault as it happened: its action began at ``at`` and was over at ``end``."""

    at: float
    end: float
    kind: str
    what: str = ""

    @property
    def closes(self) -> float | None:
        """When its window closes (None: it has none)."""
        settle = KINDS[self.kind].settle
        return None if settle is None else self.end + settle

    def holds(self, t: float) -> bool:
        """Whether ``t`` is in its window, ``[at, end + settle]`` (both ends included)."""
        closes = self.closes
        return closes is not None and self.at <= t <= closes


def charged_to(faults: Sequence[Fault], t: float) -> int | None:
    """The fault a shard failure at ``t`` is charged to (its index), or None.

    The rule: among the faults whose window holds ``t``, the one that started last; none
    when no window holds it (the failure came between faults, after the earlier one's window
    closed). Exact times, no rounding: a PostgreSQL crash 10 ms after a 0.1 s mark keeps the
    failure it caused 20 ms later. Windows overlap: a failure in an input fault's window and
    an earlier fault's is charged to the input fault (the later one), so a failure is never
    taken off an input fault by a coincidence; `quiet_from` keeps outages' windows apart from
    input faults', so one cannot be charged with an outage's failures either.
    """
    best: int | None = None
    for i, fault in enumerate(faults):
        if fault.holds(t) and (best is None or fault.at >= faults[best].at):
            best = i
    return best


def quiet_from(kind: str, done: Sequence[Fault]) -> float:
    """The earliest time a fault of ``kind`` may start after the faults ``done``: once every
    input or ``apart`` fault's window has closed (nothing starts inside one), for an input
    fault also every ``holds_input`` fault's (an outage's late failures are not charged to
    it), and for an ``apart`` fault every fault's window."""
    it = KINDS[kind]
    closes = [f.closes for f in done if f.closes is not None
              and (it.apart or KINDS[f.kind].input or KINDS[f.kind].apart
                   or (it.input and KINDS[f.kind].holds_input))]
    return max((c for c in closes if c is not None), default=0.0)


# --- shard failures in the coordinators' logs ---------------------------------------------


@dataclass(frozen=True)
class ShardFailure:
    """One run of failures of one shard: when it began (the first failure's log time) and
    how many failures (rebuilds) it had before the shard ran again; ``ended`` False when it
    never ran again in that log. ``reason`` and ``message`` are the first failure's (the
    log's ``reason`` field: ``Kafka`` or the error's class) and ``source`` the log's name:
    the evidence a report quotes."""

    at: float
    shard: int
    failures: int
    ended: bool
    reason: str = ""
    message: str = ""
    source: str = ""

    def said(self) -> str:
        return (f"shard {self.shard} at t={self.at:.3f}s ({self.failures} failures"
                f"{'' if self.ended else ', never ended'}) in {self.source or 'a log'}: "
                f"{self.reason}: {self.message[:160]}")


def shard_failures(lines: Iterable[str], origin: float, source: str = "") -> list[ShardFailure]:
    """The shard failures in one coordinator's ``--log-format json`` log (the processes of
    one name, one after another); ``origin`` is the epoch second that is time 0, ``source``
    names the log. Lines that are not JSON (a traceback) are passed over. A run still open at
    the end of the log is ``ended=False``: the shard failed until the soak stopped the
    process."""
    open_: dict[int, tuple[float, str, str]] = {}
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
            open_.setdefault(record["shard"], (t, str(record.get("reason", "")), message))
            continue
        again = _RUNS_AGAIN.match(message)
        if again:
            shard, count = int(again.group(1)), int(again.group(2))
            if shard in open_:
                found.append(_run(shard, open_.pop(shard), count, True, source))
            continue
        ended = _GIVES_UP.match(message) or _TAKES.match(message) or _GROUP_TAKES.match(message)
        if ended:
            for shard in (int(n) for n in re.findall(r"\d+", ended.group(1))):
                if shard in open_:
                    found.append(_run(shard, open_.pop(shard), 1, True, source))
        elif message.startswith((_STARTS, _KAFKA_BACK)):
            found.extend(_run(shard, first, 1, True, source) for shard, first in open_.items())
            open_.clear()
    found.extend(_run(shard, first, 1, False, source) for shard, first in open_.items())
    return sorted(found, key=lambda f: f.at)


def _run(shard: int, first: tuple[float, str, str], count: int, ended: bool,
         source: str) -> ShardFailure:
    at, reason, message = first
    return ShardFailure(at, shard, count, ended, reason, message, source)


#: The kind of the rows that are not a fault: what came before the first fault, and the
#: shard failures no fault's window holds.
BEFORE_FAULTS = "before faults"
NO_FAULT = "no fault (outside every window)"


@dataclass(frozen=True)
class FaultRow:
    """What followed one fault: records by their time up to the next fault's start (or the
    end of the soak), shard failures by the charge rule (`charged_to`)."""

    at: float
    kind: str
    #: When its window closes (None: it has none); its action ended at ``end``.
    end: float | None
    closes: float | None
    #: Values attempted in this span whose publishing the broker never confirmed.
    unconfirmed: int
    #: At-least-once records (journaled in this span, or confirmed in it when not in the
    #: journal) never processed.
    lost: int
    #: At-least-once records processed again in this span (the second processing's time).
    duplicated: int
    #: At-most-once records journaled in this span never processed (leased to a consumer
    #: that was SIGKILLed: what at-most-once allows) and processed twice (never allowed).
    amo_not_processed: int
    amo_twice: int
    #: The longest time without an ACKED event from the fault to the first ack after the
    #: span, and when acks flowed again after it (since the fault); None: no ack after.
    ack_pause: float | None
    recovery: float | None
    #: Shard failures (each one a rebuild from stored state) charged to this fault.
    shard_failures: int
    #: The canary's worst gap: the longest time the at-least-once queue's consumers went
    #: without processing a record (`checks.worst_gap`), over the fault's window, or over the
    #: row's span for a row without one. None: nothing was processed after the fault.
    canary_gap: float | None = None

    def cells(self) -> list[str]:
        def s(v: float | None, digits: int = 1) -> str:
            return "-" if v is None else f"{v:.{digits}f}s"

        window = "-" if self.closes is None else f"{self.at:.1f}-{self.closes:.1f}"
        return [f"{self.at:.1f}", self.kind, window, str(self.unconfirmed), str(self.lost),
                str(self.duplicated), str(self.amo_not_processed), str(self.amo_twice),
                s(self.ack_pause), s(self.recovery), str(self.shard_failures),
                s(self.canary_gap, 2)]


TABLE_HEADER = ["t (s)", "fault", "window (s)", "unconfirmed", "lost", "duplicated",
                "amo not processed", "amo twice", "pause in acks", "recovery",
                "shard failures", "canary gap"]


@dataclass
class Timeline:
    """Times (seconds since the first record) of what the soak counts."""

    acks: list[float] = field(default_factory=list)
    unconfirmed: list[float] = field(default_factory=list)
    lost: list[float] = field(default_factory=list)
    duplicated: list[float] = field(default_factory=list)
    amo_not_processed: list[float] = field(default_factory=list)
    amo_twice: list[float] = field(default_factory=list)
    failures: list[ShardFailure] = field(default_factory=list)
    #: When the at-least-once queue's consumers processed a record (each time, repeats too).
    processed: list[float] = field(default_factory=list)


def unexplained(faults: Sequence[Fault], failures: Iterable[ShardFailure]
                ) -> list[ShardFailure]:
    """The shard failures no fault's window holds (`charged_to` gives None)."""
    return [f for f in failures if charged_to(faults, f.at) is None]


def fault_rows(faults: Sequence[Fault], timeline: Timeline, end: float) -> list[FaultRow]:
    """A row per fault; records over ``[its start, the next fault's start)`` (the last one's up
    to ``end``), shard failures charged by `charged_to`, the canary's gap over its window
    (over the span for a row without one). A first row ``before faults`` when a record was
    counted before the first fault, and a last row ``no fault`` with the shard failures no
    window holds."""
    acks = sorted(timeline.acks)
    processed = sorted(timeline.processed)
    faults = sorted(faults, key=lambda f: f.at)
    charged = [0] * len(faults)
    for failure in timeline.failures:
        index = charged_to(faults, failure.at)
        if index is not None:
            charged[index] += failure.failures
    spans: list[tuple[float, str, Fault | None, int]] = [
        (f.at, f.kind, f, n) for f, n in zip(faults, charged, strict=True)]
    if not faults or faults[0].at > 0:
        spans.insert(0, (0.0, BEFORE_FAULTS, None, 0))
    rows = []
    for i, (at, kind, fault, failures) in enumerate(spans):
        until = spans[i + 1][0] if i + 1 < len(spans) else end

        def count(times: list[float], lo: float = at, hi: float = until) -> int:
            return sum(1 for t in times if lo <= t < hi)

        pause, recovery = _pause(acks, at, until)
        closes = None if fault is None else fault.closes
        row = FaultRow(at, kind, None if fault is None else fault.end, closes,
                       count(timeline.unconfirmed), count(timeline.lost),
                       count(timeline.duplicated), count(timeline.amo_not_processed),
                       count(timeline.amo_twice), pause, recovery, failures,
                       worst_gap(processed, at, until if closes is None else closes))
        if kind == BEFORE_FAULTS and not (row.unconfirmed or row.lost or row.duplicated
                                          or row.amo_twice or row.amo_not_processed):
            continue
        rows.append(row)
    stray = unexplained(faults, timeline.failures)
    if stray:
        rows.append(FaultRow(stray[0].at, NO_FAULT, None, None, 0, 0, 0, 0, 0, None, None,
                             sum(f.failures for f in stray)))
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


def worst_gap(times: Sequence[float], start: float, end: float) -> float:
    """The canary's worst gap in ``[start, end]``: the longest time without one of ``times``
    (sorted; when the at-least-once queue's consumers processed a record), counting from
    ``start`` to the first and from the last to ``end``, so a stall that runs past either
    edge counts up to it (one that began before ``start`` is not the window's doing); the
    whole span when nothing was processed in it."""
    inside = times[bisect_left(times, start):bisect_right(times, end)]
    points = [start, *inside, max(start, end)]
    return max(b - a for a, b in pairwise(points))


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
    #: Where ``--output`` wrote the status of every entry (a Parquet directory), if it did.
    output: str | None = None


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
    try:
        return AuditVerdict(queue, int(document["done"]), int(document["pending"]),
                            tuple((str(v["violation"]), str(v["bookmark"]))
                                  for v in document["violations"]),
                            output=document.get("output"))
    except (KeyError, TypeError, ValueError) as exc:
        # Not the document the soak reads its verdict from: a check, not a crash.
        return AuditVerdict(queue, error=f"exit {exit_status}: the JSON document has no "
                            f"usable {exc}")
