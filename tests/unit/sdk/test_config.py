"""Where the SDK connects: argument > QLAYER_* environment > default."""

from __future__ import annotations

from layer.sdk import ClientConfig


def test_defaults() -> None:
    config = ClientConfig.resolve(env={})
    assert config.bootstrap_servers == "127.0.0.1:9092"
    assert config.topics.control == "qlayer.control"
    assert config.client() == {"bootstrap.servers": "127.0.0.1:9092"}


def test_environment_then_arguments() -> None:
    env = {"QLAYER_BOOTSTRAP_SERVERS": "kafka:9092", "QLAYER_TOPIC_PREFIX": "acme."}
    from_env = ClientConfig.resolve(env=env)
    assert (from_env.bootstrap_servers, from_env.topics.ack) == ("kafka:9092", "acme.ack")
    given = ClientConfig.resolve("b:1", "mine-", env=env)
    assert (given.bootstrap_servers, given.topics.ack) == ("b:1", "mine-ack")


def test_kafka_config_reaches_every_client_and_cannot_override_the_sdk() -> None:
    security = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
                "enable.auto.commit": True}
    config = ClientConfig.resolve("b:1", kafka_config=security, env={})
    client = config.client(**{"enable.auto.commit": False})
    assert client["security.protocol"] == "SASL_SSL" and client["sasl.mechanism"] == "PLAIN"
    assert client["enable.auto.commit"] is False


def test_bootstrap_servers_may_come_in_kafka_config() -> None:
    config = ClientConfig.resolve(kafka_config={"bootstrap.servers": "x:1"}, env={})
    assert config.client()["bootstrap.servers"] == "x:1"
    assert ClientConfig.resolve("y:2", kafka_config={"bootstrap.servers": "x:1"},
                                env={}).bootstrap_servers == "y:2"
