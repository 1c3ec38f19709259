"""qlayer over TLS on a real broker: the local stack's TLS listener (`KafkaConfig.ssl_port`, its
CA and certificate made at start-up by `layer.localstack.tls`), and the coordinator, an SDK
consumer and publisher and the CLI, each given only ``security.protocol`` and
``ssl.ca.location`` in the same ``kafka:`` settings as any other (docs/security.md). A client
that does not trust the CA is refused with one line, not a traceback."""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from layer.kafka.errors import KafkaAdapterError
from layer.localstack.kafka import KafkaConfig, KafkaNode
from layer.localstack.stack import default_cache_dir
from layer.sdk import QueueConsumer, QueuePublisher
from layer.settings import Settings
from layer_cli.main import app
from tests.support.coordinator import counters, put_queues, running_coordinator, wait_until
from tests.support.kafka import create_topic
from tests.support.ports import reserve_ports

# One xdist group (`--dist loadgroup`): its TLS broker (module-scoped, in
# <QLAYER_TEST_STATE_DIR>/tls) is started once, on one worker.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("tls")]


@pytest.fixture(scope="module")
def tls_node() -> Iterator[KafkaNode]:
    reserved = reserve_ports(31_192, 3)
    base = reserved.first
    state = Path(os.environ.get("QLAYER_TEST_STATE_DIR")
                 or Path(tempfile.gettempdir()) / "qlayer-test-stack") / "tls"
    node = KafkaNode(KafkaConfig(state_dir=state, cache_dir=default_cache_dir(),
                                 port=base, controller_port=base + 1, ssl_port=base + 2))
    try:
        node.down()
        node.wipe()
        node.up()
        yield node
    finally:
        node.down()
        reserved.release()


def test_coordinator_sdk_and_cli_work_over_tls_and_a_client_without_the_ca_is_told_so(
        tls_node: KafkaNode, database_url: str, unique_name: Callable[[str], str],
        tmp_path: Path) -> None:
    c = tls_node.config
    assert c.ssl_bootstrap_servers is not None
    servers = c.ssl_bootstrap_servers
    tls = {"security.protocol": "SSL", "ssl.ca.location": str(c.tls_dir / "ca.pem")}
    prefix = f"qtls{uuid.uuid4().hex[:8]}."
    journal = unique_name("Work")
    create_topic(c.bootstrap_servers, journal, partitions=1)
    settings = Settings(bootstrap_servers=servers, database_url=database_url,
                        topic_prefix=prefix, kafka=tls)
    put_queues(settings, {"name": "Jobs", "underlying_topic": journal})
    with QueuePublisher(servers, topic_prefix=prefix, kafka_config=tls) as publisher:
        for i in range(10):
            publisher.publish(journal, json.dumps({"n": i}).encode())

    config = tmp_path / "qlayer.yaml"  # the settings file an operator writes
    config.write_text(yaml.safe_dump({"bootstrap_servers": servers, "database_url": database_url,
                                      "topic_prefix": prefix, "kafka": tls}))
    env = {"QLAYER_CONFIG": str(config)}
    runner = CliRunner()
    published = runner.invoke(app, ["publish", journal], env=env, input='{"n": 10}\n')
    assert published.exit_code == 0, published.output

    with running_coordinator(settings):
        with QueueConsumer("Jobs", servers, topic_prefix=prefix, kafka_config=tls,
                           max_backlog=5) as consumer:
            seen = []
            while len(seen) < 11:
                message = consumer.receive(timeout=30)
                assert message is not None, f"got {len(seen)} of 11"
                seen.append(message.json()["n"])
                message.ack()
        wait_until(lambda: counters(settings, "Jobs").get("acked") == 11 or None,
                   timeout=30, what="11 acks applied")
    assert sorted(seen) == list(range(11))
    stats = runner.invoke(app, ["stats", "Jobs", "--json", "--interval", "0.1"], env=env)
    assert stats.exit_code == 0, stats.output
    (row,) = json.loads(stats.stdout)["queues"]
    assert [p["end_offset"] for p in row["partitions"]] == [11], row

    # Without the CA, librdkafka cannot verify the broker's certificate: one line that says
    # so and names the setting, from the CLI and from the SDK.
    untrusting = tmp_path / "untrusting.yaml"
    untrusting.write_text(yaml.safe_dump({
        "bootstrap_servers": servers, "database_url": database_url, "topic_prefix": prefix,
        "kafka": {"security.protocol": "SSL"}}))
    refused = runner.invoke(app, ["stats", "Jobs", "--json"],
                            env={"QLAYER_CONFIG": str(untrusting)})
    assert refused.exit_code == 1
    text = str(refused.exception)
    assert text.count("\n") == 0, text
    assert f"the TLS handshake with Kafka at {servers} failed" in text, text
    assert "certificate" in text, text
    assert "ssl.ca.location" in text, text
    with pytest.raises(KafkaAdapterError, match=r"TLS handshake .* ssl\.ca\.location"):
        QueueConsumer("Jobs", servers, topic_prefix=prefix,
                      kafka_config={"security.protocol": "SSL"}, subscribe_timeout=5).close()
