"""The `qlayer` CLI against the real PostgreSQL (and Kafka): through typer's runner and as
real subprocesses, configured the way an operator configures it (QLAYER_* variables)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from layer.settings import Settings
from layer.store.rows import ConsumerRow
from layer.store.store import Store, WriteBatch
from layer_cli.main import app


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    """Its own database and its own internal-topic prefix per test."""
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qc{uuid.uuid4().hex[:8]}.")


@pytest.fixture
def cli_env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    """QLAYER_* variables for the test's services; no config file is picked up."""
    missing_config = tmp_path / "no-config.yaml"  # an unset QLAYER_CONFIG would read ./qlayer.yaml
    missing_config.write_text("{}\n")
    return {"QLAYER_DATABASE_URL": settings.database_url,
            "QLAYER_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "QLAYER_TOPIC_PREFIX": settings.topic_prefix,
            "QLAYER_CONFIG": str(missing_config)}


@pytest.fixture
def invoke(cli_env: dict[str, str]) -> Callable[..., Result]:
    """`invoke("queue", "list", "--json")` through typer's runner (in this process)."""
    runner = CliRunner()

    def run(*args: str, input: str | None = None) -> Result:
        return runner.invoke(app, list(args), env=cli_env, input=input)

    return run


@dataclass
class Completed:
    code: int
    stdout: str
    stderr: str


@pytest.fixture
def run_cli(cli_env: dict[str, str], tmp_path: Path) -> Callable[..., Completed]:
    """`run_cli("queue", "apply", "-f", path)` as a real process: `python -m layer_cli.main ...`."""

    def run(*args: str, input: str | None = None, timeout: float = 90,
            env: dict[str, str] | None = None) -> Completed:
        env = {**os.environ, **cli_env, **(env or {})}
        done = subprocess.run([sys.executable, "-m", "layer_cli.main", *args], input=input,
                              capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=timeout, check=False)
        return Completed(done.returncode, done.stdout, done.stderr)

    return run


@pytest.fixture
def queue_file(tmp_path: Path) -> Callable[[str], Path]:
    def write(text: str) -> Path:
        path = tmp_path / f"queues-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(text)
        return path

    return write


def stored(settings: Settings) -> dict[str, tuple[int, dict[str, object]]]:
    """Every live queue as the store has it: name -> (version, definition)."""
    with Store(settings.database_url) as store:
        return {r.name: (r.version, dict(r.definition)) for r in store.list_queues()}


def attach_consumer(settings: Settings, consumer_id: str, queue: str, *,
                    is_regex: bool = False, max_backlog: int | None = None,
                    filter: str | None = None, heartbeat_age: float = 1.0) -> None:
    """Record a subscription the way the coordinator does (a guarded batch), without one
    running: what `qlayer consumers` and `queue delete` read."""
    now = time.time()
    with Store(settings.database_url) as store:
        epoch = store.take_shard("cli-tests", "cli-tests", now)
        assert epoch is not None
        batch = WriteBatch()
        batch.put_consumer(ConsumerRow(
            consumer_id=consumer_id, session_id=uuid.uuid4().hex, queue=queue,
            is_regex=is_regex, delivery_topic=f"{settings.topic_prefix}delivery.{consumer_id}",
            session_timeout_ms=30_000, subscribed_at=now - heartbeat_age,
            last_heartbeat_at=now - heartbeat_age, max_backlog=max_backlog, filter=filter))
        store.commit(batch, "cli-tests", "cli-tests", epoch, now)
        store.release("cli-tests", "cli-tests", epoch, now)


@pytest.fixture
def journal(unique_name: Callable[[str], str], create_topic: Callable[..., str]
            ) -> Callable[..., str]:
    """A fresh journal topic: journal("work", partitions=2)."""

    def make(stem: str = "journal", partitions: int = 3) -> str:
        return create_topic(unique_name(stem), partitions)

    return make
