"""Authorization between tenants (protocol 7, docs/security.md "Authorization"; issue 36,
findings 1 and 4) on the session's secured broker: SASL/SCRAM logins, the StandardAuthorizer
and the ACL recipe of docs/security.md, a real PostgreSQL.

Alice and Bob are two teams on one cluster, each with the recipe's consumer ACLs and a qlayer
principal of its own. Before protocol 7, Bob subscribed to Alice's queue under his own id and
got her messages; while she was offline he subscribed as ``alice-worker`` and kept her out by
heartbeating; and a Subscribe could name any topic as its delivery topic (a journal, another
consumer's). Each of those is tried here as Bob would.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from confluent_kafka import Consumer, TopicPartition
from typer.testing import CliRunner

from layer.domain.authorization import AuthorizationMode, GrantKind, parse_credential
from layer.kafka.acls import Role, apply_acls, recipe
from layer.protocol import TopicNames
from layer.sdk import NotAuthorizedError, QueueConsumer, QueuePublisher, SessionEndedError
from layer.services.principals import PrincipalService
from layer.settings import Settings
from layer.store.store import Store
from layer_cli.main import app
from tests.support.coordinator import (
    RawConsumer,
    counters,
    put_queues,
    running_coordinator,
    wait_until,
)
from tests.support.kafka import create_topic
from tests.support.secured import SecuredKafka

pytestmark = pytest.mark.integration


@dataclass
class Tenants:
    secured: SecuredKafka
    topics: TopicNames
    settings: Settings
    alice_journal: str
    bob_journal: str
    alice_kafka: dict[str, str]
    bob_kafka: dict[str, str]
    alice: str  # credentials
    bob: str

    def consumer(self, queue: str, who: str, consumer_id: str, credential: str | None,
                 **options: object) -> QueueConsumer:
        kafka = self.alice_kafka if who == "alice" else self.bob_kafka
        return QueueConsumer(queue, self.secured.sasl_servers, topic_prefix=self.topics.prefix,
                             kafka_config=kafka, consumer_id=consumer_id, credential=credential,
                             subscribe_timeout=20, **options)  # type: ignore[arg-type]

    def forger(self, queue: str, consumer_id: str, credential: str | None) -> RawConsumer:
        """Bob writing control records by hand (he may write the control topic, not read
        another consumer's delivery topic)."""
        return RawConsumer(self.secured.sasl_servers, self.topics.prefix, queue,
                           consumer_id=consumer_id, credential=credential,
                           kafka=self.bob_kafka, create_delivery_topic=False,
                           read_delivery_topic=False, max_backlog=10)

    def service(self) -> PrincipalService:
        return PrincipalService(Store(self.settings.database_url))


@pytest.fixture
def tenants(secured: SecuredKafka, database_url: str,
            unique_name: Callable[[str], str]) -> Iterator[Tenants]:
    topics = TopicNames(f"qauth{uuid.uuid4().hex[:8]}.")
    plain = secured.node.config.bootstrap_servers
    alice_journal, bob_journal = unique_name("AliceWork"), unique_name("BobWork")
    for journal in (alice_journal, bob_journal):
        create_topic(plain, journal, partitions=1)
    # Made by an operator, as under the recipe a consumer may not create topics: a refusal of
    # a Subscribe without a credential is answered only on a topic that exists.
    create_topic(plain, topics.delivery("guest-worker"), partitions=1)
    coordinator_user, coordinator_kafka = secured.user("coordinator")
    alice_user, alice_kafka = secured.user("alice")
    bob_user, bob_kafka = secured.user("bob")
    apply_acls(secured.admin, [
        *recipe(Role.COORDINATOR, coordinator_user, topics,
                journals=[alice_journal, bob_journal]),
        *recipe(Role.CONSUMER, alice_user, topics, consumer_id="alice-worker"),
        *recipe(Role.CONSUMER, bob_user, topics, consumer_id="bob-worker"),
        # An id no principal is granted: anyone's, while the mode is open.
        *recipe(Role.CONSUMER, bob_user, topics, consumer_id="guest-worker")])
    settings = Settings(bootstrap_servers=secured.sasl_servers, database_url=database_url,
                        topic_prefix=topics.prefix, kafka=coordinator_kafka)
    put_queues(settings, {"name": "AliceJobs", "underlying_topic": alice_journal},
               {"name": "BobJobs", "underlying_topic": bob_journal})
    with PrincipalService(Store(database_url)) as service:
        alice = service.add("alice", ["AliceJobs"])  # consumer ids alice-* by default
        bob = service.add("bob", ["BobJobs"])
    with QueuePublisher(plain, topic_prefix=topics.prefix) as publisher:
        for i in range(10):
            publisher.publish(alice_journal, json.dumps({"n": i}).encode())
    yield Tenants(secured, topics, settings, alice_journal, bob_journal, alice_kafka,
                  bob_kafka, str(alice), str(bob))


def _refused(coordinator: object, reason: str, principal: str) -> Callable[[], int | None]:
    def probe() -> int | None:
        n: int = coordinator.refusals[("subscribe", reason, principal)]  # type: ignore[attr-defined]
        return n or None
    return probe


def test_bob_cannot_consume_alices_queue_by_his_id_or_hers_online_or_offline(
        tenants: Tenants) -> None:
    t = tenants
    with running_coordinator(t.settings) as coordinator:
        # Under his own id and credential: refused, and told why.
        with pytest.raises(NotAuthorizedError, match="principal 'bob' may not consume queue "
                                                     "'AliceJobs'"):
            t.consumer("AliceJobs", "bob", "bob-worker", t.bob).close()
        # Without a credential, under an id nobody owns: the queue is granted to a principal,
        # so it is not open; and under his own id, a credential is needed.
        with pytest.raises(NotAuthorizedError, match="without a credential may not consume"):
            t.consumer("AliceJobs", "bob", "guest-worker", None).close()
        with pytest.raises(NotAuthorizedError, match="belongs to a principal: give its"):
            t.consumer("BobJobs", "bob", "bob-worker", None).close()
        # As alice-worker while Alice is offline, with his credential and with none (he may
        # not read her delivery topic, so he writes the Subscribe by hand): refused, nothing
        # stored, no session to heartbeat.
        for credential in (t.bob, None):
            t.forger("AliceJobs", "alice-worker", credential).send_subscribe()
        wait_until(_refused(coordinator, "consumer_id_not_granted", "bob"),
                   what="the Subscribe as alice-worker with bob's credential refused")
        wait_until(_refused(coordinator, "consumer_id_not_granted", "anonymous"),
                   what="the anonymous Subscribe as alice-worker refused")
        with Store(t.settings.database_url) as store:
            assert [r.consumer_id for r in store.load_consumers()] == []
        # Alice comes: every message is hers.
        with t.consumer("AliceJobs", "alice", "alice-worker", t.alice,
                        max_backlog=10) as alice:
            seen = []
            while len(seen) < 10:
                message = alice.receive(timeout=30)
                assert message is not None, f"alice got {len(seen)} of 10"
                seen.append(message.json()["n"])
                message.ack()
            # Online: the same two tries change nothing for her.
            for credential in (t.bob, None):
                t.forger("AliceJobs", "alice-worker", credential).send_subscribe()
            wait_until(lambda: (coordinator.refusals[
                ("subscribe", "consumer_id_not_granted", "bob")] >= 2) or None,
                what="the second forged Subscribe refused")
            with QueuePublisher(t.secured.node.config.bootstrap_servers) as publisher:
                publisher.publish(t.alice_journal, b'{"n": 10}')
            message = alice.receive(timeout=30)
            assert message is not None and message.json()["n"] == 10
            message.ack()
        assert sorted(seen) == list(range(10))
        wait_until(lambda: counters(t.settings, "AliceJobs").get("acked") == 11 or None,
                   timeout=30, what="alice's 11 acks applied")
        # Bob's own queue is his.
        with t.consumer("BobJobs", "bob", "bob-worker", t.bob) as bob:
            assert bob.receive(timeout=0.5) is None
        # What an operator sees: the refusals by reason and principal, stored.
        result = CliRunner().invoke(app, ["stats", "--json", "--database-url",
                                          t.settings.database_url,
                                          "--bootstrap-servers", t.secured.node.config.
                                          bootstrap_servers,
                                          "--topic-prefix", t.topics.prefix],
                                    env={"QLAYER_CONFIG": "/dev/null"})
        assert result.exit_code == 0, result.output
        refusals = {(r["kind"], r["reason"], r["principal"]): r["count"]
                    for r in json.loads(result.stdout)["refusals"]}
        assert refusals[("subscribe", "queue_not_granted", "bob")] == 1
        assert refusals[("subscribe", "queue_not_granted", "anonymous")] == 1
        assert refusals[("subscribe", "consumer_id_not_granted", "bob")] == 2
        assert refusals[("subscribe", "consumer_id_not_granted", "anonymous")] == 3


def test_required_mode_closes_what_no_grant_opens_and_a_revoke_or_rotation_ends_a_session(
        tenants: Tenants) -> None:
    t = tenants
    with running_coordinator(t.settings, refresh_interval=0.3) as coordinator:
        # A queue granted to nobody is open to anyone while the mode is open.
        put_queues(t.settings, {"name": "Shared", "underlying_topic": t.bob_journal})
        with t.consumer("Shared", "bob", "bob-worker", t.bob):
            pass
        # Required: a credential and a grant for everything.
        with t.service() as service:
            service.set_mode(AuthorizationMode.REQUIRED)
        # Coordinators apply a change at their next catalog load (refresh_interval).
        wait_until(lambda: coordinator.catalog.entitlements.required or None,
                   what="the coordinator's catalog in required mode")
        with pytest.raises(NotAuthorizedError, match="may not consume queue 'Shared'"):
            t.consumer("Shared", "bob", "bob-worker", t.bob).close()
        with pytest.raises(NotAuthorizedError, match="requires a credential"):
            t.consumer("BobJobs", "bob", "guest-worker", None).close()
        with t.consumer("BobJobs", "bob", "bob-worker", t.bob):
            pass
        # A revoked grant ends the session that relied on it, at the next catalog load.
        with t.consumer("AliceJobs", "alice", "alice-worker", t.alice, max_backlog=10) as alice:
            assert alice.receive(timeout=30) is not None
            with t.service() as service:
                service.revoke("alice", GrantKind.QUEUE, "AliceJobs")
            with pytest.raises(SessionEndedError, match="authorization revoked"):
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    alice.receive(timeout=0.5)
        # Counted once, exactly, in the shards' stored totals (an iteration that failed and
        # was rebuilt on a loaded machine ends the restored session again, and the process's
        # own counters, since it started, then said 2).
        def revoked() -> int | None:
            with Store(t.settings.database_url) as store:
                found = store.all_shard_counters()
            return sum(c.get("refused:session:revoked:alice", 0) for c in found.values()) or None

        assert wait_until(revoked, what="the revocation stored") == 1
        assert coordinator.counters["sessions_revoked"] >= 1
        # Once the coordinators loaded a rotation, the old credential is refused and the new
        # one works.
        with t.service() as service:
            service.grant("alice", GrantKind.QUEUE, "AliceJobs")
            rotated = str(service.rotate("alice"))
        new_hash = parse_credential(rotated).sha256
        wait_until(lambda: coordinator.catalog.entitlements.current("alice", new_hash) or None,
                   what="the rotation loaded")
        with pytest.raises(NotAuthorizedError, match="credential was not accepted"):
            t.consumer("AliceJobs", "alice", "alice-worker", t.alice).close()
        with t.consumer("AliceJobs", "alice", "alice-worker", rotated) as alice:
            assert alice.receive(timeout=30) is not None


def test_delivery_topics_are_named_by_qlayer_a_journal_or_another_consumers_topic_is_refused(
        tenants: Tenants) -> None:
    """Finding 4: a Subscribe naming a journal as its delivery topic made the coordinator append
    deliveries to it (enqueued again: 5 -> 1,007 records in 30 s); under ACLs the refused write
    became a rebuild loop (51 rebuilds in 40 s)."""
    t = tenants
    plain = t.secured.node.config.bootstrap_servers
    with t.service() as service:
        service.grant("bob", GrantKind.QUEUE, "AliceJobs")  # so only the topic is wrong
    before = _end_offset(plain, t.alice_journal)
    with running_coordinator(t.settings) as coordinator:
        bob = t.forger("AliceJobs", "bob-worker", t.bob)
        for target in (t.alice_journal, t.topics.delivery("alice-worker"), t.topics.events,
                       t.topics.queues):
            bob.send_subscribe(delivery_topic=target)
        wait_until(lambda: coordinator.refusals[
            ("subscribe", "delivery_topic_not_its_own", "bob")] == 4 or None,
            what="the four Subscribes refused")
        time.sleep(1.0)  # whatever the coordinator would write, it has written by now
        assert coordinator.counters["iteration_failures"] == 0
        assert coordinator.counters["shard_failures"] == 0
    assert _end_offset(plain, t.alice_journal) == before
    with pytest.raises(KeyError):
        _end_offset(plain, t.topics.delivery("alice-worker"))


def _end_offset(servers: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": servers, "group.id": f"probe-{uuid.uuid4().hex}"})
    try:
        if topic not in consumer.list_topics(timeout=10).topics:
            raise KeyError(topic)
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        return int(high)
    finally:
        consumer.close()
