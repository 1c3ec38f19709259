"""The Kafka ACL recipe of docs/security.md, as data, and the admin call that applies it.

DESIGN §5 "Identity": consumers have Write but not Read on the control and ack topics, and each
consumer Reads only its own delivery topic. The recipe is pure (`consumer_acls`,
`coordinator_acls`, ...): `qlayer security acls` prints or applies it, and the integration test
of the secured broker applies the same rules, so the document and the broker cannot drift.
`apply_acls` is the only I/O here (confluent-kafka's `AdminClient.create_acls`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from layer.kafka.errors import DRIVER_ERRORS, LoginWatch, driver_error, translated
from layer.kafka.logs import logged
from layer.protocol.topics import TopicNames

__all__ = [
    "AclRule",
    "Pattern",
    "Resource",
    "Role",
    "apply_acls",
    "consumer_acls",
    "coordinator_acls",
    "operator_acls",
    "pipeline_acls",
    "principal",
    "publisher_acls",
    "recipe",
    "sdk_group",
]


class Resource(StrEnum):
    TOPIC = "TOPIC"
    GROUP = "GROUP"
    TRANSACTIONAL_ID = "TRANSACTIONAL_ID"


class Pattern(StrEnum):
    LITERAL = "LITERAL"
    PREFIXED = "PREFIXED"


class Role(StrEnum):
    """Who a principal is to qlayer; each has one function below."""

    CONSUMER = "consumer"
    PUBLISHER = "publisher"
    COORDINATOR = "coordinator"
    OPERATOR = "operator"
    PIPELINE = "pipeline"


@dataclass(frozen=True, order=True)
class AclRule:
    """One ALLOW ACL: ``principal`` may do ``operation`` on a resource, from any host.

    ``operation`` is Kafka's name (READ, WRITE, CREATE, DESCRIBE, ALL, ...). Kafka's implied
    rights apply: READ and WRITE on a topic imply DESCRIBE on it.
    """

    principal: str
    resource: Resource
    name: str
    pattern: Pattern
    operation: str

    def __str__(self) -> str:
        where = self.name + ("*" if self.pattern is Pattern.PREFIXED else "")
        return f"ALLOW {self.principal} {self.operation} {self.resource.value} {where}"

    def as_dict(self) -> dict[str, str]:
        return {"principal": self.principal, "resource": self.resource.value,
                "name": self.name, "pattern": self.pattern.value, "operation": self.operation,
                "permission": "ALLOW", "host": "*"}


def principal(user: str) -> str:
    """``User:alice`` for a SASL user name; a name that already has a type stays as it is."""
    return user if ":" in user else f"User:{user}"


def _topic(who: str, name: str, *operations: str, prefixed: bool = False) -> list[AclRule]:
    pattern = Pattern.PREFIXED if prefixed else Pattern.LITERAL
    return [AclRule(who, Resource.TOPIC, name, pattern, op) for op in operations]


def _journals(who: str, journals: Sequence[str], journal_prefixes: Sequence[str],
              *operations: str) -> list[AclRule]:
    rules: list[AclRule] = []
    for name in journals:
        rules += _topic(who, name, *operations)
    for prefix in journal_prefixes:
        rules += _topic(who, prefix, *operations, prefixed=True)
    return rules


def consumer_acls(user: str, consumer_id: str, topics: TopicNames,
                  transactional: bool = False) -> list[AclRule]:
    """A consumer: Write on the control and ack topics, Read on its own delivery topic only.

    Nothing else: it cannot read the control or ack topics (other sessions' records), nor any
    other consumer's deliveries. Its delivery reader never joins its group or commits, but
    librdkafka still looks the group's coordinator up, which needs Read on the group
    ``<prefix>sdk.<consumer_id>``. Its producer is idempotent, which Write on a topic allows
    (KIP-679). The coordinator creates the delivery topic on Subscribe.

    ``transactional`` (exactly-once processing, protocol 9): Write on the transactional ids
    of its sessions, ``<prefix>qlayer-tx.<consumer_id>.*`` (the SDK's default names), and no
    other; the coordinator, which fences them, has the whole prefix already. Write on the
    topics it produces its results to is the application's to grant.
    """
    who = principal(user)
    rules = [*_topic(who, topics.control, "WRITE"),
             *_topic(who, topics.ack, "WRITE"),
             *_topic(who, topics.delivery(consumer_id), "READ"),
             AclRule(who, Resource.GROUP, sdk_group(topics, consumer_id), Pattern.LITERAL,
                     "READ")]
    if transactional:
        rules.append(AclRule(who, Resource.TRANSACTIONAL_ID,
                             f"{topics.prefix}qlayer-tx.{consumer_id}.", Pattern.PREFIXED,
                             "WRITE"))
    return rules


def sdk_group(topics: TopicNames, consumer_id: str) -> str:
    """The group id of a consumer's delivery reader (`layer.sdk.consumer`)."""
    return topics.prefix + "sdk." + consumer_id


def publisher_acls(user: str, topics: TopicNames, journals: Sequence[str] = (),
                   journal_prefixes: Sequence[str] = ()) -> list[AclRule]:
    """A publisher: Write on its journals; Read on the queue directory (publishing by queue
    name) under its own group id."""
    who = principal(user)
    return [*_journals(who, journals, journal_prefixes, "WRITE"),
            *_topic(who, topics.queues, "READ"),
            AclRule(who, Resource.GROUP, topics.prefix + "sdk.directory", Pattern.LITERAL,
                    "READ")]


def coordinator_acls(user: str, topics: TopicNames, journals: Sequence[str] = (),
                     journal_prefixes: Sequence[str] = ()) -> list[AclRule]:
    """A coordinator: everything under the prefix, and Read on the journals.

    "Everything" because it creates, reads and writes every internal topic (control, ack,
    delivery, events, queues, shards, dead-letter topics), joins or commits every internal
    group (the shard group, one group per queue for lag tools, its journal readers) and, with
    ``--transactions``, owns the transactional ids ``<prefix>coordinator-<shard>``.
    """
    who = principal(user)
    return [*_topic(who, topics.prefix, "ALL", prefixed=True),
            AclRule(who, Resource.GROUP, topics.prefix, Pattern.PREFIXED, "ALL"),
            AclRule(who, Resource.TRANSACTIONAL_ID, topics.prefix, Pattern.PREFIXED, "ALL"),
            *_journals(who, journals, journal_prefixes, "READ")]


def operator_acls(user: str, topics: TopicNames, journals: Sequence[str] = (),
                  journal_prefixes: Sequence[str] = ()) -> list[AclRule]:
    """The `qlayer` CLI of an operator: the coordinator's rights (it reads and writes the same
    topics: stats, view, ack, purge, dlq) plus Write on the journals (publish, dlq redrive)."""
    who = principal(user)
    return [*coordinator_acls(user, topics, journals, journal_prefixes),
            *_journals(who, journals, journal_prefixes, "WRITE")]


#: The group id prefix Spark's Kafka source uses for its own consumers (`groupIdPrefix`).
SPARK_GROUP_PREFIX = "spark-kafka-"


def pipeline_acls(user: str, topics: TopicNames, journals: Sequence[str] = (),
                  journal_prefixes: Sequence[str] = ()) -> list[AclRule]:
    """The Spark pipeline: Read on the journals and the events topic, and its source's groups."""
    who = principal(user)
    return [*_journals(who, journals, journal_prefixes, "READ"),
            *_topic(who, topics.events, "READ"),
            AclRule(who, Resource.GROUP, SPARK_GROUP_PREFIX, Pattern.PREFIXED, "READ")]


def recipe(role: Role, user: str, topics: TopicNames, *, consumer_id: str | None = None,
           journals: Sequence[str] = (), journal_prefixes: Sequence[str] = (),
           transactional: bool = False) -> list[AclRule]:
    """The rules for one principal in one role (a consumer needs its ``consumer_id``;
    ``transactional``: a consumer that settles in Kafka transactions)."""
    if role is Role.CONSUMER:
        if not consumer_id:
            raise ValueError("a consumer's ACLs name its consumer id")
        return consumer_acls(user, consumer_id, topics, transactional)
    if transactional:
        raise ValueError("--transactional is for a consumer's ACLs (the coordinator has "
                         "every transactional id under the prefix already)")
    make = {Role.PUBLISHER: publisher_acls, Role.COORDINATOR: coordinator_acls,
            Role.OPERATOR: operator_acls, Role.PIPELINE: pipeline_acls}[role]
    return make(user, topics, journals, journal_prefixes)


def apply_acls(admin_config: Mapping[str, Any], rules: Iterable[AclRule],
               timeout: float = 30.0) -> int:
    """Create the rules on the cluster (idempotent: an existing ACL is left as it is).

    ``admin_config`` must belong to a principal allowed to ALTER the cluster's ACLs (a super
    user). Returns how many rules were sent; raises `KafkaAdapterError`.
    """
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AclBinding,
        AclOperation,
        AclPermissionType,
        AdminClient,
        ResourcePatternType,
        ResourceType,
    )

    bindings = [
        AclBinding(ResourceType[r.resource.value],
                   r.name,
                   ResourcePatternType[r.pattern.value], r.principal, "*",
                   AclOperation[r.operation], AclPermissionType.ALLOW)
        for r in sorted(set(rules))
    ]
    if not bindings:
        return 0
    login = LoginWatch()
    config = {"error_cb": login, **admin_config}
    with translated("cannot create a Kafka admin client"):
        admin = AdminClient(logged(config))
    try:
        for future in admin.create_acls(bindings, request_timeout=timeout).values():
            future.result(timeout=timeout)
    except DRIVER_ERRORS as exc:
        with contextlib.suppress(*DRIVER_ERRORS):
            admin.poll(0)  # serves error_cb: the reason of a refused login
        raise driver_error("cannot create Kafka ACLs (that takes a super user or Alter on "
                           "the cluster)", exc, config=config, login=login) from exc
    return len(bindings)
