"""The ACL recipe of docs/security.md on a real broker with SASL/SCRAM and the StandardAuthorizer.

The broker is the session's secured one (`tests.support.secured`, the ``secured`` fixture of
tests/integration/conftest.py), next to the plain one, so no other test runs against an
authorizer. Users and ACLs are made with the same code as `qlayer security acls`
(`layer.kafka.acls`), through the broker's PLAINTEXT listener (a super user's door).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Consumer, KafkaError
from typer.testing import CliRunner

from layer.kafka.acls import Role, apply_acls, recipe, sdk_group
from layer.kafka.errors import KafkaAdapterError
from layer.protocol import TopicNames
from layer.sdk import QueueConsumer, QueuePublisher
from layer.settings import Settings
from layer_cli.main import app
from tests.support.coordinator import counters, put_queues, running_coordinator, wait_until
from tests.support.kafka import create_topic
from tests.support.secured import SecuredKafka

pytestmark = pytest.mark.integration


def _read_error(servers: str, security: dict[str, str], group: str,
                topic: str) -> KafkaError | None:
    """What a plain Kafka consumer logged in with ``security`` gets reading ``topic`` (None: a
    record), its group id one it may use. Subscribed, not assigned: librdkafka reports a topic
    it may not read to a subscriber at once, and to an assignment never."""
    consumer = Consumer({"bootstrap.servers": servers, **security, "group.id": group,
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        consumer.subscribe([topic])
        for _ in range(40):
            message = consumer.poll(0.25)
            if message is not None:
                return message.error()
        return None
    finally:
        consumer.close()


def test_consumer_b_cannot_read_what_the_recipe_keeps_from_it(
        secured: SecuredKafka, database_url: str, unique_name: Callable[[str], str]) -> None:
    topics = TopicNames(f"qsec{uuid.uuid4().hex[:8]}.")
    journal = unique_name("Work")
    create_topic(secured.node.config.bootstrap_servers, journal, partitions=2)
    coordinator_user, coordinator_kafka = secured.user("coordinator")
    publisher_user, publisher_kafka = secured.user("publisher")
    alice, alice_kafka = secured.user("alice")
    bob, bob_kafka = secured.user("bob")
    rules = [*recipe(Role.COORDINATOR, coordinator_user, topics, journals=[journal]),
             *recipe(Role.PUBLISHER, publisher_user, topics, journals=[journal]),
             *recipe(Role.CONSUMER, alice, topics, consumer_id="alice-worker"),
             *recipe(Role.CONSUMER, bob, topics, consumer_id="bob-worker")]
    assert apply_acls(secured.admin, rules) == len(set(rules))

    settings = Settings(bootstrap_servers=secured.sasl_servers, database_url=database_url,
                        topic_prefix=topics.prefix, kafka=coordinator_kafka)
    put_queues(settings, {"name": "Jobs", "underlying_topic": journal})
    with QueuePublisher(secured.sasl_servers, topic_prefix=topics.prefix,
                        kafka_config=publisher_kafka) as publisher:
        for i in range(20):
            publisher.publish(journal, json.dumps({"n": i}).encode(), key=str(i).encode())

    with running_coordinator(settings):
        with QueueConsumer("Jobs", secured.sasl_servers, topic_prefix=topics.prefix,
                           kafka_config=alice_kafka, consumer_id="alice-worker",
                           max_backlog=5) as consumer:
            seen = []
            while len(seen) < 20:
                message = consumer.receive(timeout=30)
                assert message is not None, f"alice got {len(seen)} of 20"
                seen.append(message.json()["n"])
                message.ack()
        wait_until(lambda: counters(settings, "Jobs").get("acked") == 20 or None,
                   timeout=30, what="alice's 20 acks applied")
    assert sorted(seen) == list(range(20))

    # Bob, a consumer with his own ACLs, reads none of it: not alice's deliveries, not the
    # Subscribes and acks of other sessions.
    for topic in (topics.delivery("alice-worker"), topics.control, topics.ack):
        error = _read_error(secured.sasl_servers, bob_kafka, sdk_group(topics, "bob-worker"),
                            topic)
        assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, (
            topic, error)
    # Nor does posing as alice's consumer id get him her delivery topic.
    with pytest.raises(KafkaAdapterError, match=f"does not allow user {bob!r}"):
        QueueConsumer("Jobs", secured.sasl_servers, topic_prefix=topics.prefix,
                      kafka_config=bob_kafka, consumer_id="alice-worker",
                      subscribe_timeout=10).close()
    # While the recipe's rights were enough for alice: the same reads as her succeed.
    assert _read_error(secured.sasl_servers, alice_kafka, sdk_group(topics, "alice-worker"),
                       topics.delivery("alice-worker")) is None


def test_the_cli_works_over_sasl_and_a_refused_login_is_one_line(
        secured: SecuredKafka, database_url: str, unique_name: Callable[[str], str],
        tmp_path: Path) -> None:
    topics = TopicNames(f"qsec{uuid.uuid4().hex[:8]}.")
    journal = unique_name("Work")
    create_topic(secured.node.config.bootstrap_servers, journal, partitions=1)
    operator, operator_kafka = secured.user("operator")
    runner = CliRunner()
    # The recipe through the CLI, as docs/security.md has an admin run it (the PLAINTEXT
    # listener's principal is a super user).
    granted = runner.invoke(app, [
        "security", "acls", "--role", "operator", "--user", operator, "--journal", journal,
        "--apply", "--bootstrap-servers", secured.node.config.bootstrap_servers,
        "--topic-prefix", topics.prefix], env={"QLAYER_CONFIG": "/dev/null"})
    assert granted.exit_code == 0, granted.output
    assert "created 5 ACLs for User:operator-" in granted.output
    config = tmp_path / "qlayer.yaml"  # the settings file an operator writes
    config.write_text(yaml.safe_dump({"bootstrap_servers": secured.sasl_servers,
                                      "database_url": database_url,
                                      "topic_prefix": topics.prefix, "kafka": operator_kafka}))
    env = {"QLAYER_CONFIG": str(config)}
    put_queues(Settings.load(env=env), {"name": "Jobs", "underlying_topic": journal})

    published = runner.invoke(app, ["publish", journal], env=env, input="a\nb\nc\n")
    assert published.exit_code == 0, published.output
    stats = runner.invoke(app, ["stats", "Jobs", "--json", "--interval", "0.1"], env=env)
    assert stats.exit_code == 0, stats.output
    (row,) = json.loads(stats.stdout)["queues"]
    assert row["queue"] == "Jobs" and row["problem"] is None, row
    assert [p["end_offset"] for p in row["partitions"]] == [3], row

    # The same file with a wrong password, overridden by the environment as a deployment
    # would: one line naming the broker and the user, not librdkafka's log.
    wrong = {**env, "QLAYER_KAFKA": json.dumps({**operator_kafka, "sasl.password": "wrong"})}
    refused = runner.invoke(app, ["stats", "Jobs", "--json"], env=wrong)
    assert refused.exit_code == 1
    assert str(refused.exception).count("\n") == 0
    assert (f"Kafka at {secured.sasl_servers} refused the login of user {operator!r} "
            "(SCRAM-SHA-512)") in str(refused.exception)
    assert "invalid credentials" in str(refused.exception)


def test_a_consumer_with_a_wrong_password_is_told_so(secured: SecuredKafka) -> None:
    topics = TopicNames(f"qsec{uuid.uuid4().hex[:8]}.")
    alice, alice_kafka = secured.user("alice")
    apply_acls(secured.admin, recipe(Role.CONSUMER, alice, topics, consumer_id="alice-worker"))
    with pytest.raises(KafkaAdapterError, match=(
            f"refused the login of user {alice!r} .SCRAM-SHA-512.: .*invalid credentials")):
        QueueConsumer("Jobs", secured.sasl_servers, topic_prefix=topics.prefix,
                      kafka_config={**alice_kafka, "sasl.password": "wrong"},
                      consumer_id="alice-worker", subscribe_timeout=5).close()


def test_the_spark_audit_reads_the_secured_broker_with_the_same_kafka_settings(
        secured: SecuredKafka, database_url: str, unique_name: Callable[[str], str],
        tmp_path: Path) -> None:
    """`qlayer pipeline reconcile` (Spark's Kafka source, a separate JVM) logs in with the
    settings file's `kafka:` block, as the coordinator and the SDK do, and with the pipeline
    role's ACLs alone it reads the journal and the events: the audit finds every entry done."""
    topics = TopicNames(f"qsec{uuid.uuid4().hex[:8]}.")
    journal = unique_name("Audit")
    create_topic(secured.node.config.bootstrap_servers, journal, partitions=1)
    coordinator_user, coordinator_kafka = secured.user("coordinator")
    worker, worker_kafka = secured.user("worker")
    spark_user, spark_kafka = secured.user("spark")
    rules = [*recipe(Role.COORDINATOR, coordinator_user, topics, journals=[journal]),
             *recipe(Role.CONSUMER, worker, topics, consumer_id="audit-worker"),
             *recipe(Role.PIPELINE, spark_user, topics, journals=[journal])]
    assert apply_acls(secured.admin, rules) == len(set(rules))
    settings = Settings(bootstrap_servers=secured.sasl_servers, database_url=database_url,
                        topic_prefix=topics.prefix, kafka=coordinator_kafka)
    put_queues(settings, {"name": "Audited", "underlying_topic": journal})
    with QueuePublisher(secured.node.config.bootstrap_servers,
                        topic_prefix=topics.prefix) as publisher:
        for i in range(6):
            publisher.publish(journal, str(i).encode(), key=str(i).encode())
    with running_coordinator(settings):
        with QueueConsumer("Audited", secured.sasl_servers, topic_prefix=topics.prefix,
                           kafka_config=worker_kafka, consumer_id="audit-worker",
                           max_backlog=6) as consumer:
            for _ in range(6):
                message = consumer.receive(timeout=30)
                assert message is not None
                message.ack()
        wait_until(lambda: counters(settings, "Audited").get("acked") == 6 or None,
                   timeout=30, what="the 6 acks applied")

    config = tmp_path / "qlayer.yaml"
    config.write_text(yaml.safe_dump({"bootstrap_servers": secured.sasl_servers,
                                      "database_url": database_url,
                                      "topic_prefix": topics.prefix, "kafka": spark_kafka}))
    qlayer = Path(sys.executable).with_name("qlayer")
    audit = subprocess.run([str(qlayer), "pipeline", "reconcile", "Audited", "--json"],
                           env={**os.environ, "QLAYER_CONFIG": str(config)},
                           capture_output=True, text=True, timeout=600, check=False)
    assert audit.returncode == 0, audit.stderr[-3000:]
    report = json.loads(audit.stdout)
    assert (report["done"], report["pending"], report["ok"], report["violations"]) == (
        6, 0, True, [])
