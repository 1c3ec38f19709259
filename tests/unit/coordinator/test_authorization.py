"""Authorization in the shard core (protocol 7; `layer.coordinator.authorize`, `Control`), on
both cores, without I/O: Subscribes authorized by credential and grants, refusals answered on
the consumer id's own topic with ``qlayer.refusal``, records held for a fresher catalog rather
than refused for its age, sessions ended when their grant goes, one consumer id per session
across shards."""

from __future__ import annotations

import dataclasses

import pytest

from layer.coordinator.catalog import Catalog
from layer.coordinator.output import Output
from layer.domain.authorization import (
    AuthorizationMode,
    Entitlements,
    Grant,
    GrantKind,
    NamePattern,
    Principal,
    issue_credential,
)
from layer.kafka import OutgoingRecord
from layer.protocol import (
    SessionEnded,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    secret_headers,
)
from layer.protocol.headers import CREDENTIAL, REFUSAL, header_value
from layer.store.batch import WriteBatch
from layer.store.rows import ConsumerRow

from .test_identity import CORES, JOURNAL, TOPICS, Shard, leases, replies, secret

ALICE = issue_credential("alice")
BOB = issue_credential("bob")


def _with(shard: Shard, mode: AuthorizationMode = AuthorizationMode.OPEN,
          grants: tuple[tuple[str, GrantKind, str], ...] = (
              ("alice", GrantKind.QUEUE, "Work"), ("alice", GrantKind.CONSUMER_ID, "alice-*"),
              ("bob", GrantKind.CONSUMER_ID, "bob-*")),
          loaded_at: float = 0.0, consumers: tuple[ConsumerRow, ...] = ()) -> None:
    entitlements = Entitlements.of(mode, [Principal("alice", ALICE.sha256),
                                          Principal("bob", BOB.sha256)],
                                   [Grant(p, k, NamePattern(t)) for p, k, t in grants])
    shard.catalog = Catalog.of(1, shard.catalog.queues.values(), consumers, loaded_at,
                               entitlements)


def _fresh(shard: Shard) -> None:
    """The catalog as the process would have reloaded it after the next record comes (its
    refusals are then final; `Shard.step` moves time one second on)."""
    shard.catalog = dataclasses.replace(shard.catalog, loaded_at=shard.now + 1.5)


def _as(credential: object | None, consumer: str = "v") -> list[tuple[str, bytes]]:
    headers = list(secret_headers(secret(consumer)))
    if credential is not None:
        headers.append((CREDENTIAL, str(credential).encode()))
    return headers


@pytest.fixture(params=CORES)
def shard(request: pytest.FixtureRequest) -> Shard:
    s = Shard(request.param)
    _with(s)
    return s


def test_the_grantee_subscribes_and_is_served(shard: Shard) -> None:
    (ok,) = replies(shard.subscribe("alice-1", "s1", _as(ALICE, "alice-1")))
    assert isinstance(ok, SubscribeResult) and ok.status is SubscribeStatus.OK
    assert len(leases(shard, shard.publish(2))) == 2
    session = shard.core.sessions["alice-1"]
    assert (session.principal, session.credential_hash) == ("alice", ALICE.sha256)


@pytest.mark.parametrize(("consumer", "credential", "reason"), [
    ("bob-1", BOB, "queue_not_granted"),  # his own id, her queue
    ("alice-1", BOB, "consumer_id_not_granted"),  # her id
    ("alice-1", None, "consumer_id_not_granted"),  # her id, no credential
    ("guest", None, "queue_not_granted"),  # an open id, her queue
])
def test_bob_is_refused_on_his_own_topic_with_the_refusal_header(
        shard: Shard, consumer: str, credential: object | None, reason: str) -> None:
    _fresh(shard)
    plan = shard.subscribe(consumer, "s1", _as(credential, consumer))
    (record,) = plan.replies
    assert record.topic == TOPICS.delivery(consumer)
    assert header_value(record.headers, REFUSAL) == b"not_authorized"
    (refused,) = replies(plan)
    assert isinstance(refused, SubscribeResult)
    assert refused.status is SubscribeStatus.INVALID_REQUEST
    assert shard.core.sessions == {} and plan.batch.consumers == {}
    label = "bob" if credential is BOB else "anonymous"
    assert shard.core.refusals.counts[("subscribe", reason, label)] == 1


def test_a_wrong_credential_is_refused_and_labelled_unknown(shard: Shard) -> None:
    _fresh(shard)
    forged = f"alice:{BOB.secret}"
    (refused,) = replies(shard.subscribe("alice-1", "s1", _as(forged, "alice-1")))
    assert isinstance(refused, SubscribeResult)
    assert "not accepted" in (refused.message or "")
    assert shard.core.refusals.counts[("subscribe", "wrong_credential", "unknown")] == 1


def test_a_refusal_the_catalog_may_be_too_old_for_waits_for_a_fresh_one(shard: Shard) -> None:
    """A principal or grant added a moment ago: the Subscribe is held (its position not
    stored past it, later control records of the partition behind it), the process asked for
    a catalog load, and decided again with the fresh catalog."""
    _with(shard, grants=())  # the catalog loaded before carol was made
    carol = issue_credential("carol")
    held = shard.subscribe("carol-1", "s1", _as(carol, "carol-1"))
    assert held.replies == [] and held.input_offsets == {}
    assert shard.core.control.wants_catalog and shard.core.waiting
    behind = shard.subscribe("guest", "s2", _as(None, "guest"))  # same partition: waits too
    assert behind.replies == [] and behind.input_offsets == {}
    entitlements = Entitlements.of(AuthorizationMode.OPEN, [Principal("carol", carol.sha256)],
                                   [Grant("carol", GrantKind.QUEUE, NamePattern("Work")),
                                    Grant("carol", GrantKind.CONSUMER_ID,
                                          NamePattern("carol-*"))])
    shard.catalog = Catalog.of(1, shard.catalog.queues.values(), [], shard.now + 0.5,
                               entitlements)
    plan = shard.step()
    answers = replies(plan)
    assert [(r.consumer_id, r.status) for r in answers if isinstance(r, SubscribeResult)] == [
        ("carol-1", SubscribeStatus.OK), ("guest", SubscribeStatus.INVALID_REQUEST)]
    assert plan.input_offsets == {(TOPICS.control, 0): 2} and not shard.core.waiting


def test_a_client_named_delivery_topic_is_refused_and_answered_on_the_ids_own(
        shard: Shard) -> None:
    for target in ("journal", TOPICS.delivery("someone-else"), TOPICS.events):
        plan = shard.subscribe("alice-1", f"s-{target}", _as(ALICE, "alice-1"), topic=target)
        (record,) = plan.replies
        assert record.topic == TOPICS.delivery("alice-1")
        (refused,) = replies(plan)
        assert isinstance(refused, SubscribeResult)
        assert "delivery_topic must be" in (refused.message or "")
    assert shard.admin.partitions.get("journal") is None
    assert shard.core.refusals.counts[("subscribe", "delivery_topic_not_its_own", "alice")] == 3


def test_a_revoked_grant_ends_the_session_at_the_next_catalog(shard: Shard) -> None:
    shard.subscribe("alice-1", "s1", _as(ALICE, "alice-1"))
    held = leases(shard, shard.publish(2))
    assert len(held) == 2
    _with(shard, grants=(("alice", GrantKind.CONSUMER_ID, "alice-*"),
                         ("bob", GrantKind.QUEUE, "Work")), loaded_at=shard.now)
    replies_out: list[OutgoingRecord] = []
    batch = WriteBatch()
    shard.core.control.revoke(shard.now, batch, replies_out)
    assert shard.core.sessions == {}
    (ended,) = [shard.core.codec.decode_reply(r.value) for r in replies_out]
    assert isinstance(ended, SessionEnded) and "authorization revoked" in (ended.message or "")
    assert batch.session_deletes == {"alice-1": "s1"}
    # Its leases are broken: the entries go to the next consumer (bob, granted now).
    taken = leases(shard, shard.subscribe("bob-1", "s2", _as(BOB, "bob-1")))
    assert [lease.offset for lease in taken] == [held[0].offset, held[1].offset]


def test_a_consumer_id_live_on_another_shard_is_not_shadowed(shard: Shard) -> None:
    row = ConsumerRow(consumer_id="v", session_id="elsewhere", queue="Other", is_regex=False,
                      delivery_topic=TOPICS.delivery("v"), session_timeout_ms=30_000,
                      subscribed_at=shard.now, last_heartbeat_at=shard.now, shard=3)
    _with(shard, grants=(), consumers=(row,), loaded_at=shard.now + 1.5)
    (refused,) = replies(shard.subscribe("v", "s1", _as(None)))
    assert isinstance(refused, SubscribeResult)
    assert refused.status is SubscribeStatus.INVALID_REQUEST
    assert "another shard" in (refused.message or "") and "elsewhere" not in refused.message
    assert shard.core.sessions == {}


def test_a_session_the_store_did_not_write_ends_and_its_ok_becomes_a_refusal(
        shard: Shard) -> None:
    """Two Subscribes of one id at once on two shards: the store wrote the other shard's row
    (`UPSERT_CONSUMERS`), so this shard ends what it accepted before it answers."""
    _with(shard, grants=(), loaded_at=shard.now + 1.5)
    plan = shard.core.step([shard.record(TOPICS.control, shard.core.codec.encode_control(
        Subscribe(consumer_id="v", session_id="s1", request_id="r1", queue="Work",
                  max_backlog=5, delivery_topic=TOPICS.delivery("v"),
                  session_timeout_ms=600_000, client_name="t", client_version="0",
                  sent_at_ms=0)), _as(None))], shard.now + 1)
    assert "v" in shard.core.sessions
    assert shard.core.control.lost_claims(frozenset({"v"}), shard.now + 1,
                                          plan.replies) == {"v"}
    (answer,) = replies(plan)
    assert isinstance(answer, SubscribeResult)
    assert answer.status is SubscribeStatus.INVALID_REQUEST and answer.request_id == "r1"
    assert shard.core.sessions == {}
    assert shard.core.counters["registry_conflicts"] == 1


@pytest.mark.parametrize("lost", [False, True], ids=["kept", "lost"])
def test_what_a_lost_claim_was_leased_in_its_step_is_not_sent_and_goes_to_the_next_consumer(
        shard: Shard, lost: bool) -> None:
    """The Subscribe and a journal record read in one step: the plan leased the record to the
    session (``kept``), which the store then refused (``lost``). The consumer id's delivery
    topic is the live session's on another shard, so the delivery must not be sent (a CI run
    saw it reach the live session as a message of a queue it never subscribed to); the entry
    is leased again to the next consumer."""
    _with(shard, grants=(), loaded_at=shard.now + 1.5)
    shard.now += 1.0
    plan = shard.core.step([
        shard.record(TOPICS.control, shard.core.codec.encode_control(Subscribe(
            consumer_id="v", session_id="s1", request_id="r1", queue="Work", max_backlog=5,
            delivery_topic=TOPICS.delivery("v"), session_timeout_ms=600_000, client_name="t",
            client_version="0", sent_at_ms=0)), _as(None)),
        shard.record(JOURNAL, b'{"n": 0}')], shard.now)
    unsent = (shard.core.control.lost_claims(frozenset({"v"}), shard.now, plan.replies)
              if lost else frozenset())
    sent = Output(shard.core).deliveries(plan.deliveries, {}, unsent)
    shard.core.settled(plan)
    assert [r.topic for r in sent] == ([] if lost else [TOPICS.delivery("v")])
    taken = leases(shard, shard.subscribe("w", "s2", _as(None, "w")))
    assert [(lease.offset, lease.consumer_id) for lease in taken] == ([(0, "w")] if lost else [])
