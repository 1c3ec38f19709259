"""`qlayer dev up | status | down` as real subprocesses, on ports of their own."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from layer.localstack import KafkaConfig, KafkaNode
from layer.localstack.process import pid_alive

# One xdist group (`--dist loadgroup`): its tests share the dev stack's ports, so one
# `qlayer dev up` at a time.
pytestmark = [pytest.mark.acceptance, pytest.mark.xdist_group("dev-cli")]

# Overridable, for a run beside another suite's (the ports are this module's alone). Below
# Linux's ephemeral range (32768-60999), so no client connection's local end can hold one when
# the stack starts again (the outage test's broker once failed to bind 43092 for that).
KAFKA_PORT = int(os.environ.get("QLAYER_TEST_DEV_KAFKA_PORT", "28092"))
POSTGRES_PORT = int(os.environ.get("QLAYER_TEST_DEV_POSTGRES_PORT", "28432"))


def qlayer(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QLAYER_DEV_STATE_DIR": str(state),
           "QLAYER_DEV_KAFKA_PORT": str(KAFKA_PORT),
           "QLAYER_DEV_POSTGRES_PORT": str(POSTGRES_PORT)}
    return subprocess.run([sys.executable, "-m", "layer_cli.main", *args], capture_output=True,
                          text=True, env=env, timeout=300, check=False)


@pytest.fixture
def state() -> Iterator[Path]:
    # Directly under /tmp (pytest's tmp_path is private), so the postgres user can enter it
    # when the suite runs as root.
    path = Path(tempfile.mkdtemp(prefix="qlayer-devstack-"))
    path.chmod(0o755)
    yield path
    qlayer("dev", "down", state=path)
    shutil.rmtree(path, ignore_errors=True)


def test_up_status_down_leave_nothing_running(state: Path) -> None:
    up = qlayer("dev", "up", "--json", state=state)
    assert up.returncode == 0, up.stderr
    endpoints = json.loads(up.stdout)
    assert endpoints["bootstrap_servers"] == f"127.0.0.1:{KAFKA_PORT}"
    assert endpoints["database_url"].endswith(f"@127.0.0.1:{POSTGRES_PORT}/qlayer")

    status = qlayer("dev", "status", "--json", state=state)
    assert status.returncode == 0, status.stderr
    nodes = {n["name"]: n for n in json.loads(status.stdout)}
    assert nodes["kafka"]["running"] and nodes["postgres"]["running"]
    assert nodes["kafka"]["partitions"] >= 1  # at least the cluster's metadata log
    assert nodes["kafka"]["open_file_limit"] >= 1024
    pids = [nodes["kafka"]["pid"], nodes["postgres"]["pid"]]

    # Share groups (KIP-932) are finalized on the freshly formatted cluster.
    node = KafkaNode(KafkaConfig(state_dir=state, cache_dir=Path.home() / ".cache" / "qlayer",
                                 port=KAFKA_PORT, controller_port=KAFKA_PORT + 1))
    assert node.features().get("share.version", 0) >= 1

    # Idempotent: a second `up` finds both running and changes nothing.
    again = qlayer("dev", "up", "--json", state=state)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["bootstrap_servers"] == endpoints["bootstrap_servers"]
    status = qlayer("dev", "status", "--json", state=state)
    assert [n["pid"] for n in json.loads(status.stdout)] == pids

    down = qlayer("dev", "down", state=state)
    assert down.returncode == 0, down.stderr
    assert "kafka" in down.stdout and "postgres" in down.stdout
    assert not any(pid_alive(pid) for pid in pids)
    stopped = qlayer("dev", "status", "--json", state=state)
    assert stopped.returncode == 1
    assert not any(n["running"] for n in json.loads(stopped.stdout))
    assert "nothing was running" in qlayer("dev", "down", state=state).stdout

    # --wipe deletes both servers' data; the logs stay readable as *.log.1.
    wiped = qlayer("dev", "down", "--wipe", state=state)
    assert wiped.returncode == 0, wiped.stderr
    assert "wiped: kafka, postgres" in wiped.stdout
    assert not (state / "kafka" / "data").exists()
    assert not (state / "postgres" / "data").exists()
    assert (state / "kafka" / "kafka.log.1").stat().st_size > 0
    assert "no data to wipe" in qlayer("dev", "down", "--wipe", state=state).stdout


def test_up_with_tls_serves_a_listener_clients_reach_with_the_printed_ca(state: Path) -> None:
    from confluent_kafka.admin import AdminClient

    up = qlayer("dev", "up", "--tls", "--json", state=state)
    assert up.returncode == 0, up.stderr
    endpoints = json.loads(up.stdout)
    assert endpoints["tls_bootstrap_servers"] == f"127.0.0.1:{KAFKA_PORT + 3}"
    ca = Path(endpoints["tls_ca_file"])
    assert ca.read_text().startswith("-----BEGIN CERTIFICATE-----")
    admin = AdminClient({"bootstrap.servers": endpoints["tls_bootstrap_servers"],
                         "security.protocol": "SSL", "ssl.ca.location": str(ca)})
    # A metadata request over TLS, the CA trusted: it raises when the handshake fails.
    assert list(admin.list_topics(timeout=30).brokers) == [1]
    # The text form says where the listener is and which CA its clients trust.
    text = qlayer("dev", "up", "--tls", state=state)
    assert text.returncode == 0, text.stderr
    assert f"127.0.0.1:{KAFKA_PORT + 3} (SSL; clients trust the CA {ca}" in " ".join(
        text.stdout.split())


def test_busy_port_is_a_one_line_error_that_says_what_to_do(state: Path) -> None:
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", POSTGRES_PORT))
        blocker.listen()
        result = qlayer("dev", "up", state=state)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"port 127.0.0.1:{POSTGRES_PORT} is busy" in lines[0]
    assert "QLAYER_DEV_POSTGRES_PORT" in lines[0]
