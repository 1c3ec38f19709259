"""The suite's own local stack, as `make test` runs it: pytest sessions as real subprocesses.

A broker the suite starts must start empty (topics kept from earlier sessions once exhausted the
broker's open files and killed it four minutes into a CI run), and a server that dies must end
the run at once instead of letting every later test time out (that CI run took 58 minutes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import reserve_ports

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]
# The child's broker and its controller take two ports from here on, below Linux's ephemeral
# range: a fixed 49192 inside it was once held by some client connection's local end, and the
# child's broker failed to start ("Address already in use").
KAFKA_PORTS_FROM = 29_492

CHILD_TESTS = '''
import os
import signal
import time
from pathlib import Path

from confluent_kafka.admin import AdminClient, NewTopic

from layer.localstack.process import pid_alive

STEP = os.environ["CHILD_STEP"]
STATE = Path(os.environ["QLAYER_TEST_STATE_DIR"])


def topics(bootstrap_servers):
    return set(AdminClient({"bootstrap.servers": bootstrap_servers}).list_topics(timeout=30).topics)


def test_first(bootstrap_servers):
    if STEP == "leave":
        admin = AdminClient({"bootstrap.servers": bootstrap_servers})
        admin.create_topics([NewTopic("left-behind", 1, 1)])["left-behind"].result(30)
        assert "left-behind" in topics(bootstrap_servers)
        return
    print("TOPICS", sorted(t for t in topics(bootstrap_servers) if not t.startswith("__")))
    pid = int((STATE / "kafka" / "kafka.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    while pid_alive(pid):
        time.sleep(0.1)


def test_second():
    (STATE / f"second-ran-{STEP}").write_text("yes")
'''


@pytest.fixture
def state() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="qlayer-test-stack-child-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def child_session(step: str, state: Path, tests: Path, database_url: str,
                  kafka_port: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("QLAYER_TEST_BOOTSTRAP_SERVERS", "QLAYER_TEST_KEEP_STACK")}
    # The child's PostgreSQL is this session's; its Kafka is a local stack of its own.
    env.update(CHILD_STEP=step, QLAYER_TEST_STATE_DIR=str(state),
               QLAYER_TEST_KAFKA_PORT=str(kafka_port), QLAYER_TEST_BACKEND="localstack",
               QLAYER_TEST_DATABASE_URL=database_url)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), "-s", "-q", str(tests)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False)


def test_a_started_broker_is_empty_and_a_dead_one_ends_the_run(
        state: Path, tmp_path: Path, admin_database_url: str,
        request: pytest.FixtureRequest) -> None:
    tests = tmp_path / "test_child.py"
    tests.write_text(CHILD_TESTS)

    # Reserved for the whole test: the child's broker is down between its two sessions.
    reserved = reserve_ports(KAFKA_PORTS_FROM, 2)
    request.addfinalizer(reserved.release)
    kafka_port = reserved.first
    first = child_session("leave", state, tests, admin_database_url, kafka_port)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "2 passed" in first.stdout
    assert (state / "kafka" / "data").exists()  # the broker stopped; its topics stayed on disk

    second = child_session("kill", state, tests, admin_database_url, kafka_port)
    out = second.stdout + second.stderr
    # The topic the first session left is gone: the broker started empty.
    assert "TOPICS []" in out, out[-3000:]
    # The killed broker ended the run after the test that killed it, with its log's last lines.
    assert second.returncode == 3, out[-3000:]
    assert "the test Kafka server" in out and "died" in out
    assert f"Last lines of {state / 'kafka' / 'kafka.log'}" in out
    assert (state / "second-ran-leave").exists()
    assert not (state / "second-ran-kill").exists()
