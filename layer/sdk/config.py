"""Where the SDK's Kafka is and how qlayer's topics are named: argument > environment > default.

The SDK reads only ``QLAYER_BOOTSTRAP_SERVERS`` and ``QLAYER_TOPIC_PREFIX``; it needs no config
file and never PostgreSQL. Security settings (SASL/TLS) are librdkafka properties given as
``kafka_config`` and passed to every client the SDK creates.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from layer.protocol.topics import DEFAULT_TOPIC_PREFIX, TopicNames

__all__ = ["DEFAULT_BOOTSTRAP_SERVERS", "ClientConfig"]

DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"
_BOOTSTRAP_ENV = "QLAYER_BOOTSTRAP_SERVERS"
_PREFIX_ENV = "QLAYER_TOPIC_PREFIX"


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Resolved connection settings shared by the consumer, the publisher and the directory."""

    bootstrap_servers: str
    topics: TopicNames
    kafka_config: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        bootstrap_servers: str | None = None,
        topic_prefix: str | None = None,
        kafka_config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ClientConfig:
        environ = os.environ if env is None else env
        servers = bootstrap_servers or environ.get(_BOOTSTRAP_ENV) or DEFAULT_BOOTSTRAP_SERVERS
        prefix = topic_prefix if topic_prefix is not None else environ.get(_PREFIX_ENV)
        extra = dict(kafka_config or {})
        # bootstrap.servers has one source of truth; two would be a silent surprise.
        given = extra.pop("bootstrap.servers", None)
        if given is not None and bootstrap_servers is None:
            servers = str(given)
        return cls(servers, TopicNames(prefix or DEFAULT_TOPIC_PREFIX), extra)

    def client(self, **properties: Any) -> dict[str, Any]:
        """librdkafka properties for one client: servers, the caller's extras, then ours."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.kafka_config, **properties}
