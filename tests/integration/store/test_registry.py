"""One consumer registry across shards (0013; docs/security.md, "One consumer registry across
shards"): only the shard a consumer row names writes it, unless its session has ended; the
commit says which rows it did not write. And principals, grants and the mode as stored."""

from __future__ import annotations

from dataclasses import replace

import pytest

from layer.domain.authorization import AuthorizationMode, GrantKind, NamePattern
from layer.domain.errors import GrantConflictError, PrincipalExistsError, UnknownPrincipalError
from layer.store.batch import WriteBatch
from layer.store.principals import Principals
from layer.store.rows import ConsumerRow
from layer.store.store import Store

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0


def _row(shard: int, session: str, heartbeat: float = T0) -> ConsumerRow:
    return ConsumerRow(consumer_id="victim", session_id=session, queue=f"Q{shard}",
                       is_regex=False, delivery_topic="q.delivery.victim",
                       session_timeout_ms=10_000, subscribed_at=T0, last_heartbeat_at=heartbeat,
                       secret_hash=session.encode(), shard=shard)


def _commit(store: Store, shard: int, epoch: int, row: ConsumerRow, now: float) -> frozenset[str]:
    batch = WriteBatch()
    batch.put_consumer(row)
    return store.commit(batch, str(shard), f"owner-{shard}", epoch, now).consumers_refused


def test_another_shard_writes_a_live_consumers_row_only_once_its_session_ended(
        store: Store) -> None:
    one, two = store.take_shard("1", "owner-1", T0), store.take_shard("2", "owner-2", T0)
    assert _commit(store, 1, one, _row(1, "victim-session"), T0) == frozenset()
    # Shard 2 accepted a Subscribe of the same id (a forger's): not written, and said so.
    assert _commit(store, 2, two, _row(2, "forged", T0 + 1), T0 + 1) == {"victim"}
    (row,) = store.load_consumers()
    assert (row.session_id, row.shard, row.queue) == ("victim-session", 1, "Q1")
    # Its own shard goes on writing it (a heartbeat's upsert, a replace).
    assert _commit(store, 1, one, replace(_row(1, "victim-session", T0 + 5), queue="Q1b"),
                   T0 + 5) == frozenset()
    # A session ended without its row going (its shard is down): the next one takes it.
    late = T0 + 5 + 10.001
    assert _commit(store, 2, two, _row(2, "next", late), late) == frozenset()
    (row,) = store.load_consumers()
    assert (row.session_id, row.shard) == ("next", 2)


def test_principals_grants_and_the_mode_as_the_cli_writes_them(store: Store) -> None:
    principals = Principals(store.engine)
    alice = principals.add("alice", T0)
    with pytest.raises(PrincipalExistsError):
        principals.add("alice", T0)
    principals.add("bob", T0)
    assert principals.grant("alice", GrantKind.CONSUMER_ID, NamePattern("team-a*"), T0)
    assert not principals.grant("alice", GrantKind.CONSUMER_ID, NamePattern("team-a*"), T0)
    with pytest.raises(GrantConflictError, match="overlaps 'team-a\\*' of principal 'alice'"):
        principals.grant("bob", GrantKind.CONSUMER_ID, NamePattern("team-*"), T0)
    assert principals.grant("bob", GrantKind.QUEUE, NamePattern("*"), T0)
    with pytest.raises(UnknownPrincipalError):
        principals.grant("carol", GrantKind.QUEUE, NamePattern("*"), T0)
    loaded = principals.load_entitlements()
    assert loaded.mode is AuthorizationMode.OPEN
    assert loaded.authenticate(alice) is not None
    assert loaded.owner_of("team-a1") == "alice" and loaded.may_consume("bob", "Anything")
    rotated = principals.rotate("alice", T0 + 1)
    after = principals.load_entitlements()
    assert after.authenticate(alice) is None and after.authenticate(rotated) is not None
    principals.set_mode(AuthorizationMode.REQUIRED)
    assert principals.mode() is AuthorizationMode.REQUIRED
    assert principals.revoke("bob", GrantKind.QUEUE, NamePattern("*"))
    assert not principals.revoke("bob", GrantKind.QUEUE, NamePattern("*"))
    principals.remove("alice")
    assert [p.name for p in principals.list_principals()] == ["bob"]
    assert principals.load_entitlements().owner_of("team-a1") is None
