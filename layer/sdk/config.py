"""Where the SDK's Kafka is and how qlayer's topics are named: the CLI's settings.

One settings file configures both (issue 16 item 8): the SDK resolves ``bootstrap_servers``,
``topic_prefix`` and ``kafka`` (librdkafka properties: SASL/TLS, tuning) as the CLI does
(`layer.settings.Settings`): arguments > ``QLAYER_*`` environment variables > the config file
(``QLAYER_CONFIG``, else ./qlayer.yaml) > defaults. The SDK never uses PostgreSQL; a
``database_url`` in the file is read and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from layer.protocol.topics import TopicNames
from layer.settings import DEFAULT_BOOTSTRAP_SERVERS, Settings

__all__ = ["DEFAULT_BOOTSTRAP_SERVERS", "ClientConfig"]



@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Resolved connection settings shared by the consumer, the publisher and the directory."""

    bootstrap_servers: str
    topics: TopicNames
    kafka_config: Mapping[str, Any] = field(default_factory=dict)
    #: The consumer's credential (``QLAYER_CREDENTIAL`` or the file's ``credential``), if any.
    credential: str | None = field(default=None, repr=False)

    @classmethod
    def resolve(
        cls,
        bootstrap_servers: str | None = None,
        topic_prefix: str | None = None,
        kafka_config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ClientConfig:
        """Arguments > environment (``env``, default os.environ) > config file > defaults.

        ``kafka_config`` is merged over the settings' ``kafka`` properties (a property given
        here wins; the file's security settings stay). Raises `layer.settings.SettingsError`
        when the environment or the file cannot be used.
        """
        settings = Settings.load(env=env, bootstrap_servers=bootstrap_servers or None,
                                 topic_prefix=topic_prefix)
        extra: dict[str, Any] = {**settings.kafka, **(kafka_config or {})}
        servers = settings.bootstrap_servers
        # bootstrap.servers has one source of truth; two would be a silent surprise.
        given = extra.pop("bootstrap.servers", None)
        if given is not None and bootstrap_servers is None:
            servers = str(given)
        credential = (settings.credential.get_secret_value()
                      if settings.credential is not None else None)
        return cls(servers, TopicNames(settings.topic_prefix), extra, credential or None)

    def client(self, **properties: Any) -> dict[str, Any]:
        """librdkafka properties for one client: servers, the caller's extras, then ours."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.kafka_config, **properties}
