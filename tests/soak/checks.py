"""The soak's checks against the published set, without I/O (tests/unit/test_soak_checks.py).

Every check compares sets and names what differs (values, bookmarks), so a summary that says
"nothing lost" means each value that had to be processed was, not that two counts matched:

- `publish_figures`: what was attempted, what the broker confirmed, what is in the journal,
  and from them the values that must be processed (`PublishFigures.must_process`);
- `match_acked`: the at-least-once queue's ACKED events against its entries of published
  values, bookmark by bookmark;
- `audit_problems`: `qlayer pipeline reconcile`'s ``done`` and ``pending``, and its status of
  each entry, against the entries of published values;
- `processed_lines`: the consumers' records of what they processed, whole lines only.

docs/development.md ("The fault-injection soak") states each definition; keep them in step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from tests.soak.report import AuditVerdict


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

