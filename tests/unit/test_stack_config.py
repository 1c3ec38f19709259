"""Where the local stack listens and keeps its data: defaults, QLAYER_DEV_* and overrides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layer.localstack import KafkaNode, LocalStack, LocalStackError, StackConfig
from layer.localstack.kafka import out_of_files_hint
from layer.localstack.process import tail


def test_moving_the_broker_moves_its_controller_port_too() -> None:
    assert StackConfig.from_env({}).controller_port == 9093
    assert StackConfig.from_env({}, kafka_port=29092).controller_port == 29093
    assert StackConfig.from_env({"QLAYER_DEV_KAFKA_PORT": "19092"}).controller_port == 19093
    explicit = StackConfig.from_env({}, kafka_port=29092, controller_port=30000)
    assert explicit.controller_port == 30000


def test_environment_then_overrides() -> None:
    env = {"QLAYER_DEV_STATE_DIR": "/srv/q", "QLAYER_DEV_POSTGRES_PORT": "5555",
           "QLAYER_CACHE_DIR": "/cache"}
    config = StackConfig.from_env(env)
    assert (config.state_dir, config.postgres_port, config.cache_dir) == (
        Path("/srv/q"), 5555, Path("/cache"))
    assert StackConfig.from_env(env, postgres_port=6666).postgres_port == 6666


def test_a_port_that_is_not_a_number_is_named() -> None:
    with pytest.raises(LocalStackError, match="QLAYER_DEV_KAFKA_PORT='ninety'"):
        StackConfig.from_env({"QLAYER_DEV_KAFKA_PORT": "ninety"})


def _kafka(tmp_path: Path) -> KafkaNode:
    return LocalStack(StackConfig.from_env({}, state_dir=tmp_path)).kafka


def test_partitions_counts_the_partition_directories_only(tmp_path: Path) -> None:
    node = _kafka(tmp_path)
    assert node.partitions() == 0  # no data yet
    for name in ("Work-0", "Work-1", "q.ack-5", "__consumer_offsets-3", "__cluster_metadata-0"):
        (node.data_dir / name).mkdir(parents=True)
    (node.data_dir / "meta.properties").write_text("node.id=1\n")
    (node.data_dir / "bootstrap.checkpoint-x").mkdir()  # not a partition: no number after '-'
    assert node.partitions() == 5


def test_wipe_deletes_the_data_and_keeps_the_log_as_log_1(tmp_path: Path) -> None:
    node = _kafka(tmp_path)
    (node.data_dir / "Work-0").mkdir(parents=True)
    node.log_file.write_text("why the broker stopped\n")
    assert node.wipe() is True
    assert not node.data_dir.exists() and not node.log_file.exists()
    assert (node.dir / "kafka.log.1").read_text() == "why the broker stopped\n"
    assert node.wipe() is False  # nothing left: still fine


def test_wipe_refuses_while_the_server_runs(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig.from_env({}, state_dir=tmp_path))
    (stack.kafka.data_dir / "Work-0").mkdir(parents=True)
    stack.kafka.pid_file.write_text(f"{os.getpid()}\n")  # a live process stands in for it
    with pytest.raises(LocalStackError, match=r"Kafka \(pid \d+\) still runs"):
        stack.wipe()
    assert (stack.kafka.data_dir / "Work-0").exists()
    stack.postgres.data_dir.mkdir(parents=True)
    (stack.postgres.data_dir / "postmaster.pid").write_text(f"{os.getpid()}\n")
    with pytest.raises(LocalStackError, match=r"PostgreSQL \(pid \d+\) still runs"):
        stack.postgres.wipe()


def test_tail_reads_the_end_and_cuts_long_lines(tmp_path: Path) -> None:
    log = tmp_path / "kafka.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)) + "x" * 5_000 + "\nlast\n")
    shown = tail(log, lines=3, width=100).splitlines()
    assert shown == ["line 99999", "x" * 100 + " [...]", "last"]
    assert tail(tmp_path / "missing.log") == ""


def test_a_broker_out_of_open_files_says_how_to_start_it_again() -> None:
    last = ("[2026-11-22 06:56:14,942] ERROR Error while accepting connection\n"
            "java.io.IOException: Too many open files")
    hint = out_of_files_hint(last, 19_871)
    assert "19,871 partitions" in hint and "qlayer dev down --wipe" in hint
    assert out_of_files_hint("ERROR Shutdown broker because all log dirs have failed", 5) == ""


def test_the_hint_finds_the_cause_far_above_the_last_lines(tmp_path: Path) -> None:
    node = _kafka(tmp_path)
    for n in range(3):
        (node.data_dir / f"Work-{n}").mkdir(parents=True)
    # As in the broker's log: the cause, then lists of the failed directory's partitions.
    node.log_file.write_text("java.io.IOException: Too many open files\n"
                             + ("Stopped serving Work-0,Work-1,Work-2 " * 3_000 + "\n") * 20)
    assert "Too many open files" not in tail(node.log_file)
    assert "3 partitions" in node.death_hint()
    node.log_file.write_text("Kafka stopped for another reason\n")
    assert node.death_hint() == ""


def _properties(config: StackConfig) -> dict[str, str]:
    from layer.localstack.kafka import listener_properties

    return dict(line.split("=", 1) for line in listener_properties(config.kafka()))


def test_the_broker_is_unsecured_unless_asked() -> None:
    props = _properties(StackConfig.from_env({}))
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
    assert "authorizer.class.name" not in props and "sasl.enabled.mechanisms" not in props
    assert StackConfig.from_env({}).kafka().sasl_bootstrap_servers is None


def test_a_secured_broker_adds_a_scram_listener_and_denies_what_no_acl_allows() -> None:
    for config in (StackConfig.from_env({"QLAYER_DEV_SECURE": "1"}, kafka_port=42092),
                   StackConfig.from_env({}, kafka_port=42092, secure=True)):
        props = _properties(config)
        assert props["listeners"] == ("PLAINTEXT://127.0.0.1:42092,SASL_PLAINTEXT://127.0.0.1:"
                                      "42094,CONTROLLER://127.0.0.1:42093")
        assert "SASL_PLAINTEXT:SASL_PLAINTEXT" in props["listener.security.protocol.map"]
        assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
        assert props["authorizer.class.name"] == (
            "org.apache.kafka.metadata.authorizer.StandardAuthorizer")
        assert props["allow.everyone.if.no.acl.found"] == "false"
        assert props["super.users"] == "User:ANONYMOUS;User:admin"
        assert config.kafka().sasl_bootstrap_servers == "127.0.0.1:42094"
    moved = StackConfig.from_env({"QLAYER_DEV_SECURE": "1", "QLAYER_DEV_SASL_PORT": "42099"})
    assert moved.kafka().sasl_bootstrap_servers == "127.0.0.1:42099"
