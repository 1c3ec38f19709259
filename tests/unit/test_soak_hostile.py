"""The hostile tenant's phase of the soak (tests/soak/hostile.py, tests/soak/checks.py
`hostile_problems`): its filters break the limits they are named after, and each check of the
phase fails on an input it must fail (no I/O)."""

from __future__ import annotations

import pytest

from layer.domain.errors import ExpressionError
from layer.domain.expressions import compile_expression
from tests.soak.checks import (
    MAX_CANARY_GAP,
    HostileOutcome,
    Seen,
    canary_gap,
    hostile_events,
    hostile_problems,
    increments,
    refusals_missing,
)
from tests.soak.hostile import Attack, hostile_filters, refused
from tests.soak.report import FAULT_KINDS, KINDS, Fault, quiet_from, worst_gap
from tests.soak.run import SoakPlan, SoakResult

# --- the filters --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "limit"), [
    ("200 LIKE patterns, 4.6 KB", "MAX_LENGTH"), ("6.9 KB filter", "MAX_LENGTH"),
    ("300-deep expression", "MAX_DEPTH"), ("170 LIKE patterns, 3.7 KB", "MAX_LIKE_PATTERNS"),
    ("a pattern over RE2's memory", "PATTERN_MAX_MEM"),
    ("a pattern of too many instructions", "MAX_INSTRUCTIONS")])
def test_each_hostile_filter_is_refused_by_the_limit_it_is_named_after(name: str,
                                                                       limit: str) -> None:
    text = dict(hostile_filters(12))[name]
    with pytest.raises(ExpressionError) as refusal:
        compile_expression(text)
    assert getattr(refusal.value, "limit", None) == limit, str(refusal.value)


def test_every_round_of_hostile_filters_is_new_text() -> None:
    # A cache must not answer the second round: every text differs with the nonce.
    first, second = dict(hostile_filters(1)), dict(hostile_filters(11))
    assert first.keys() == second.keys()
    assert all(first[k] != second[k] for k in first)
    assert len(dict(hostile_filters(1))["6.9 KB filter"]) > 6_900


def test_an_attack_expects_only_what_it_wrote() -> None:
    attack = Attack()
    attack.expect("none", 0, refused("ack", "malformed"))
    attack.expect("three", 3, refused("ack", "malformed"))
    assert attack.expected == [["three", 3, ["refused:ack:malformed:anonymous"]]]


# --- the window and the canary ------------------------------------------------------------------


def test_the_hostile_phase_shares_its_window_with_no_other_fault() -> None:
    hostile = KINDS["hostile"]
    assert hostile.input and hostile.apart and hostile.settle is not None
    kill = Fault(10.0, 11.0, "coordinator")  # window [10, 31]
    crash = Fault(12.0, 22.0, "postgres")  # window [12, 52]
    # It waits for every earlier window, a coordinator SIGKILL's too (an input fault does
    # not) ...
    assert quiet_from("hostile", [kill]) == 31.0
    assert quiet_from("poison", [kill]) == 0.0
    assert quiet_from("hostile", [kill, crash]) == 52.0
    # ... not for a consumer SIGKILL, which has no window ...
    assert quiet_from("hostile", [Fault(5.0, 5.5, "consumer")]) == 0.0
    # ... and nothing starts in its window, a consumer SIGKILL included.
    phase = Fault(60.0, 65.0, "hostile")  # window [60, 70]
    assert {k.name: quiet_from(k.name, [phase]) for k in FAULT_KINDS} == {
        k.name: 70.0 for k in FAULT_KINDS}


def test_the_canary_gap_is_the_longest_time_without_a_processed_record() -> None:
    times = [1.0, 1.2, 1.4, 3.0, 3.1]
    assert worst_gap(times, 1.0, 3.5) == pytest.approx(1.6)  # 1.4 -> 3.0
    # A stall across the window's end counts up to the end; one before its start does not.
    assert worst_gap(times, 1.1, 5.0) == pytest.approx(1.9)  # 3.1 -> 5.0
    assert worst_gap([0.0, 2.0], 1.9, 2.5) == pytest.approx(0.5)
    # Nothing processed in the window: the whole window.
    assert worst_gap([0.0, 9.0], 2.0, 4.0) == pytest.approx(2.0)


def test_the_canary_is_not_measured_when_publishing_ended_inside_the_window() -> None:
    times = [x * 0.1 for x in range(100)]
    assert canary_gap(times, 2.0, 5.0, publishing_ended=9.9) == pytest.approx(0.1)
    assert canary_gap(times, 2.0, 5.0, publishing_ended=4.0) is None


# --- the counters and the events ----------------------------------------------------------------


def test_increments_are_per_counter_and_only_those_that_moved() -> None:
    before = {"refused:ack:malformed:anonymous": 2, "a": 5}
    after = {"refused:ack:malformed:anonymous": 6, "a": 5, "b": 1}
    assert increments(before, after) == {"refused:ack:malformed:anonymous": 4, "b": 1}


def test_a_record_not_counted_as_refused_is_missing_and_alternatives_add_up() -> None:
    expected = [["forged Subscribes elsewhere", 3,
                 ["refused:subscribe:consumer_id_live_elsewhere:anonymous",
                  "registry_conflicts"]],
                ["ack flood", 30, ["refused:ack:unknown_session:anonymous"]]]
    counted = {"refused:subscribe:consumer_id_live_elsewhere:anonymous": 2,
               "registry_conflicts": 1, "refused:ack:unknown_session:anonymous": 30}
    assert refusals_missing(expected, counted) == []
    counted["refused:ack:unknown_session:anonymous"] = 29
    (missing,) = refusals_missing(expected, counted)
    assert missing.startswith("ack flood: 30 written, 29 refusals counted")
    assert refusals_missing(expected, {})[0].startswith("forged Subscribes elsewhere: 3")


def test_kinds_that_share_a_counter_are_judged_together() -> None:
    # Two records counted under one name: one count must not pass both kinds.
    key = "refused:subscribe:wrong_credential:unknown"
    expected = [["the principal's id, a wrong credential", 1, [key]],
                ["a made-up principal's credential", 1, [key]]]
    assert refusals_missing(expected, {key: 2}) == []
    (missing,) = refusals_missing(expected, {key: 1})
    assert missing.startswith("the principal's id, a wrong credential and a made-up "
                              "principal's credential: 2 written, 1 refusals counted")


def test_events_of_the_tenant_are_refusals_only_and_no_victim_session_changes() -> None:
    victims = [["c1", "s1"], ["c2", "s2"]]
    events = [
        Seen(10.0, "SUBSCRIBE_REFUSED", "c1", "forged"),  # a forged Subscribe, refused
        Seen(10.1, "SUBSCRIBE_REFUSED", "hostile-x", "h1"),
        Seen(10.2, "LEASED", "c1", "s1"),  # the victim's own work
        Seen(10.3, "CONSUMER_SUBSCRIBED", "c2", "s2"),  # its own session again: no change
    ]
    assert hostile_events(events, ["hostile-x"], ["forged", "h1"], victims, 9.0, 20.0) == (
        [], [], 2)
    bad = [
        Seen(11.0, "CONSUMER_SUBSCRIBED", "c1", "forged"),  # taken over
        Seen(12.0, "CONSUMER_UNSUBSCRIBED", "c2", "s2"),  # a forged Unsubscribe acted on
        Seen(13.0, "LEASED", "hostile-x", "h1"),  # the tenant got a lease
        Seen(30.0, "CONSUMER_TIMED_OUT", "c2", "s2"),  # after the window: not its doing
    ]
    found, ended, refusals = hostile_events(bad, ["hostile-x"], ["forged", "h1"], victims,
                                            9.0, 20.0)
    assert refusals == 0
    assert found == ["CONSUMER_SUBSCRIBED@11.000s c1/forged", "LEASED@13.000s hostile-x/h1"]
    assert ended == ["CONSUMER_SUBSCRIBED@11.000s c1/forged",
                     "CONSUMER_UNSUBSCRIBED@12.000s c2/s2"]
    replaced = [Seen(15.0, "CONSUMER_REPLACED", "c1", "s1")]
    assert hostile_events(replaced, [], [], victims, 9.0, 20.0)[1] == [
        "CONSUMER_REPLACED@15.000s c1/s1"]


# --- the phase's verdict fails on each finding ------------------------------------------------


def _clean() -> HostileOutcome:
    """What a good phase leaves."""
    return HostileOutcome(
        at=40.0, end=46.0, closes=56.0,
        expected=[["ack flood (no session)", 30, ["refused:ack:unknown_session:anonymous"]]],
        counted={"refused:ack:unknown_session:anonymous": 30},
        answers={"r1": ["filter: 6.9 KB filter", "INVALID_FILTER"],
                 "r2": ["control: the principal's own Subscribe", "OK"]},
        replies={"r1": "INVALID_FILTER", "r2": "OK"}, victims=[["c1", "s1"]],
        canary_gap=0.2, canary_before=0.1, publishing_ended=100.0, refused_events=12)


def test_a_clean_phase_passes() -> None:
    assert hostile_problems(_clean()) == []


@pytest.mark.parametrize(("change", "said"), [
    ({"canary_gap": MAX_CANARY_GAP + 0.01}, "went 1.01s without processing"),
    ({"canary_gap": None, "publishing_ended": 50.0}, "the canary was not measured"),
    ({"counted": {"refused:ack:unknown_session:anonymous": 29}}, "30 written, 29 refusals"),
    ({"replies": {"r2": "OK"}}, "filter: 6.9 KB filter: no answer"),
    ({"replies": {"r1": "OK", "r2": "OK"}}, "answered OK, not INVALID_FILTER"),
    # The control refused: the credential refusals would prove nothing.
    ({"replies": {"r1": "INVALID_FILTER", "r2": "INVALID_REQUEST"}},
     "answered INVALID_REQUEST, not OK"),
    ({"victims": []}, "no live session of a soak consumer"),
    ({"victims_gone": ["c1/s1"]}, "gone from the store: c1/s1"),
    ({"sessions_ended": ["CONSUMER_UNSUBSCRIBED@41.000s c1/s1"]}, "ended or changed"),
    ({"hostile_events": ["LEASED@41.000s hostile-x/h1"]}, "that are no refusal"),
    ({"journal_records": ["j/0/17"]}, "in the journal"),
    ({"events_foreign": 1}, "no event"),
])
def test_the_phase_fails_on_each_finding(change: dict[str, object], said: str) -> None:
    outcome = _clean()
    for name, value in change.items():
        setattr(outcome, name, value)
    problems = hostile_problems(outcome)
    assert any(said in p for p in problems), problems


def test_the_soak_fails_on_a_hostile_finding_and_on_a_planned_phase_that_did_not_run() -> None:
    from dataclasses import asdict

    clean = SoakResult(plan={"audit": False, "poison_records": 0, "journal_deletions": 0,
                             "hostile_phases": 1},
                       drained=True, journal_read_complete=True, events_read_complete=True)
    assert clean.problems() == ["0 hostile phases ran, of 1 planned"]
    clean.hostile = [asdict(_clean())]
    assert clean.problems() == []
    bad = _clean()
    bad.canary_gap = 3.0
    clean.hostile = [asdict(bad)]
    assert any("went 3.00s" in p for p in clean.problems())


def test_the_default_plan_has_one_hostile_phase() -> None:
    assert SoakPlan().hostile_phases == 1
    assert [k for _, k in SoakPlan().faults()].count("hostile") == 1
