"""A broker with SASL/SCRAM and the KRaft StandardAuthorizer (``allow.everyone.if.no.acl.found``
false), beside the session's plain one, for the tests of docs/security.md: the ACL recipe
(tests/integration/test_security.py) and authorization (tests/integration/test_authorization.py).

One per test session (`tests/integration/conftest.py`), started the first time a test asks for
it, on three free ports from 31092 (or QLAYER_TEST_SECURED_KAFKA_PORT), in
``<QLAYER_TEST_STATE_DIR>/secured``. Users and ACLs are made through its PLAINTEXT listener,
whose principal (User:ANONYMOUS) is a super user.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from layer.localstack.kafka import KafkaConfig, KafkaNode, sasl_client_config
from layer.localstack.stack import default_cache_dir
from tests.support.ports import reserve_ports

__all__ = ["SecuredKafka", "secured_kafka"]


@dataclass
class SecuredKafka:
    node: KafkaNode

    @property
    def admin(self) -> dict[str, str]:
        """The PLAINTEXT listener: User:ANONYMOUS, a super user."""
        return {"bootstrap.servers": self.node.config.bootstrap_servers}

    @property
    def sasl_servers(self) -> str:
        servers = self.node.config.sasl_bootstrap_servers
        assert servers is not None
        return servers

    def user(self, stem: str) -> tuple[str, dict[str, str]]:
        """A new SCRAM user: its name and the librdkafka settings that log in as it."""
        name = f"{stem}-{uuid.uuid4().hex[:6]}"
        password = secrets.token_urlsafe(12)
        self.node.set_scram_user(name, password)
        security = sasl_client_config(self.node.config, name, password)
        del security["bootstrap.servers"]
        return name, security


def secured_kafka() -> Iterator[SecuredKafka]:
    # Three free ports below the ephemeral range (a fixed port next to the session's broker
    # was once held by a client connection: "Address already in use").
    wanted = os.environ.get("QLAYER_TEST_SECURED_KAFKA_PORT")
    # Reserved while it runs, so no other session or worker takes them (tests/support/ports.py).
    reserved = None if wanted else reserve_ports(31_092, 3)
    base = int(wanted) if wanted else reserved.first  # type: ignore[union-attr]
    state = Path(os.environ.get("QLAYER_TEST_STATE_DIR")
                 or Path(tempfile.gettempdir()) / "qlayer-test-stack") / "secured"
    node = KafkaNode(KafkaConfig(state_dir=state, cache_dir=default_cache_dir(),
                                 port=base, controller_port=base + 1, sasl_port=base + 2))
    try:
        # Its ports change from run to run: a broker kept from an earlier run is stopped first.
        node.down()
        node.wipe()
        node.up()
        yield SecuredKafka(node)
    finally:
        node.down()
        if reserved is not None:
            reserved.release()
