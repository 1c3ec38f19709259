"""Session-scoped real services for the integration tests: a Kafka broker and a PostgreSQL server.

See layer/localstack/selection.py for the order of choice. An unavailable service fails the
run; it never skips. Each test gets unique topic names and a fresh database cloned from a
template migrated once per session.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from layer.localstack.process import tail
from layer.localstack.selection import Backend, choose_services, docker_answers

# Session secrets the SDK keeps for restarted consumers (layer/sdk/identity.py) go to a
# directory of this run, not the user's ~/.local/state; child processes inherit it.
os.environ.setdefault("QLAYER_SDK_STATE_DIR", tempfile.mkdtemp(prefix="qlayer-sdk-state-"))

#: The shard count of the tests' databases (QLAYER_TEST_SHARDS overrides it).
TEST_SHARD_COUNT = int(os.environ.get("QLAYER_TEST_SHARDS", "4"))


@pytest.fixture(scope="session")
def services(pytestconfig: pytest.Config) -> Iterator[dict[str, str]]:
    """{'bootstrap_servers': ..., 'admin_database_url': ...} for the session."""
    terminal = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def say(line: str) -> None:
        # Shown in the run's log, past output capture: which real services the suite uses.
        if terminal is None:
            return
        if capture is None:
            terminal.write_line(f"[qlayer services] {line}")
            return
        with capture.global_and_fixture_disabled():
            terminal.write_line(f"[qlayer services] {line}")

    started = time.monotonic()
    choice = choose_services(os.environ, docker_answers())
    found: dict[str, str] = {}
    cleanups: list[Callable[[], object]] = []
    try:
        if Backend.LOCALSTACK in (choice.kafka, choice.postgres):
            from layer.localstack import LocalStack, StackConfig

            state = Path(os.environ.get("QLAYER_TEST_STATE_DIR")
                         or Path(tempfile.gettempdir()) / "qlayer-test-stack")
            config = StackConfig.from_env(
                {}, state_dir=state,
                kafka_port=int(os.environ.get("QLAYER_TEST_KAFKA_PORT", "39092")),
                controller_port=int(os.environ.get("QLAYER_TEST_KAFKA_PORT", "39092")) + 1,
                postgres_port=int(os.environ.get("QLAYER_TEST_POSTGRES_PORT", "35432")),
                fast_postgres=True,
            )
            stack = LocalStack(config)
            was_running = {s.name for s in stack.status() if s.running}
            if choice.postgres == Backend.LOCALSTACK:
                found["admin_database_url"] = stack.postgres.config.url_for("postgres")
                say(f"starting PostgreSQL (local stack, {state}) ...")
                stack.postgres.up()
                say(f"PostgreSQL ready at {found['admin_database_url']} "
                    f"(pid {stack.postgres.pid()})")
                if "postgres" not in was_running and not os.environ.get("QLAYER_TEST_KEEP_STACK"):
                    cleanups.append(stack.postgres.down)
                _watch(pytestconfig, "PostgreSQL", stack.postgres.pid, stack.postgres.log_file)
            if choice.kafka == Backend.LOCALSTACK:
                held = stack.kafka.partitions()
                if "kafka" in was_running and held > KEPT_BROKER_PARTITIONS:
                    say(f"the kept Kafka holds {held:,} partitions; restarting it empty ...")
                    stack.kafka.down()
                    was_running.discard("kafka")
                if "kafka" not in was_running:
                    # A session leaves thousands of topics behind, each holding open files in
                    # the broker. Kept from session to session in the same state directory they
                    # exhausted its open-file limit (a CI run died at ~19,900 partitions), so a
                    # broker the suite starts starts empty.
                    stack.kafka.wipe()
                say("starting Kafka (local stack, KRaft) ...")
                found["bootstrap_servers"] = stack.kafka.up()
                say(f"Kafka ready at {found['bootstrap_servers']} (pid {stack.kafka.pid()})")
                if "kafka" not in was_running and not os.environ.get("QLAYER_TEST_KEEP_STACK"):
                    cleanups.append(stack.kafka.down)
                _watch(pytestconfig, "Kafka", stack.kafka.pid, stack.kafka.log_file,
                       stack.kafka.death_hint)
        if Backend.TESTCONTAINERS in (choice.kafka, choice.postgres):
            if choice.kafka == Backend.TESTCONTAINERS:
                from testcontainers.kafka import KafkaContainer

                kafka = KafkaContainer("apache/kafka:4.1.1").with_kraft()
                kafka.start()
                cleanups.append(kafka.stop)
                found["bootstrap_servers"] = kafka.get_bootstrap_server()
            if choice.postgres == Backend.TESTCONTAINERS:
                from testcontainers.postgres import PostgresContainer

                pg = PostgresContainer("postgres:16", driver="psycopg")
                pg.start()
                cleanups.append(pg.stop)
                found["admin_database_url"] = pg.get_connection_url()
        if choice.kafka == Backend.ENV and choice.bootstrap_servers:
            found["bootstrap_servers"] = choice.bootstrap_servers
        if choice.postgres == Backend.ENV and choice.database_url:
            found["admin_database_url"] = choice.database_url
        say(f"kafka via {choice.kafka} at {found['bootstrap_servers']}, postgres via "
            f"{choice.postgres} at {found['admin_database_url']} "
            f"({time.monotonic() - started:.1f}s)")
        yield found
    finally:
        for cleanup in reversed(cleanups):
            with contextlib.suppress(Exception):
                cleanup()


# A kept test broker (QLAYER_TEST_KEEP_STACK=1) holding more partitions than this is restarted
# empty: a full run adds about 1,700, and the broker dies near its open-file limit.
KEPT_BROKER_PARTITIONS = 8_000

_WATCHED = pytest.StashKey[list[Callable[[], str | None]]]()


def _watch(config: pytest.Config, name: str, pid: Callable[[], int | None], log: Path,
           hint: Callable[[], str] = lambda: "") -> None:
    """After each test, check that a server this session runs is still alive."""
    started = pid()

    def dead() -> str | None:
        if pid() is not None:
            return None
        return (f"the test {name} server (pid {started}) died, so every later test would only "
                f"time out; stopping the run. Last lines of {log}:\n{tail(log)}{hint()}")

    config.stash.setdefault(_WATCHED, []).append(dead)


@pytest.fixture(autouse=True)
def _servers_alive(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for dead in request.config.stash.get(_WATCHED, []):
        problem = dead()
        if problem is not None:
            pytest.exit(problem, returncode=3)


@pytest.fixture(scope="session")
def bootstrap_servers(services: dict[str, str]) -> str:
    return services["bootstrap_servers"]


@pytest.fixture(scope="session")
def admin_database_url(services: dict[str, str]) -> str:
    return services["admin_database_url"]


@pytest.fixture(scope="session")
def databases(admin_database_url: str) -> Iterator[DatabaseFactory]:
    factory = DatabaseFactory(admin_database_url)
    yield factory
    factory.drop_all()


@pytest.fixture
def database_url(databases: DatabaseFactory) -> str:
    """A fresh database migrated to head (cloned from a per-session template)."""
    return databases.migrated()


@pytest.fixture
def empty_database_url(databases: DatabaseFactory) -> str:
    """A fresh database with no schema, for migration tests."""
    return databases.empty()


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Kafka-safe names unique to this test: unique_name('journal') -> 'journal-test_x-1a2b3c4d'."""
    test = re.sub(r"[^a-zA-Z0-9]+", "_", request.node.name)[:40]

    def make(stem: str) -> str:
        return f"{stem}-{test}-{uuid.uuid4().hex[:8]}"

    return make


@pytest.fixture
def create_topic(bootstrap_servers: str) -> Callable[..., str]:
    """Create a topic and wait until it is usable: create_topic(name, partitions=3)."""
    from tests.support.kafka import create_topic as _create

    def make(name: str, partitions: int = 3) -> str:
        _create(bootstrap_servers, name, partitions)
        return name

    return make


class DatabaseFactory:
    """Creates throw-away databases on the session's server; drops them at session end."""

    def __init__(self, admin_url: str) -> None:
        from sqlalchemy.engine import make_url

        self.admin_url = make_url(admin_url)
        self.template: str | None = None
        self.created: list[str] = []

    def _execute(self, sql: str) -> None:
        import psycopg

        u = self.admin_url
        with psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password,
                             dbname=u.database or "postgres", autocommit=True) as conn:
            conn.execute(sql)  # type: ignore[arg-type]

    def _url(self, name: str) -> str:
        return self.admin_url.set(database=name).render_as_string(hide_password=False)

    def _new(self, template: str | None) -> str:
        name = f"qltest_{uuid.uuid4().hex[:12]}"
        tpl = f' TEMPLATE "{template}"' if template else ""
        self._execute(f'CREATE DATABASE "{name}"{tpl}')
        self.created.append(name)
        return name

    def empty(self) -> str:
        return self._url(self._new(None))

    def migrated(self) -> str:
        if self.template is None:
            from layer.store.migrate import upgrade

            name = self._new(None)
            # Four shards, not the default sixteen: each shard of a running coordinator has
            # its own Kafka clients, and most tests start one. The shard tests make their own
            # sixteen-shard databases (tests/integration/coordinator/test_shards.py).
            upgrade(self._url(name), shard_count=TEST_SHARD_COUNT)
            self.template = name
        return self._url(self._new(self.template))

    def drop_all(self) -> None:
        for name in reversed(self.created):
            with contextlib.suppress(Exception):
                self._execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
