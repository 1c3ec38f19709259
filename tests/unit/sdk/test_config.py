"""Where the SDK connects: argument > QLAYER_* environment > config file > default."""

from __future__ import annotations

from pathlib import Path

import pytest

from layer.sdk import ClientConfig
from layer.settings import Settings, SettingsError


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


def test_the_sdk_reads_the_clis_config_file(tmp_path: Path) -> None:
    # One settings file for both (issue 16 item 8): the SDK ignored qlayer.yaml.
    config = tmp_path / "q.yaml"
    config.write_text("bootstrap_servers: file:1\ntopic_prefix: fromfile.\n"
                      "database_url: postgresql://ignored@h/db\n"
                      "kafka:\n  security.protocol: SASL_SSL\n  linger.ms: 5\n")
    resolved = ClientConfig.resolve(env={"QLAYER_CONFIG": str(config)})
    assert resolved.bootstrap_servers == "file:1"
    assert resolved.topics.ack == "fromfile.ack"
    assert resolved.client() == {"bootstrap.servers": "file:1", "security.protocol": "SASL_SSL",
                                 "linger.ms": 5}
    # The CLI's Settings read the same file the same way.
    cli = Settings.load(env={"QLAYER_CONFIG": str(config)})
    assert (cli.bootstrap_servers, cli.topic_prefix) == ("file:1", "fromfile.")


def test_arguments_then_environment_then_file(tmp_path: Path) -> None:
    config = tmp_path / "q.yaml"
    config.write_text("bootstrap_servers: file:1\ntopic_prefix: fromfile.\n"
                      "kafka:\n  security.protocol: SASL_SSL\n")
    env = {"QLAYER_CONFIG": str(config), "QLAYER_BOOTSTRAP_SERVERS": "env:2",
           "QLAYER_KAFKA": '{"sasl.mechanism": "PLAIN"}'}
    from_env = ClientConfig.resolve(env=env)
    assert from_env.bootstrap_servers == "env:2"
    assert from_env.topics.ack == "fromfile.ack"  # not in the environment: the file's
    # QLAYER_KAFKA's properties are merged over the file's (pydantic-settings merges the
    # mappings of its sources), as for the CLI.
    assert dict(from_env.kafka_config) == {"security.protocol": "SASL_SSL",
                                           "sasl.mechanism": "PLAIN"}
    assert Settings.load(env=env).kafka == from_env.kafka_config
    given = ClientConfig.resolve("arg:3", "arg.", kafka_config={"client.id": "me"}, env=env)
    assert (given.bootstrap_servers, given.topics.ack) == ("arg:3", "arg.ack")
    # Properties given in code are merged over the settings' ones.
    assert dict(given.kafka_config) == {"security.protocol": "SASL_SSL",
                                        "sasl.mechanism": "PLAIN", "client.id": "me"}


def test_qlayer_yaml_in_the_working_directory(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qlayer.yaml").write_text("bootstrap_servers: here:1\n")
    assert ClientConfig.resolve(env={}).bootstrap_servers == "here:1"


@pytest.mark.parametrize(("env", "why"), [
    ({"QLAYER_KAFKA": "{bad"}, "QLAYER_KAFKA is not a JSON object of librdkafka properties"),
    ({"QLAYER_CONFIG": "/nonexistent/q.yaml"}, "cannot read config file /nonexistent/q.yaml"),
])
def test_unusable_settings_are_a_settings_error(env: dict[str, str], why: str) -> None:
    with pytest.raises(SettingsError, match=why):
        ClientConfig.resolve(env=env)


def test_a_credential_comes_from_the_environment_or_the_file_and_is_kept_out_of_reprs(
        tmp_path: Path) -> None:
    secret = "alice:q2x8Cw0bJtE7nR5vYk1uLmZpA3sD6fG9hJ2kL4oP7rT"
    from_env = ClientConfig.resolve(env={"QLAYER_CREDENTIAL": secret})
    assert from_env.credential == secret
    assert "q2x8" not in repr(from_env)
    config = tmp_path / "q.yaml"
    config.write_text(f"credential: {secret}\n")
    from_file = ClientConfig.resolve(env={"QLAYER_CONFIG": str(config)})
    assert from_file.credential == secret
    settings = Settings.load(env={"QLAYER_CONFIG": str(config)})
    assert "q2x8" not in repr(settings) and "q2x8" not in settings.model_dump_json()
    assert ClientConfig.resolve(env={}).credential is None


def test_a_malformed_credential_is_refused_before_anything_is_sent() -> None:
    from layer.sdk import NotAuthorizedError, QueueConsumer

    with pytest.raises(NotAuthorizedError, match="credential: a credential is 'PRINCIPAL:SECRET'"):
        # Nothing listens there: the check comes before any connection is made.
        QueueConsumer("Jobs", "127.0.0.1:1", credential="no-separator")


def test_with_a_credential_and_no_id_the_consumer_is_named_after_its_principal() -> None:
    from layer.sdk.consumer import _default_consumer_id

    assert _default_consumer_id("alice").startswith("alice-")
    assert not _default_consumer_id(None).startswith("alice-")
