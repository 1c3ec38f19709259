"""The local development stack: one Kafka broker and one PostgreSQL server on loopback."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from layer.localstack.kafka import KafkaConfig, KafkaNode
from layer.localstack.postgres import PostgresConfig, PostgresNode
from layer.localstack.process import LocalStackError


def default_state_dir() -> Path:
    # As root the PostgreSQL server runs as the postgres user, which cannot enter /root.
    if os.geteuid() == 0:
        return Path("/var/lib/qlayer/dev")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "qlayer" / "dev"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qlayer"


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise LocalStackError(f"{name}={raw!r} is not a port number") from exc


@dataclass(frozen=True)
class StackConfig:
    state_dir: Path = field(default_factory=default_state_dir)
    cache_dir: Path = field(default_factory=default_cache_dir)
    host: str = "127.0.0.1"
    kafka_port: int = 9092
    controller_port: int = 9093
    postgres_port: int = 15432
    fast_postgres: bool = False
    #: Start the broker with its SASL_PLAINTEXT (SCRAM-SHA-512) listener and the
    #: StandardAuthorizer as well (docs/security.md); off by default.
    secure: bool = False
    #: The SASL listener's port; None: the broker's port + 2 (the controller has + 1).
    sasl_port: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> StackConfig:
        """Defaults, then QLAYER_DEV_* / QLAYER_CACHE_DIR variables, then explicit overrides."""
        e = os.environ if env is None else env
        values: dict[str, object] = {}
        if e.get("QLAYER_DEV_STATE_DIR"):
            values["state_dir"] = Path(e["QLAYER_DEV_STATE_DIR"])
        if e.get("QLAYER_CACHE_DIR"):
            values["cache_dir"] = Path(e["QLAYER_CACHE_DIR"])
        values["kafka_port"] = _int_env(e, "QLAYER_DEV_KAFKA_PORT", 9092)
        values["controller_port"] = _int_env(
            e, "QLAYER_DEV_CONTROLLER_PORT", int(str(values["kafka_port"])) + 1
        )
        values["postgres_port"] = _int_env(e, "QLAYER_DEV_POSTGRES_PORT", 15432)
        values["secure"] = e.get("QLAYER_DEV_SECURE", "").lower() in ("1", "true", "yes")
        if e.get("QLAYER_DEV_SASL_PORT"):
            values["sasl_port"] = _int_env(e, "QLAYER_DEV_SASL_PORT", 0)
        given = {k: v for k, v in overrides.items() if v is not None}
        if "kafka_port" in given and "controller_port" not in given:
            # The controller listens next to the broker, wherever the broker was moved.
            given["controller_port"] = int(str(given["kafka_port"])) + 1
        values.update(given)
        return cls(**values)  # type: ignore[arg-type]

    def kafka(self) -> KafkaConfig:
        sasl_port = None
        if self.secure:
            sasl_port = self.sasl_port if self.sasl_port is not None else self.kafka_port + 2
        return KafkaConfig(state_dir=self.state_dir, cache_dir=self.cache_dir, host=self.host,
                           port=self.kafka_port, controller_port=self.controller_port,
                           sasl_port=sasl_port)

    def postgres(self) -> PostgresConfig:
        return PostgresConfig(state_dir=self.state_dir, host=self.host, port=self.postgres_port,
                              fast=self.fast_postgres)


@dataclass(frozen=True)
class NodeStatus:
    name: str
    running: bool
    pid: int | None
    endpoint: str

    @property
    def state(self) -> str:
        """running; starting (its process lives but does not listen yet: a broker loading its
        partitions' logs); or stopped."""
        return "running" if self.running else "starting" if self.pid is not None else "stopped"


@dataclass(frozen=True)
class Endpoints:
    bootstrap_servers: str
    database_url: str
    #: The SASL listener of a secured stack (`StackConfig.secure`), else None.
    sasl_bootstrap_servers: str | None = None


class LocalStack:
    """`qlayer dev up | down | status`: idempotent, with one-line actionable errors."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.kafka = KafkaNode(config.kafka())
        self.postgres = PostgresNode(config.postgres())

    def up(self) -> Endpoints:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        database_url = self.postgres.up()
        bootstrap = self.kafka.up()
        return Endpoints(bootstrap_servers=bootstrap, database_url=database_url,
                         sasl_bootstrap_servers=self.kafka.config.sasl_bootstrap_servers)

    def endpoints(self) -> Endpoints:
        return Endpoints(self.kafka.config.bootstrap_servers, self.postgres.config.url,
                         self.kafka.config.sasl_bootstrap_servers)

    def status(self) -> list[NodeStatus]:
        return [
            NodeStatus("kafka", self.kafka.running(), self.kafka.pid(),
                       self.kafka.config.bootstrap_servers),
            NodeStatus("postgres", self.postgres.running(), self.postgres.pid(),
                       self.postgres.config.url),
        ]

    def wipe(self) -> list[str]:
        """Delete both stopped servers' data; returns the names of those that had any."""
        wiped = []
        if self.kafka.wipe():
            wiped.append("kafka")
        if self.postgres.wipe():
            wiped.append("postgres")
        return wiped

    def down(self) -> list[str]:
        """Stop both servers; returns the names of those that were running."""
        stopped = []
        if self.kafka.down():
            stopped.append("kafka")
        if self.postgres.down():
            stopped.append("postgres")
        return stopped
