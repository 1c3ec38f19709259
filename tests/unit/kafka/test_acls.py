"""The ACL recipe of docs/security.md (DESIGN §5 "Identity") as data."""

from __future__ import annotations

import pytest

from layer.kafka.acls import AclRule, Pattern, Resource, Role, recipe
from layer.protocol import TopicNames

TOPICS = TopicNames("qlayer.")


def _rights(rules: list[AclRule]) -> set[tuple[str, str, str, str]]:
    return {(r.resource.value, r.name, r.pattern.value, r.operation) for r in rules}


def test_a_consumer_writes_control_and_acks_and_reads_only_its_own_deliveries() -> None:
    rules = recipe(Role.CONSUMER, "alice", TOPICS, consumer_id="w1")
    assert {r.principal for r in rules} == {"User:alice"}
    assert _rights(rules) == {
        ("TOPIC", "qlayer.control", "LITERAL", "WRITE"),
        ("TOPIC", "qlayer.ack", "LITERAL", "WRITE"),
        ("TOPIC", "qlayer.delivery.w1", "LITERAL", "READ"),
        ("GROUP", "qlayer.sdk.w1", "LITERAL", "READ"),
    }


def test_a_transactional_consumer_writes_with_its_own_sessions_transactional_ids_only() -> None:
    rules = recipe(Role.CONSUMER, "alice", TOPICS, consumer_id="w1", transactional=True)
    extra = _rights(rules) - _rights(recipe(Role.CONSUMER, "alice", TOPICS, consumer_id="w1"))
    # The SDK's names, <prefix>qlayer-tx.<consumer id>.<session id> (layer/sdk/transaction.py).
    assert extra == {("TRANSACTIONAL_ID", "qlayer.qlayer-tx.w1.", "PREFIXED", "WRITE")}
    with pytest.raises(ValueError, match="consumer's ACLs"):
        recipe(Role.COORDINATOR, "c", TOPICS, transactional=True)


def test_a_consumer_needs_its_id_and_a_bad_id_is_refused() -> None:
    with pytest.raises(ValueError, match="consumer id"):
        recipe(Role.CONSUMER, "alice", TOPICS)
    with pytest.raises(ValueError):
        recipe(Role.CONSUMER, "alice", TOPICS, consumer_id="a/b")


def test_the_coordinator_has_the_prefix_and_reads_journals() -> None:
    rights = _rights(recipe(Role.COORDINATOR, "User:coord", TOPICS, journals=["orders"],
                            journal_prefixes=["billing."]))
    assert rights == {
        ("TOPIC", "qlayer.", "PREFIXED", "ALL"),
        ("GROUP", "qlayer.", "PREFIXED", "ALL"),
        ("TRANSACTIONAL_ID", "qlayer.", "PREFIXED", "ALL"),
        ("TOPIC", "orders", "LITERAL", "READ"),
        ("TOPIC", "billing.", "PREFIXED", "READ"),
    }
    operator = _rights(recipe(Role.OPERATOR, "ops", TOPICS, journals=["orders"]))
    assert ("TOPIC", "orders", "LITERAL", "WRITE") in operator


def test_the_pipeline_and_publisher_read_only_what_they_use() -> None:
    assert _rights(recipe(Role.PIPELINE, "spark", TOPICS, journals=["orders"])) == {
        ("TOPIC", "orders", "LITERAL", "READ"),
        ("TOPIC", "qlayer.events", "LITERAL", "READ"),
        ("GROUP", "spark-kafka-", "PREFIXED", "READ"),
    }
    assert _rights(recipe(Role.PUBLISHER, "app", TOPICS, journals=["orders"])) == {
        ("TOPIC", "orders", "LITERAL", "WRITE"),
        ("TOPIC", "qlayer.queues", "LITERAL", "READ"),
        ("GROUP", "qlayer.sdk.directory", "LITERAL", "READ"),
    }


def test_a_rule_prints_as_the_cli_shows_it() -> None:
    rule = AclRule("User:spark", Resource.TOPIC, "orders.", Pattern.PREFIXED, "READ")
    assert str(rule) == "ALLOW User:spark READ TOPIC orders.*"
    assert rule.as_dict()["pattern"] == "PREFIXED"
