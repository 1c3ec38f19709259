"""`qlayer security acls`: the ACL recipe of docs/security.md for one principal, printed or
created on the cluster with the current settings' Kafka (which must be allowed to alter ACLs)."""

from __future__ import annotations

from collections.abc import Sequence

from layer.kafka.acls import AclRule, Role, apply_acls, recipe
from layer.protocol.topics import TopicNames
from layer.settings import Settings

__all__ = ["acl_recipe", "create_acls"]


def acl_recipe(settings: Settings, role: Role, user: str, *, consumer_id: str | None = None,
               journals: Sequence[str] = (), journal_prefixes: Sequence[str] = (),
               transactional: bool = False) -> list[AclRule]:
    """The rules for ``user`` in ``role`` under the settings' topic prefix."""
    return recipe(role, user, TopicNames(settings.topic_prefix), consumer_id=consumer_id,
                  journals=journals, journal_prefixes=journal_prefixes,
                  transactional=transactional)


def create_acls(settings: Settings, rules: Sequence[AclRule]) -> int:
    """Create the rules with the settings' Kafka client properties; how many were sent."""
    return apply_acls(settings.kafka_config(), rules)
