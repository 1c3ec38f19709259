"""Session identity in the shard core (protocol 5, docs/security.md "Session identity"), on
both cores: records are encoded as consumers encode them, with their headers.

What a victim would check: a record that does not prove its session's secret changes nothing
(no takeover, no forged heartbeat, replace or unsubscribe, no ack), an ack item settles only a
lease its own consumer holds, records naming unknown sessions create no topic, and an honest
restart that proves the old secret still breaks the old leases at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, NamedTuple

import pytest

from layer.coordinator.catalog import Catalog
from layer.coordinator.core import Plan, QueueState, ShardCore
from layer.coordinator.options import CoordinatorOptions
from layer.coordinator.output import Output
from layer.coordinator.ports import FakeTopicAdmin
from layer.coordinator.sessions import Session
from layer.domain.definitions import QueueDefinition
from layer.domain.native import native_available
from layer.kafka import JournalRecord, OutgoingRecord
from layer.protocol import (
    AcceptGroup,
    AcceptRecord,
    AckItem,
    AckRecord,
    AckResult,
    AckStatus,
    AckType,
    Codec,
    Heartbeat,
    Replace,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    TopicNames,
    Unsubscribe,
    parse_delivery_headers,
    proof_headers,
    secret_hash,
    secret_headers,
)
from layer.store.rows import QueueRecord

TOPICS = TopicNames("qt.")
CODEC = Codec()
JOURNAL = "work"
Headers = list[tuple[str, bytes | None]]

CORES = ["python", *(["native"] if native_available() else [])]


def secret(name: str) -> bytes:
    return (name * 64)[:64].encode()


class Shard:
    """One shard core serving queue Work, fed records with headers."""

    def __init__(self, core: str, require_identity: bool = False) -> None:
        work = QueueRecord(name="Work", definition={"name": "Work", "underlying_topic": JOURNAL,
                                                    "lease_period": "60s"},
                           version=1, created_at=0.0, updated_at=0.0, shard=0)
        self.catalog = Catalog.of(1, [work], [], now=0.0)
        self.admin = FakeTopicAdmin({JOURNAL: 1, TOPICS.control: 1, TOPICS.ack: 1})
        counter = itertools.count()
        self.core = ShardCore(0, CoordinatorOptions(owner_id="t", core=core,
                                                    require_identity=require_identity),
                              topics=TOPICS, catalog=lambda: self.catalog, admin=self.admin,
                              tokens=lambda: f"tok{next(counter)}", owner_id="t")
        self.core.epoch = 1
        self.core.add_queue(QueueState(QueueDefinition.from_mapping(work.definition), 1, [],
                                       {(JOURNAL, 0): 0}, {}, {}, {(JOURNAL, 0): 0}), [], 0.0)
        self.offsets: dict[str, int] = {}
        self.now = 1.0

    def record(self, topic: str, value: bytes, headers: Headers | None = None
               ) -> JournalRecord:
        offset = self.offsets.get(topic, 0)
        self.offsets[topic] = offset + 1
        return JournalRecord(topic, 0, offset, b"k", value, 1, headers)

    def step(self, *records: JournalRecord) -> Plan:
        self.now += 1.0
        plan = self.core.step(list(records), self.now)
        self.core.settled(plan)
        return plan

    def publish(self, n: int) -> Plan:
        start = self.offsets.get(JOURNAL, 0)
        return self.step(*(self.record(JOURNAL, json.dumps({"n": start + i}).encode())
                           for i in range(n)))

    def subscribe(self, consumer: str, session: str, headers: Headers | None = None,
                  topic: str | None = None) -> Plan:
        return self.step(self.record(TOPICS.control, CODEC.encode_control(Subscribe(
            consumer_id=consumer, session_id=session, request_id=f"r-{session}", queue="Work",
            max_backlog=5, delivery_topic=topic or TOPICS.delivery(consumer),
            session_timeout_ms=600_000, client_name="t", client_version="0", sent_at_ms=0)),
            headers))

    def control(self, message: Any, headers: Headers | None = None) -> Plan:
        return self.step(self.record(TOPICS.control, CODEC.encode_control(message), headers))

    def ack(self, consumer: str, session: str, leases: list[Lease],
            headers: Headers | None = None, accept_record: bool = False) -> Plan:
        if accept_record:
            value = CODEC.encode_accept(AcceptRecord(
                consumer_id=consumer, session_id=session, sent_at_ms=0, groups=(AcceptGroup(
                    queue="Work", topic=JOURNAL, partition=0,
                    offsets=tuple(d.offset for d in leases),
                    leases=tuple(d.token for d in leases)),)))
        else:
            value = CODEC.encode_ack(AckRecord(
                consumer_id=consumer, session_id=session, sent_at_ms=0, items=tuple(
                    AckItem(queue="Work", bookmark=f"{JOURNAL}/0/{d.offset}",
                            lease=d.token, type=AckType.ACCEPT) for d in leases)))
        return self.step(self.record(TOPICS.ack, value, headers))


def replies(plan: Plan) -> list[object]:
    return [CODEC.decode_reply(r.value) for r in plan.replies if r.value is not None]


class Lease(NamedTuple):
    offset: int
    token: str
    consumer_id: str | None
    delivery_count: int


def leases(shard: Shard, plan: Plan) -> list[Lease]:
    """The plan's deliveries as the consumer reads them (one record each), on either core."""
    found = []
    for r in Output(shard.core).deliveries(plan.deliveries, {}):
        info = parse_delivery_headers(r.headers)
        found.append(Lease(info.bookmark.offset, info.lease, info.consumer_id,
                           info.delivery_count))
    return sorted(found)


def counted(plan: Plan, name: str) -> int:
    return plan.batch.counters.get("Work", {}).get(name, 0)


def proven_victim(shard: Shard, holding: int = 2) -> list[Lease]:
    """Consumer v (session s1, secret "v") subscribed and holding ``holding`` leases."""
    (ok,) = replies(shard.subscribe("v", "s1", secret_headers(secret("v"))))
    assert isinstance(ok, SubscribeResult) and ok.status is SubscribeStatus.OK
    held = leases(shard, shard.publish(holding))
    assert len(held) == holding
    return held


@pytest.fixture(params=CORES)
def shard(request: pytest.FixtureRequest) -> Shard:
    return Shard(request.param)


def test_the_secret_is_kept_as_its_hash_only(shard: Shard) -> None:
    plan = shard.subscribe("v", "s1", secret_headers(secret("v")))
    row = plan.batch.consumers["v"]
    assert row.secret_hash == secret_hash(secret("v"))
    assert secret("v") not in repr(row).encode()
    assert shard.core.sessions["v"].secret_hash == secret_hash(secret("v"))


def test_a_subscribe_without_the_live_sessions_proof_is_refused_and_takes_nothing(
        shard: Shard) -> None:
    held = proven_victim(shard)
    for headers in (secret_headers(secret("m")),  # the attacker's own secret
                    secret_headers(secret("m")) + proof_headers(secret("x")),  # a wrong proof
                    None):  # an old-protocol Subscribe
        plan = shard.subscribe("v", "evil", headers, topic="qt.delivery.mallory")
        (refused,) = replies(plan)
        assert isinstance(refused, SubscribeResult)
        assert refused.status is SubscribeStatus.INVALID_REQUEST
        assert "live session" in (refused.message or "")
        assert plan.batch.consumers == {} and leases(shard, plan) == []
    assert "qt.delivery.mallory" not in shard.admin.partitions
    session = shard.core.sessions["v"]
    assert (session.session_id, session.delivery_topic) == ("s1", TOPICS.delivery("v"))
    assert shard.core.counters["identity_refused_subscribe_session_live"] == 3
    # The victim's leases are still its own: its acks apply, and new messages reach it.
    assert counted(shard.ack("v", "s1", held, proof_headers(secret("v"))), "acked") == 2
    assert [d.consumer_id for d in leases(shard, shard.publish(1))] == ["v"]


def test_an_honest_restart_proving_the_old_secret_breaks_the_old_leases_at_once(
        shard: Shard) -> None:
    held = proven_victim(shard)
    plan = shard.subscribe("v", "s2", secret_headers(secret("n")) + proof_headers(secret("v")))
    (ok,) = replies(plan)
    assert isinstance(ok, SubscribeResult) and ok.status is SubscribeStatus.OK
    assert counted(plan, "lease_expired") == len(held) == 2  # broken at once
    again = leases(shard, plan)
    assert [(d.offset, d.consumer_id, d.delivery_count) for d in again] == [
        (0, "v", 2), (1, "v", 2)]
    assert shard.core.sessions["v"].secret_hash == secret_hash(secret("n"))


@pytest.mark.parametrize("forged", ["heartbeat", "unsubscribe", "replace"])
@pytest.mark.parametrize("proof", [None, "wrong"])
def test_forged_control_records_change_nothing(shard: Shard, forged: str,
                                               proof: str | None) -> None:
    held = proven_victim(shard)
    headers = None if proof is None else proof_headers(secret("x"))
    message = {
        "heartbeat": Heartbeat(consumer_id="v", session_id="s1", sent_at_ms=0),
        "unsubscribe": Unsubscribe(consumer_id="v", session_id="s1", sent_at_ms=0),
        "replace": Replace(consumer_id="v", session_id="s1", request_id="r", queue="Work",
                           max_backlog=0, delivery_topic="qt.delivery.mallory", sent_at_ms=0),
    }[forged]
    plan = shard.control(message, headers)
    assert replies(plan) == [] and plan.batch.consumers == {}
    assert plan.batch.heartbeats == {} and not plan.batch.session_deletes
    assert counted(plan, "lease_expired") == 0
    reason = "no_proof" if proof is None else "wrong_proof"
    assert shard.core.counters[f"identity_refused_{forged}_{reason}"] == 1
    session = shard.core.sessions["v"]
    assert (session.session_id, session.delivery_topic, session.max_backlog) == (
        "s1", TOPICS.delivery("v"), 5)
    assert counted(shard.ack("v", "s1", held, proof_headers(secret("v"))), "acked") == 2


def test_the_sessions_own_records_with_the_proof_act(shard: Shard) -> None:
    proven_victim(shard)
    proof = proof_headers(secret("v"))
    assert shard.control(Heartbeat(consumer_id="v", session_id="s1", sent_at_ms=0),
                         proof).batch.heartbeats == {"v": shard.now}
    (replaced,) = replies(shard.control(Replace(
        consumer_id="v", session_id="s1", request_id="r2", queue="Work", max_backlog=1,
        delivery_topic=TOPICS.delivery("v"), sent_at_ms=0), proof))
    assert isinstance(replaced, SubscribeResult) and replaced.status is SubscribeStatus.OK
    assert shard.core.sessions["v"].secret_hash == secret_hash(secret("v"))  # kept
    plan = shard.control(Unsubscribe(consumer_id="v", session_id="s1", sent_at_ms=0), proof)
    assert "v" not in shard.core.sessions
    assert counted(plan, "lease_expired") == 2


@pytest.mark.parametrize("accept_record", [False, True], ids=["AckRecord", "AcceptRecord"])
def test_an_ack_without_the_proof_settles_nothing(shard: Shard, accept_record: bool) -> None:
    held = proven_victim(shard)
    for headers in (None, proof_headers(secret("x"))):
        plan = shard.ack("v", "s1", held, headers, accept_record)
        assert counted(plan, "acked") == 0 and replies(plan) == []
    assert shard.core.counters["identity_refused_ack_no_proof"] == 1
    assert shard.core.counters["identity_refused_ack_wrong_proof"] == 1
    plan = shard.ack("v", "s1", held, proof_headers(secret("v")), accept_record)
    assert counted(plan, "acked") == 2


@pytest.mark.parametrize("accept_record", [False, True], ids=["AckRecord", "AcceptRecord"])
def test_an_ack_with_another_consumers_token_is_a_wrong_token(
        shard: Shard, accept_record: bool) -> None:
    held = proven_victim(shard)
    (ok,) = replies(shard.subscribe("m", "s9", secret_headers(secret("m"))))
    assert isinstance(ok, SubscribeResult) and ok.status is SubscribeStatus.OK
    # Mallory read v's tokens (no ACLs) and acks them in her own, well-proven record.
    plan = shard.ack("m", "s9", held, proof_headers(secret("m")), accept_record)
    assert counted(plan, "acked") == 0
    (answer,) = replies(plan)
    assert isinstance(answer, AckResult)
    assert [i.status for i in answer.items] == [AckStatus.WRONG_TOKEN] * 2
    assert shard.core.counters["ack_wrong_token"] == 2
    # Still v's: its own ack applies.
    assert counted(shard.ack("v", "s1", held, proof_headers(secret("v")), accept_record),
                   "acked") == 2


def test_records_of_unknown_sessions_create_no_topic_and_are_counted(shard: Shard) -> None:
    held = proven_victim(shard)
    before = dict(shard.admin.partitions)
    records = []
    for i in range(30):
        value = CODEC.encode_ack(AckRecord(
            consumer_id=f"random-{i}", session_id="s", sent_at_ms=0, items=(AckItem(
                queue="Work", bookmark=f"{JOURNAL}/0/0", lease=held[0].token,
                type=AckType.ACCEPT),)))
        records.append(shard.record(TOPICS.ack, value))
    records.append(shard.record(TOPICS.control, CODEC.encode_control(
        Heartbeat(consumer_id="random-x", session_id="s", sent_at_ms=0))))
    plan = shard.step(*records)
    # Records naming sessions the catalog does not know wait for a catalog loaded after they
    # came (a session accepted a moment ago on another shard), then go, unread.
    assert shard.core.waiting and shard.core.counters["identity_refused_ack_unknown_session"] == 0
    shard.catalog = dataclasses.replace(shard.catalog, loaded_at=shard.now + 0.5)
    later = shard.step()
    assert counted(plan, "acked") == counted(later, "acked") == 0
    assert shard.core.counters["identity_refused_ack_unknown_session"] == 30
    assert not shard.core.waiting
    # The heartbeat's reply: nowhere.
    assert Output(shard.core).answerable(plan.replies + later.replies, shard.now) == []
    assert shard.admin.partitions == before


def test_replies_to_made_up_consumers_cost_one_topic_listing_per_iteration(
        shard: Shard) -> None:
    """Each reply to a topic not known would list the broker's topics (a metadata request, in
    the shard's loop): a flood of records naming made-up consumers must not cost one each."""
    output, now = Output(shard.core), shard.now
    replies = [OutgoingRecord(f"qt.delivery.random-{i}", b"x") for i in range(50)]
    assert output.answerable(replies, now) == []
    assert output.answerable(replies, now) == []
    assert shard.admin.listings == 1
    # Made since (a consumer makes its topic, then subscribes): found in the next iteration.
    shard.admin.partitions["qt.delivery.random-7"] = 1
    assert output.answerable(replies, now + 0.001) == [replies[7]]
    assert shard.admin.listings == 2
    assert shard.core.counters["unanswerable_replies"] == 50 + 50 + 49


def test_an_old_protocol_consumer_still_works_with_identity_not_required(shard: Shard) -> None:
    (ok,) = replies(shard.subscribe("old", "s1"))
    assert isinstance(ok, SubscribeResult) and ok.status is SubscribeStatus.OK
    assert shard.core.sessions["old"].secret_hash is None
    held = leases(shard, shard.publish(2))
    assert shard.control(Heartbeat(consumer_id="old", session_id="s1", sent_at_ms=0)
                         ).batch.heartbeats == {"old": shard.now}
    assert counted(shard.ack("old", "s1", held), "acked") == 2
    # An unproven session may be taken over, as before protocol 5 (by a proven one, too).
    (again,) = replies(shard.subscribe("old", "s2", secret_headers(secret("o"))))
    assert isinstance(again, SubscribeResult) and again.status is SubscribeStatus.OK


@pytest.mark.parametrize("core", CORES)
def test_identity_required_refuses_a_subscribe_without_a_secret(core: str) -> None:
    shard = Shard(core, require_identity=True)
    for headers, reason in ((None, "no_secret"), (secret_headers(b"short"), "bad_secret")):
        (refused,) = replies(shard.subscribe("old", "s1", headers))
        assert isinstance(refused, SubscribeResult)
        assert refused.status is SubscribeStatus.INVALID_REQUEST
        assert shard.core.counters[f"identity_refused_subscribe_{reason}"] == 1
    assert shard.core.sessions == {} and TOPICS.delivery("old") not in shard.admin.partitions
    (ok,) = replies(shard.subscribe("new", "s1", secret_headers(secret("n"))))
    assert isinstance(ok, SubscribeResult) and ok.status is SubscribeStatus.OK


def test_a_restored_session_stays_proven(shard: Shard) -> None:
    plan = shard.subscribe("v", "s1", secret_headers(secret("v")))
    row = plan.batch.consumers["v"]
    assert Session.from_row(row).secret_hash == secret_hash(secret("v"))


def test_refusals_are_logged_at_most_once_a_minute_per_consumer_and_unknown_ids_share_one(
        caplog: pytest.LogCaptureFixture) -> None:
    from collections import Counter

    from layer.coordinator.identity import Identity, Refusal

    counters: Counter[str] = Counter()
    identity = Identity(counters, require=False)
    with caplog.at_level("WARNING", logger="layer.coordinator.identity"):
        for i in range(100):
            identity.refuse("ack", Refusal.UNKNOWN_SESSION, f"random-{i}", 10.0 + i / 100, "x")
            identity.refuse("heartbeat", Refusal.WRONG_PROOF, "victim", 10.0 + i / 100, "x")
        identity.refuse("heartbeat", Refusal.WRONG_PROOF, "victim", 70.5, "x")
    assert counters == {"identity_refused_ack_unknown_session": 100,
                        "identity_refused_heartbeat_wrong_proof": 101}
    assert len(caplog.records) == 3  # one per limit, and the victim's again a minute later
    assert identity.logged_keys() == 2
