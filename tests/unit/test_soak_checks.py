"""The soak's checks against the published set (tests/soak/checks.py), and that the soak's
verdict (`SoakResult.problems`) fails on each: every check is fed an input it must fail and
one it must pass."""

from __future__ import annotations

from collections import Counter

from tests.soak.checks import (
    audit_check,
    lost,
    match_acked,
    not_published,
    processed_lines,
    publish_figures,
)
from tests.soak.report import AuditVerdict
from tests.soak.run import ALO, AMO, SoakPlan, SoakResult

# --- publishing and "lost" ------------------------------------------------------------------


def test_what_must_be_processed_is_every_confirmed_value_and_every_journaled_one() -> None:
    # 0..9 attempted; 7, 8 and 9 never confirmed; 8 in the journal anyway (its report was
    # lost with the broker); 6 confirmed and missing from the journal.
    figures = publish_figures(range(10), [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 8])
    assert figures.must_process == frozenset({0, 1, 2, 3, 4, 5, 6, 8})
    assert figures.unconfirmed_journaled == [8]
    assert figures.unconfirmed_not_journaled == [7, 9]  # reported, not lost
    assert figures.confirmed_not_journaled == [6]
    assert figures.journaled_not_attempted == []
    assert publish_figures([1], [1], [1, 2]).journaled_not_attempted == [2]


def test_a_confirmed_value_never_processed_is_lost() -> None:
    figures = publish_figures(range(5), range(5), range(5))
    assert lost(figures.must_process, [0, 1, 2, 3, 4, 4]) == []
    assert lost(figures.must_process, [0, 1, 3, 4]) == [2]


def test_an_unconfirmed_value_is_lost_only_when_the_journal_has_it() -> None:
    figures = publish_figures(range(4), [0, 1], [0, 1, 2])
    # 2 is in the journal (must be processed), 3 never reached it (reported, not lost).
    assert lost(figures.must_process, [0, 1]) == [2]
    assert lost(figures.must_process, [0, 1, 2]) == []


def test_lost_is_a_set_difference_not_a_difference_of_counts() -> None:
    # As many processed as published, one of them twice: a count would see nothing missing.
    figures = publish_figures(range(3), range(3), range(3))
    processed = Counter({0: 2, 1: 1})
    assert sum(processed.values()) == len(figures.must_process)
    assert lost(figures.must_process, processed) == [2]


def test_a_value_processed_that_the_journal_never_had_is_found() -> None:
    assert not_published([0, 1, 7], {0, 1, 2}) == [7]
    assert not_published([0, 1], {0, 1, 2}) == []


# --- ACKED events, bookmark by bookmark -----------------------------------------------------


def test_every_entry_has_one_acked_event_and_every_acked_event_names_an_entry() -> None:
    entries = ["j/0/0", "j/0/1", "j/1/0"]
    ok = match_acked(entries, Counter(entries))
    assert ok.ok and (ok.without, ok.twice, ok.unknown) == ([], [], [])
    missing = match_acked(entries, Counter(["j/0/0", "j/1/0"]))
    assert not missing.ok and missing.without == ["j/0/1"]
    twice = match_acked(entries, Counter([*entries, "j/1/0"]))
    assert not twice.ok and twice.twice == ["j/1/0"]


def test_an_acked_event_for_an_unknown_bookmark_fails_even_when_the_counts_agree() -> None:
    # Three entries, three ACKED events: the old check (counts) passed this.
    entries = ["j/0/0", "j/0/1", "j/1/0"]
    found = match_acked(entries, Counter(["j/0/0", "j/0/1", "j/9/9"]))
    assert not found.ok
    assert (found.without, found.unknown) == (["j/1/0"], ["j/9/9"])


# --- the audit --------------------------------------------------------------------------------


EXPECTED = {"j/0/0", "j/0/1", "j/1/0"}


def _statuses(done: set[str], **others: str) -> dict[str, str]:
    return {**{b: "done" for b in done}, **others}


def test_an_audit_that_found_exactly_the_published_entries_done_passes() -> None:
    check = audit_check(AuditVerdict("Q", done=3), EXPECTED, _statuses(EXPECTED))
    assert check.problems == [] and check.expected == 3 and check.statuses_read


def test_an_audit_that_saw_nothing_fails() -> None:
    check = audit_check(AuditVerdict("Q", done=0), EXPECTED, {})
    assert any("found 0 entries done, not the 3" in p for p in check.problems)
    assert sorted(check.expected_not_done) == sorted(EXPECTED)


def test_an_audit_with_entries_pending_or_violations_or_no_run_fails() -> None:
    pending = audit_check(AuditVerdict("Q", done=3, pending=1), EXPECTED,
                          _statuses(EXPECTED, **{"j/1/1": "pending"}))
    assert any("1 entries pending" in p for p in pending.problems)
    violated = audit_check(AuditVerdict("Q", done=3, violations=(("acked_twice", "j/0/0"),)),
                           EXPECTED, _statuses(EXPECTED))
    assert any("1 violations: acked_twice j/0/0" in p for p in violated.problems)
    failed = audit_check(AuditVerdict("Q", error="exit 1: boom"), EXPECTED, None)
    assert failed.problems == ["the audit of Q did not run: exit 1: boom"]


def test_an_audit_with_the_right_count_of_the_wrong_entries_fails() -> None:
    # Three done, as expected, but one is not a published value's entry and one is missing.
    done = {"j/0/0", "j/0/1", "j/7/7"}
    check = audit_check(AuditVerdict("Q", done=3), EXPECTED, _statuses(done, **{
        "j/1/0": "violation"}))
    assert check.expected_not_done == ["j/1/0"] and check.done_not_expected == ["j/7/7"]
    assert any("j/1/0 (violation)" in p for p in check.problems)
    assert any("no published value's" in p for p in check.problems)


def test_an_audit_whose_entries_cannot_be_read_fails_whatever_its_count() -> None:
    check = audit_check(AuditVerdict("Q", done=3), EXPECTED, None)
    assert not check.statuses_read
    assert any("could not be read" in p for p in check.problems)


def test_an_audit_whose_count_and_entries_disagree_fails() -> None:
    check = audit_check(AuditVerdict("Q", done=4), {*EXPECTED, "j/2/0"}, _statuses(EXPECTED))
    assert check.expected_not_done == ["j/2/0"]
    assert any("printed 4 done and its per-entry output has 3" in p for p in check.problems)


# --- the consumers' records ------------------------------------------------------------------


def test_only_whole_lines_of_a_consumers_record_count() -> None:
    whole = f"{ALO}\t123\t1.5\n{AMO}\t123\t1.6\n"
    # The last line cut by a SIGKILL: "12" of "123" must not count as record 12 processed.
    cut = f"{ALO}\t5\t2.0\n{ALO}\t12"
    # A last line without its newline is not whole either, even with its three fields.
    unended = f"{ALO}\t6\t2.0\n{ALO}\t77\t2.1"
    found = processed_lines([whole, cut, f"garbage\n{ALO}\t\t3.0\n", unended], (ALO, AMO))
    assert found.counts[ALO] == Counter({"123": 1, "5": 1, "6": 1})
    assert found.counts[AMO] == Counter({"123": 1})
    assert found.seconds[(ALO, "123")] == [1.5]
    assert found.partial == [f"{ALO}\t12", "garbage", f"{ALO}\t\t3.0", f"{ALO}\t77\t2.1"]


# --- the soak's verdict fails on each -------------------------------------------------------


def _clean() -> SoakResult:
    """A result every check passes: what a good run leaves."""
    return SoakResult(plan={"audit": False, "poison_records": 0, "journal_deletions": 0},
                      drained=True, journal_read_complete=True, events_read_complete=True)


def test_a_clean_result_passes() -> None:
    assert _clean().problems() == []


def test_the_verdict_fails_on_each_finding() -> None:
    findings: dict[str, object] = {
        "alo_lost": [7],
        "confirmed_not_journaled": [6],
        "journaled_not_attempted": [99],
        "alo_processed_not_journaled": [5],
        "amo_processed_twice": [3],
        "amo_processed_not_journaled": [4],
        "not_admitted": {ALO: ["j/0/5"]},
        "alo_entries_without_acked_event": ["j/0/1"],
        "alo_entries_acked_twice": ["j/0/2"],
        "acked_events_unknown": ["j/9/9"],
        "entries_leased_after_acked": ["j/0/3"],
        "amo_entries_leased_twice": ["j/0/4"],
        "journal_read_complete": False,
        "events_read_complete": False,
        "shard_failures_after_input_faults": ["shard 1 at t=13.170s"],
        "shard_failures_unexplained": ["shard 2 at t=99.000s"],
        "shard_failures_unended": ["shard 3 at t=5.000s"],
        "poison_reported_not_journaled": ["j/0/9"],
        # Read only after RECREATED_WAIT (or only by a later takeover): not good enough.
        "deleted_journal_recreated_admitted_after": [None],
    }
    for name, value in findings.items():
        result = _clean()
        setattr(result, name, value)
        assert result.problems(), f"{name}={value!r} passed"


def test_what_is_reported_and_not_lost_does_not_fail() -> None:
    result = _clean()
    result.deleted_journal_recreated_admitted_after = [1.5]
    result.unconfirmed_not_journaled = [7, 9]
    result.unconfirmed_journaled = [8]
    result.journaled_twice = [3]
    result.publish_errors = {"_MSG_TIMED_OUT": 2}
    assert result.problems() == []


def test_an_audit_asked_for_fails_when_it_did_not_run_or_its_check_failed() -> None:
    result = _clean()
    result.plan["audit"] = True
    assert result.problems() == ["the audit was asked for and did not run"]
    check = audit_check(AuditVerdict(ALO, done=0), {"j/0/0"}, {})
    result.audit = [{"problems": check.problems}]
    assert result.problems() == check.problems != []


def test_a_planned_poison_record_that_is_not_in_the_journal_fails() -> None:
    result = _clean()
    result.plan["poison_records"] = 1
    assert any("no poison record" in p for p in result.problems())


def test_the_default_plan_audits() -> None:
    assert SoakPlan().audit
