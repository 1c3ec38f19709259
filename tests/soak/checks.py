"""The soak's checks against the published set, without I/O (tests/unit/test_soak_checks.py).

Every check compares sets and names what differs (values, bookmarks), so a summary that says
"nothing lost" means each value that had to be processed was, not that two counts matched:

- `publish_figures`: what was attempted, what the broker confirmed, what is in the journal,
  and from them the values that must be processed (`PublishFigures.must_process`);
- `match_acked`: the at-least-once queue's ACKED events against its entries of published
  values, bookmark by bookmark;
- `audit_problems`: `qlayer pipeline reconcile`'s ``done`` and ``pending``, and its status of
  each entry, against the entries of published values;
- `processed_lines`: the consumers' records of what they processed, whole lines only;
- `hostile_problems`: a hostile tenant's phase (tests/soak/hostile.py): the canary's worst
  gap in its window, every hostile record refused and counted, nothing of the soak's
  consumers' sessions changed, nothing of the tenant's written to the journal or the events.

docs/development.md ("The fault-injection soak") states each definition; keep them in step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.soak.report import AuditVerdict, worst_gap


@dataclass(frozen=True)
class PublishFigures:
    """The published set, from the publisher's own record and the journal read back.

    ``attempted``: every value handed to the producer. ``confirmed``: those whose delivery
    report came without an error. ``journaled``: the values found in the journal (read to its
    end once everything was done). The values that must be processed, ``must_process``, are
    every confirmed one and every journaled one: a produce can succeed while its report is
    lost (the broker SIGKILLed after it wrote the record), and then the queue has the record
    like any other. An unconfirmed value absent from the journal was never published: it is
    reported (``unconfirmed_not_journaled``), not lost.
    """

    attempted: frozenset[int]
    confirmed: frozenset[int]
    journaled: frozenset[int]
    must_process: frozenset[int] = field(init=False)
    unconfirmed: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "must_process", self.confirmed | self.journaled)
        object.__setattr__(self, "unconfirmed", self.attempted - self.confirmed)

    @property
    def unconfirmed_journaled(self) -> list[int]:
        """Attempted, not confirmed, in the journal anyway (their report was lost)."""
        return sorted(self.unconfirmed & self.journaled)

    @property
    def unconfirmed_not_journaled(self) -> list[int]:
        """Attempted, not confirmed, not in the journal: never published. Not lost."""
        return sorted(self.unconfirmed - self.journaled)

    @property
    def confirmed_not_journaled(self) -> list[int]:
        """Confirmed by the broker and missing from the journal: the broker lost a write it
        acknowledged (or the journal was not read to its end). Always a problem."""
        return sorted(self.confirmed - self.journaled)

    @property
    def journaled_not_attempted(self) -> list[int]:
        """In the journal, never attempted: the soak's own record is wrong. A problem."""
        return sorted(self.journaled - self.attempted)


def publish_figures(attempted: Iterable[int], confirmed: Iterable[int],
                    journaled: Iterable[int]) -> PublishFigures:
    return PublishFigures(frozenset(attempted), frozenset(confirmed), frozenset(journaled))


def lost(must_process: Collection[int], processed: Collection[int]) -> list[int]:
    """At-least-once: the values that had to be processed (`PublishFigures.must_process`) and
    were not, by any consumer, ever."""
    return sorted(set(must_process) - set(processed))


def not_published(processed: Iterable[int], journaled: Collection[int]) -> list[int]:
    """Values a consumer processed that are not in the journal: nothing can deliver a record
    the journal does not have, so each is a problem (or a misread of the journal)."""
    return sorted(set(processed) - set(journaled))


@dataclass(frozen=True)
class AckedFigures:
    """The ACKED events of the at-least-once queue against its entries of published values,
    by bookmark: entries without one, entries with more than one, and ACKED events for a
    bookmark that is no entry of a published value (``unknown``)."""

    without: list[str]
    twice: list[str]
    unknown: list[str]

    @property
    def ok(self) -> bool:
        return not (self.without or self.twice or self.unknown)


def match_acked(entries: Collection[str], acked: Mapping[str, int]) -> AckedFigures:
    """Every entry (bookmark) of a published value has exactly one ACKED event, and every
    ACKED event names such an entry. ``acked`` counts the ACKED events per bookmark."""
    known = set(entries)
    return AckedFigures(
        without=sorted(b for b in known if acked.get(b, 0) == 0),
        twice=sorted(b for b in known if acked.get(b, 0) > 1),
        unknown=sorted(b for b, n in acked.items() if n > 0 and b not in known))


@dataclass(frozen=True)
class AuditCheck:
    """`reconcile` of one queue against the entries it must have: its verdict, how many it
    should have found done, and the bookmarks that differ (expected and not done, done and
    not expected), when its per-entry statuses could be read (``statuses_read``)."""

    queue: str
    done: int
    pending: int
    expected: int
    violations: list[tuple[str, str]]
    error: str | None
    statuses_read: bool
    expected_not_done: list[str]
    done_not_expected: list[str]
    problems: list[str]


def audit_check(verdict: AuditVerdict, expected: Collection[str],
                statuses: Mapping[str, str] | None) -> AuditCheck:
    """The audit passes when it ran, found no violation, nothing pending, and ``done`` is
    exactly the entries expected: the count it prints equals ``len(expected)``, and, from its
    per-entry output (``statuses``, bookmark → status), the set of entries ``done`` equals
    ``expected``. An audit that saw nothing (done 0) fails against a non-empty ``expected``;
    one whose per-entry output could not be read (``statuses`` None) fails too, as its count
    alone cannot show that it judged the right entries."""
    want = set(expected)
    problems: list[str] = []
    q = verdict.queue
    if verdict.error:
        problems.append(f"the audit of {q} did not run: {verdict.error}")
    missing: list[str] = []
    extra: list[str] = []
    if not verdict.error:
        if verdict.done != len(want):
            problems.append(f"the audit of {q} found {verdict.done} entries done, not the "
                            f"{len(want)} entries of published values")
        if verdict.pending:
            problems.append(f"the audit of {q} found {verdict.pending} entries pending after "
                            "the drain")
        if statuses is None:
            problems.append(f"the audit of {q}: its per-entry statuses (--output) could not "
                            "be read, so its entries were not compared with the published set")
        else:
            done = {b for b, status in statuses.items() if status == "done"}
            missing = sorted(want - done)
            extra = sorted(done - want)
            if missing:
                problems.append(f"the audit of {q}: {len(missing)} entries of published "
                                f"values not done, e.g. "
                                + ", ".join(f"{b} ({statuses.get(b, 'absent')})"
                                            for b in missing[:5]))
            if extra:
                problems.append(f"the audit of {q}: {len(extra)} entries done that are no "
                                f"published value's, e.g. {extra[:5]}")
            if len(done) != verdict.done:
                problems.append(f"the audit of {q} printed {verdict.done} done and its "
                                f"per-entry output has {len(done)}")
        if verdict.violations:
            problems.append(f"the audit of {q} found {len(verdict.violations)} violations: "
                            + "; ".join(f"{v} {b}" for v, b in verdict.violations[:10]))
    return AuditCheck(q, verdict.done, verdict.pending, len(want), list(verdict.violations),
                      verdict.error, statuses is not None, missing, extra, problems)


@dataclass
class Processed:
    """What the consumers recorded: per queue, how many times each value was processed and
    the epoch seconds of each time; and the lines passed over (cut short by a SIGKILL)."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    partial: list[str] = field(default_factory=list)


def processed_lines(texts: Iterable[str], queues: Iterable[str]) -> Processed:
    """The consumers' output files (``queue<TAB>value<TAB>epoch seconds`` lines). Only whole
    lines count: a SIGKILL between two writes of the worker's buffer can leave the last line
    of a file cut, and a cut value (``12`` of ``123``) would count a record processed that was
    not. A line without its newline, or without its three fields, is passed over and kept in
    ``partial`` for the report."""
    found = Processed(counts={q: Counter() for q in queues})
    for text in texts:
        *lines, tail = text.split("\n")
        if tail:
            found.partial.append(tail)
        for line in lines:
            parts = line.split("\t")
            if len(parts) != 3 or parts[0] not in found.counts or not parts[1]:
                if line:
                    found.partial.append(line)
                continue
            queue, value, at = parts
            try:
                seconds = float(at)
            except ValueError:
                found.partial.append(line)
                continue
            found.counts[queue][value] += 1
            found.seconds.setdefault((queue, value), []).append(seconds)
    return found



# --- the hostile tenant ---------------------------------------------------------------------

#: The most the canary (the at-least-once queue) may go without processing a record in the
#: hostile phase's window (seconds): docs/security.md "Cost isolation" (0.05 s for a refused
#: filter and under 1 s for the ack flood, measured alone).
MAX_CANARY_GAP = 1.0
#: Events that end or change a session (a Replace moves it; a Subscribe under its id with
#: another session takes the id over).
SESSION_CHANGES = frozenset({"CONSUMER_UNSUBSCRIBED", "CONSUMER_TIMED_OUT",
                             "CONSUMER_EVICTED", "CONSUMER_REPLACED"})


@dataclass
class HostileOutcome:
    """One hostile phase (tests/soak/hostile.py) and what it changed; `hostile_problems`
    judges it. Times are seconds since the soak's first record; its window is ``[at,
    closes]``.

    Filled when the phase ends: ``expected`` (`Attack.expected`: ``[what, how many,
    counters]``), ``counted`` (each stored counter's increment over the phase, added up over
    the shards), ``answers`` and ``replies`` (the tenant's own Subscribes: request id →
    ``[what, status it must get]``, and the status that came), ``broker_refused``, the
    ``victims`` (``[consumer id, session id]`` of every live session of the soak's consumers
    the forgeries named) and ``victims_gone`` (those whose session the store no longer had
    when the phase ended). Filled by the soak's final check: the canary's worst gap in the
    window (None: not measured, as publishing had ended before the window closed) and in as
    long a span just before it (``canary_before``, for comparison), the events of the
    tenant's ids and sessions that are not refusals (``hostile_events``), the victims'
    sessions ended or changed in the window (``sessions_ended``), the journal's records that
    carry qlayer headers (``journal_records``: a delivery or a reply written there) and the
    events topic's records that are no event (``events_foreign``)."""

    at: float
    end: float
    closes: float
    expected: list[list[Any]] = field(default_factory=list)
    counted: dict[str, int] = field(default_factory=dict)
    answers: dict[str, list[str]] = field(default_factory=dict)
    replies: dict[str, str] = field(default_factory=dict)
    broker_refused: dict[str, list[str]] = field(default_factory=dict)
    records: int = 0
    wrote_for: float = 0.0
    victims: list[list[str]] = field(default_factory=list)
    victims_gone: list[str] = field(default_factory=list)
    #: The machine's load averages (1 min) when the phase began and ended: CPU contention
    #: from other work widens the canary's gaps.
    load: list[float] = field(default_factory=list)
    canary_gap: float | None = None
    canary_before: float | None = None
    publishing_ended: float | None = None
    refused_events: int = 0
    hostile_events: list[str] = field(default_factory=list)
    sessions_ended: list[str] = field(default_factory=list)
    journal_records: list[str] = field(default_factory=list)
    events_foreign: int = 0


def increments(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Each counter's increment from ``before`` to ``after`` (totals over the shards), the
    counters that moved only."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def canary_gap(processed: Sequence[float], start: float, end: float,
               publishing_ended: float) -> float | None:
    """The canary's worst gap in ``[start, end]`` (`report.worst_gap` over the at-least-once
    queue's processing times, sorted), or None when publishing ended before ``end``: with
    nothing left to deliver, a gap says nothing of the phase."""
    if publishing_ended < end:
        return None
    return worst_gap(processed, start, end)


@dataclass(frozen=True)
class Seen:
    """An event as the hostile checks need it: when (seconds since the first record), its
    type's name, its consumer and session ids."""

    at: float
    type: str
    consumer_id: str | None
    session_id: str | None


def hostile_events(events: Iterable[Seen], consumer_ids: Collection[str],
                   sessions: Collection[str], victims: Iterable[Sequence[str]], start: float,
                   end: float) -> tuple[list[str], list[str], int]:
    """What the tenant's records left on the events topic: its events that are not
    ``SUBSCRIBE_REFUSED`` (any time: a session of its, a lease, ...), the victims' sessions
    ended or changed in ``[start, end]`` (an Unsubscribe, a time-out, an eviction, a Replace,
    or a Subscribe of the victim's id with another session), and how many refusals."""
    ids, own = set(consumer_ids), set(sessions)
    victim_of = {str(c): str(s) for c, s in victims}
    found: list[str] = []
    ended: list[str] = []
    refusals = 0
    for e in events:
        said = f"{e.type}@{e.at:.3f}s {e.consumer_id}/{e.session_id}"
        if e.consumer_id in ids or e.session_id in own:
            if e.type == "SUBSCRIBE_REFUSED":
                refusals += 1
            else:
                found.append(said)
        if e.consumer_id in victim_of and start <= e.at <= end:
            session = victim_of[e.consumer_id]
            if ((e.type in SESSION_CHANGES and e.session_id == session)
                    or (e.type == "CONSUMER_SUBSCRIBED" and e.session_id != session)):
                ended.append(said)
    return found, ended, refusals


def refusals_missing(expected: Iterable[Sequence[Any]], counted: Mapping[str, int]
                     ) -> list[str]:
    """Each kind of hostile record (``[what, how many, counters]``) whose counters, added up,
    moved less than it had records: a record not refused and counted (acted on, or lost).
    Kinds that name the same counters are judged together (their records added up), or a
    count of one kind's records would pass another kind's missing ones."""
    kinds: dict[tuple[str, ...], tuple[list[str], int]] = {}
    for what, count, counters in expected:
        names, total = kinds.get(tuple(counters), ([], 0))
        kinds[tuple(counters)] = ([*names, str(what)], total + int(count))
    missing = []
    for counters, (names, count) in kinds.items():
        got = sum(counted.get(name, 0) for name in counters)
        if got < count:
            missing.append(f"{' and '.join(names)}: {count} written, {got} refusals counted "
                           f"({' + '.join(counters)})")
    return missing


def hostile_problems(o: HostileOutcome, max_gap: float = MAX_CANARY_GAP) -> list[str]:
    """Why a hostile phase failed: the canary waited more than ``max_gap`` in its window (or
    could not be measured); a record was not counted as refused; one of the tenant's own
    Subscribes was not answered, or not as it must be (the hostile ones refused, the
    principal's control accepted); no session to forge records against; a victim's session
    ended or changed; an event of the tenant's that is not a refusal; a delivery or reply in
    the journal; a record on the events topic that is no event."""
    found: list[str] = []
    where = f"hostile phase at t={o.at:.1f}s"
    if o.canary_gap is None:
        found.append(f"{where}: the canary was not measured: publishing ended at "
                     f"t={o.publishing_ended}s, before the window closed at t={o.closes:.1f}s")
    elif o.canary_gap > max_gap:
        found.append(f"{where}: the canary (the at-least-once queue) went {o.canary_gap:.2f}s "
                     f"without processing a record in the window, over {max_gap:g}s "
                     f"(before it: {o.canary_before}s; load {o.load})")
    found.extend(f"{where}: {m}" for m in refusals_missing(o.expected, o.counted))
    for request_id, (what, status) in o.answers.items():
        got = o.replies.get(request_id)
        if got is None:
            found.append(f"{where}: {what}: no answer on the tenant's delivery topic")
        elif got != status:
            found.append(f"{where}: {what}: answered {got}, not {status}")
    if not o.victims:
        found.append(f"{where}: no live session of a soak consumer to forge records against")
    if o.victims_gone:
        found.append(f"{where}: sessions of soak consumers gone from the store: "
                     + ", ".join(o.victims_gone))
    if o.sessions_ended:
        found.append(f"{where}: sessions of soak consumers ended or changed in its window: "
                     + "; ".join(o.sessions_ended[:10]))
    if o.hostile_events:
        found.append(f"{where}: events of the tenant's ids or sessions that are no refusal: "
                     + "; ".join(o.hostile_events[:10]))
    if o.journal_records:
        found.append(f"{where}: records with qlayer headers in the journal (a delivery or a "
                     f"reply written there): {o.journal_records[:10]}")
    if o.events_foreign:
        found.append(f"{where}: {o.events_foreign} records on the events topic that are no "
                     "event")
    return found
