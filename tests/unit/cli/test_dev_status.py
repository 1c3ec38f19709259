"""`qlayer dev status` warns before the local broker runs out of open files."""

from __future__ import annotations

import json
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layer_cli.main import app

runner = CliRunner()


@pytest.fixture
def broker_with_100_files(tmp_path: Path) -> Iterator[Path]:
    """A state dir whose 'broker' is a process allowed 100 open files."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    stand_in = subprocess.Popen(
        ["sleep", "300"],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard)))
    kafka = tmp_path / "kafka"
    (kafka / "data").mkdir(parents=True)
    (kafka / "kafka.pid").write_text(f"{stand_in.pid}\n")
    yield tmp_path
    stand_in.kill()
    stand_in.wait()


def status(state: Path, *extra: str) -> str:
    # Ports nothing listens on: only the data and the process's limits are read.
    return runner.invoke(app, ["dev", "status", "--state-dir", str(state), "--kafka-port", "1",
                               "--postgres-port", "2", *extra]).output


def test_the_partition_count_and_the_limit_are_shown(broker_with_100_files: Path) -> None:
    for n in range(3):
        (broker_with_100_files / "kafka" / "data" / f"Work-{n}").mkdir()
    [kafka, _] = json.loads(status(broker_with_100_files, "--json"))
    assert (kafka["partitions"], kafka["open_file_limit"]) == (3, 100)
    assert "3 partitions" in status(broker_with_100_files)
    assert "near its limit" not in status(broker_with_100_files)


def test_a_broker_near_its_open_file_limit_is_warned_about(broker_with_100_files: Path) -> None:
    for n in range(71):
        (broker_with_100_files / "kafka" / "data" / f"Work-{n}").mkdir()
    text = " ".join(status(broker_with_100_files).split())
    assert "Kafka holds 71 partitions, near its limit of 100 open files" in text
    assert "qlayer dev down --wipe" in text


def test_a_broker_process_that_does_not_listen_yet_is_starting(
        broker_with_100_files: Path) -> None:
    """Its process lives (a broker loading thousands of partitions' logs listens only after),
    so "stopped" would send the user to start a second one."""
    [kafka, postgres] = json.loads(status(broker_with_100_files, "--json"))
    assert (kafka["state"], kafka["running"]) == ("starting", False)
    assert postgres["state"] == "stopped"
    assert "starting" in status(broker_with_100_files)
