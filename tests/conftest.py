"""Session-scoped real services for the integration tests: a Kafka broker and a PostgreSQL server.

See layer/localstack/selection.py for the order of choice. An unavailable service fails the
run; it never skips. Each test gets unique topic names and a fresh database cloned from a
template migrated once per session.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from filelock import FileLock
from hypothesis import settings as hypothesis_settings

from layer.localstack.process import tail
from layer.localstack.selection import Backend, choose_services, docker_answers
from tests.support.examples import PROFILE_ENV, QUICK_PROFILE
from tests.support.report import report_times
from tests.support.spark import short_lived_spark_jvms

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from layer.localstack import LocalStack

# `make check` (QLAYER_HYPOTHESIS_PROFILE=check): a tenth of the examples
# (tests/support/examples.py); `make test`: Hypothesis's defaults and every test's full count.
# No per-example deadline in either: it is a timing assertion, and six workers on two cores
# made an example that takes 4 ms take 264 ms once (a CI run of stop 42 failed on it). Speed
# is measured in benchmarks/, not asserted in tests.
hypothesis_settings.register_profile("qlayer", deadline=None)
hypothesis_settings.register_profile(QUICK_PROFILE, parent=hypothesis_settings.get_profile(
    "qlayer"), max_examples=10)
hypothesis_settings.load_profile(os.environ.get(PROFILE_ENV) or "qlayer")

#: Names this run (a controller and all its xdist workers): set by the controller (or the one
#: process) before any worker starts, so the workers inherit it.
RUN_ENV = "QLAYER_TEST_RUN"
_SDK_STATE_MADE = "QLAYER_TEST_SDK_STATE_MADE"


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _has_workers(config: pytest.Config) -> bool:
    """True in the controller of an xdist run (it runs no test; its workers do)."""
    return not _is_worker(config) and config.pluginmanager.getplugin("dsession") is not None


def pytest_configure(config: pytest.Config) -> None:
    if _is_worker(config):
        # Session secrets the SDK keeps for restarted consumers (layer/sdk/identity.py) are
        # files named by topic prefix and consumer id: each worker keeps its own, so two tests
        # using one id at once never read each other's.
        worker = str(config.workerinput["workerid"])  # type: ignore[attr-defined]
        os.environ["QLAYER_SDK_STATE_DIR"] = os.path.join(os.environ["QLAYER_SDK_STATE_DIR"],
                                                          worker)
        return
    _check_loadgroup(config)
    os.environ[RUN_ENV] = uuid.uuid4().hex
    # Inherited by the workers and every process a test starts (tests/support/spark.py).
    short_lived_spark_jvms()
    # Session secrets go to a directory of this run, not the user's ~/.local/state; child
    # processes (and xdist workers) inherit it; removed when the run ends.
    if "QLAYER_SDK_STATE_DIR" not in os.environ:
        os.environ["QLAYER_SDK_STATE_DIR"] = tempfile.mkdtemp(prefix="qlayer-sdk-state-")
        os.environ[_SDK_STATE_MADE] = os.environ["QLAYER_SDK_STATE_DIR"]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _is_worker(config):
        return
    made = os.environ.pop(_SDK_STATE_MADE, None)
    if made is not None and os.environ.get("QLAYER_SDK_STATE_DIR") == made:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ["QLAYER_SDK_STATE_DIR"]


# First: xdist's own hook reads the groups (it appends them to the node ids) after this.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share something of their own run on one xdist worker (`--dist loadgroup`):
    the secured broker (one per worker that asks for it, so one in all) and Spark (a JVM and
    a session per worker; one worker runs them all, one session reused)."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        names = getattr(item, "fixturenames", ())
        if "secured" in names:
            item.add_marker(pytest.mark.xdist_group("secured"))
        elif "spark" in names:
            item.add_marker(pytest.mark.xdist_group("spark"))


def _check_loadgroup(config: pytest.Config) -> None:
    """pytest-xdist up to 3.8 cannot group tests under pytest 9 (below): refuse to run so,
    with a message (the workers' own check, below, can only crash them)."""
    if config.getoption("dist", "no") != "loadgroup" or not config.getoption("numprocesses",
                                                                                None):
        return
    from importlib.metadata import version

    xdist = tuple(int(p) for p in version("pytest-xdist").split(".")[:3] if p.isdigit())
    if int(pytest.__version__.split(".")[0]) >= 9 and xdist <= (3, 8, 0):
        raise pytest.UsageError(
            f"pytest-xdist {version('pytest-xdist')} does not group tests (--dist loadgroup) "
            f"under pytest {pytest.__version__}: tests that share a broker of their own would "
            "run on several workers at once. Install the versions pyproject.toml names "
            "(make install), or run without workers (make test WORKERS=0).")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker with `--dist loadgroup`: every test of an `xdist_group` must carry
    its group in its node id (xdist's way of sending a group to one worker). pytest 9 made
    xdist 3.8's renaming a no-op, and the groups were spread silently over the workers: two
    of them started the secured broker in one directory. Better no run than that one."""
    config = session.config
    if not _is_worker(config) or not config.getvalue("loadgroup"):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist's loadgroup does not group tests with this pytest ({pytest.__version__}"
            f"): {lost[0]} and {len(lost) - 1} more have no @group in their node id; install "
            "the versions pyproject.toml names (make install)")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # The shared local stack outlives every worker's session: the controller stops what this
    # run started once all of them are done (without workers the fixture does it).
    if _has_workers(session.config):
        _stop_started(*_test_stack())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _is_worker(terminalreporter.config):
        report_times(terminalreporter)

@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One SparkSession for every pipeline test of a worker (`tests.support.spark`)."""
    from tests.support.spark import shared_session

    session = shared_session()
    yield session
    session.stop()


#: The shard count of the tests' databases (QLAYER_TEST_SHARDS overrides it).
TEST_SHARD_COUNT = int(os.environ.get("QLAYER_TEST_SHARDS", "4"))


@pytest.fixture(scope="session")
def services(pytestconfig: pytest.Config) -> Iterator[dict[str, str]]:
    """{'bootstrap_servers': ..., 'admin_database_url': ...} for the session.

    The local stack is one per run: the first xdist worker that asks starts it (under a file
    lock), the others find it started by their run, and what the run started is stopped once:
    by this fixture without workers, by the controller (`pytest_sessionfinish`) with them."""
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
            state, stack = _test_stack()
            found.update(_local_stack(stack, state, choice, say))
            if not _is_worker(pytestconfig):
                cleanups.append(lambda: _stop_started(state, stack))
            if choice.postgres == Backend.LOCALSTACK:
                _watch(pytestconfig, "PostgreSQL", stack.postgres.pid, stack.postgres.log_file)
            if choice.kafka == Backend.LOCALSTACK:
                _watch(pytestconfig, "Kafka", stack.kafka.pid, stack.kafka.log_file,
                       stack.kafka.death_hint)
        if Backend.TESTCONTAINERS in (choice.kafka, choice.postgres):
            # One set of containers per xdist worker: each is isolated, and Docker (where
            # there is one) starts them in seconds.
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


def _test_stack() -> tuple[Path, LocalStack]:
    """The test stack's state directory and the stack, as the variables choose them."""
    from layer.localstack import LocalStack, StackConfig

    state = Path(os.environ.get("QLAYER_TEST_STATE_DIR")
                 or Path(tempfile.gettempdir()) / "qlayer-test-stack")
    kafka_port = int(os.environ.get("QLAYER_TEST_KAFKA_PORT", "39092"))
    config = StackConfig.from_env(
        {}, state_dir=state, kafka_port=kafka_port, controller_port=kafka_port + 1,
        postgres_port=int(os.environ.get("QLAYER_TEST_POSTGRES_PORT", "35432")),
        fast_postgres=True,
    )
    return state, LocalStack(config)


def _lock(state: Path) -> FileLock:
    state.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(state.parent / f"{state.name}.lock")


#: In the state directory: which run started which of its servers ({"run": id, "started":
#: [...]}), read by the later workers of that run and by whoever stops them.
STARTED_BY = "started-by.json"


def _started(state: Path) -> dict[str, object]:
    try:
        return dict(json.loads((state / STARTED_BY).read_text()))
    except (OSError, ValueError):
        return {}


def _local_stack(stack: LocalStack, state: Path, choice: object,
                 say: Callable[[str], None]) -> dict[str, str]:
    found: dict[str, str] = {}
    run = os.environ.get(RUN_ENV, "")
    keep = bool(os.environ.get("QLAYER_TEST_KEEP_STACK"))
    with _lock(state):
        record = _started(state)
        # The first process of this run to get here decides (starts, wipes, restarts); the
        # other workers of the run take the stack as it left it.
        first = record.get("run") != run
        started: list[str] = [] if first else list(record.get("started", []))  # type: ignore[call-overload]
        was_running = {s.name for s in stack.status() if s.running}
        if getattr(choice, "postgres", None) == Backend.LOCALSTACK:
            found["admin_database_url"] = stack.postgres.config.url_for("postgres")
            say(f"starting PostgreSQL (local stack, {state}) ...")
            stack.postgres.up()
            say(f"PostgreSQL ready at {found['admin_database_url']} "
                f"(pid {stack.postgres.pid()})")
            if first and "postgres" not in was_running and not keep:
                started.append("postgres")
        if getattr(choice, "kafka", None) == Backend.LOCALSTACK:
            if first:
                held = stack.kafka.partitions()
                if "kafka" in was_running and held > KEPT_BROKER_PARTITIONS:
                    say(f"the kept Kafka holds {held:,} partitions; restarting it empty ...")
                    stack.kafka.down()
                    was_running.discard("kafka")
                if "kafka" not in was_running:
                    # A session leaves thousands of topics behind, each holding open files in
                    # the broker. Kept from session to session in the same state directory
                    # they exhausted its open-file limit (a CI run died at ~19,900
                    # partitions), so a broker the suite starts starts empty.
                    stack.kafka.wipe()
            say("starting Kafka (local stack, KRaft) ...")
            found["bootstrap_servers"] = stack.kafka.up()
            say(f"Kafka ready at {found['bootstrap_servers']} (pid {stack.kafka.pid()})")
            if first and "kafka" not in was_running and not keep:
                started.append("kafka")
        state.mkdir(parents=True, exist_ok=True)
        (state / STARTED_BY).write_text(json.dumps({"run": run, "started": started}))
    return found


def _stop_started(state: Path, stack: LocalStack) -> None:
    """Stop the servers this run started (none when another run started them, or none)."""
    with _lock(state):
        record = _started(state)
        if record.get("run") != os.environ.get(RUN_ENV, ""):
            return
        for name in reversed(list(record.get("started", []))):  # type: ignore[call-overload]
            with contextlib.suppress(Exception):
                (stack.kafka if name == "kafka" else stack.postgres).down()
        (state / STARTED_BY).unlink(missing_ok=True)


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
