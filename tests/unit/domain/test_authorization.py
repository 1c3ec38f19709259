"""Principals, grants and their decisions (`layer.domain.authorization`), without I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layer.domain.authorization import (
    AuthorizationMode,
    CredentialError,
    Entitlements,
    Grant,
    GrantKind,
    NamePattern,
    Principal,
    issue_credential,
    overlapping,
    parse_credential,
)

Q, ID = GrantKind.QUEUE, GrantKind.CONSUMER_ID


def _grants(*rows: tuple[str, GrantKind, str]) -> list[Grant]:
    return [Grant(p, kind, NamePattern(text)) for p, kind, text in rows]


def _entitlements(mode: AuthorizationMode = AuthorizationMode.OPEN) -> Entitlements:
    alice, bob = issue_credential("alice"), issue_credential("bob")
    return Entitlements.of(mode, [Principal("alice", alice.sha256), Principal("bob", bob.sha256)],
                           _grants(("alice", Q, "orders.*"), ("alice", ID, "alice-*"),
                                   ("bob", Q, "Jobs"), ("bob", ID, "bob-*")))


@pytest.mark.parametrize(("pattern", "name", "matches"), [
    ("Jobs", "Jobs", True), ("Jobs", "Jobs2", False), ("orders.*", "orders.eu", True),
    ("orders.*", "orders.", True), ("orders.*", "order", False), ("*", "anything", True),
])
def test_a_pattern_is_a_name_a_prefix_or_everything(pattern: str, name: str,
                                                     matches: bool) -> None:
    assert NamePattern(pattern).matches(name) is matches


@pytest.mark.parametrize("bad", ["", "a*b", "**", "a b", "*x", "x" * 251])
def test_a_pattern_with_a_star_inside_or_a_space_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="pattern"):
        NamePattern(bad)


names = st.text(alphabet="ab.-", max_size=6)
patterns = st.one_of(names.filter(bool), names.map(lambda n: n + "*"))


@given(patterns, patterns, names)
def test_two_patterns_overlap_exactly_when_some_name_matches_both(a: str, b: str,
                                                                   name: str) -> None:
    first, second = NamePattern(a), NamePattern(b)
    if first.matches(name) and second.matches(name):
        assert first.overlaps(second) and second.overlaps(first)
    if first.overlaps(second):
        # A witness: the longer of the two texts (without its star) matches both.
        witness = max(a.rstrip("*"), b.rstrip("*"), key=len)
        assert first.matches(witness) and second.matches(witness)


def test_a_consumer_id_grant_may_not_overlap_another_principals() -> None:
    existing = _grants(("alice", ID, "team-*"), ("alice", Q, "*"))
    clash = Grant("bob", ID, NamePattern("team-b*"))
    assert overlapping(clash, existing) == [existing[0]]
    assert overlapping(Grant("bob", ID, NamePattern("teams")), existing) == []
    assert overlapping(Grant("alice", ID, NamePattern("team-a*")), existing) == []
    assert overlapping(Grant("bob", Q, NamePattern("*")), existing) == []  # queues may be shared


def test_a_credential_round_trips_and_only_its_secret_is_hashed() -> None:
    credential = issue_credential("alice@example.org")
    parsed = parse_credential(str(credential).encode())
    assert parsed == credential
    assert len(credential.secret) == 43 and parsed.sha256 == credential.sha256
    assert issue_credential("alice@example.org").secret != credential.secret


@pytest.mark.parametrize(("value", "why"), [
    ("alice", "PRINCIPAL:SECRET"), ("alice:", "PRINCIPAL:SECRET"), (":secret", "principal name"),
    ("al ice:secret", "principal name"), (b"\xff:x", "UTF-8"), ("a:" + "x" * 600, "at most"),
])
def test_a_malformed_credential_says_what_is_wrong(value: str | bytes, why: str) -> None:
    with pytest.raises(CredentialError, match=why):
        parse_credential(value)


def test_authenticate_tells_a_wrong_secret_from_nothing_else() -> None:
    alice = issue_credential("alice")
    e = Entitlements.of(AuthorizationMode.OPEN, [Principal("alice", alice.sha256)], [])
    assert e.authenticate(alice) == Principal("alice", alice.sha256)
    assert e.authenticate(issue_credential("alice")) is None  # another secret
    assert e.authenticate(issue_credential("mallory")) is None  # no such principal
    assert e.current("alice", alice.sha256)
    assert not e.current("alice", issue_credential("alice").sha256)  # rotated since
    assert not e.current("mallory", alice.sha256)


def test_open_mode_allows_what_no_grant_names_and_only_the_grantee_what_one_does() -> None:
    e = _entitlements()
    assert e.may_consume("alice", "orders.eu") and not e.may_consume("bob", "orders.eu")
    assert not e.may_consume(None, "orders.eu")
    assert e.may_consume("bob", "Jobs") and not e.may_consume("alice", "Jobs")
    for who in ("alice", "bob", None):
        assert e.may_consume(who, "Public")
    assert e.owner_of("alice-worker") == "alice" and e.owner_of("worker-7") is None
    assert e.may_use_id("alice", "alice-worker") and not e.may_use_id("bob", "alice-worker")
    assert not e.may_use_id(None, "alice-worker")
    assert e.may_use_id(None, "worker-7") and e.may_use_id("bob", "worker-7")


def test_required_mode_allows_only_what_is_granted() -> None:
    e = _entitlements(AuthorizationMode.REQUIRED)
    assert e.may_consume("alice", "orders.eu")
    assert not e.may_consume("alice", "Public") and not e.may_consume(None, "Public")
    assert not e.may_use_id("bob", "worker-7") and not e.may_use_id(None, "worker-7")
    assert e.may_use_id("bob", "bob-1")
