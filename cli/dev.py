"""`qlayer dev up | down | status`: a real local Kafka and PostgreSQL, no Docker needed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from layer_cli.output import table_console

if TYPE_CHECKING:  # imported by the commands that run it: `qlayer --help` stays quick
    from layer.localstack import LocalStack

app = typer.Typer(help="Run a local Kafka broker and PostgreSQL server (no Docker needed).",
                  no_args_is_help=True)

StateDir = Annotated[Path | None, typer.Option(
    "--state-dir", help="Where data and logs live [env: QLAYER_DEV_STATE_DIR; "
    "default /var/lib/qlayer/dev as root, else ~/.local/state/qlayer/dev]")]
KafkaPort = Annotated[int | None, typer.Option(
    "--kafka-port", help="Broker port on 127.0.0.1 [env: QLAYER_DEV_KAFKA_PORT; default 9092]; "
    "the controller uses the next port")]
PostgresPort = Annotated[int | None, typer.Option(
    "--postgres-port", help="PostgreSQL port on 127.0.0.1 [env: QLAYER_DEV_POSTGRES_PORT; "
    "default 15432]")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
Secure = Annotated[bool, typer.Option(
    "--secure", help="Also a SASL_PLAINTEXT (SCRAM-SHA-512) listener on the broker's port + 2, "
    "with the StandardAuthorizer and ACLs enforced there (docs/security.md) "
    "[env: QLAYER_DEV_SECURE=1]")]


def _stack(state_dir: Path | None, kafka_port: int | None, postgres_port: int | None,
           secure: bool = False) -> LocalStack:
    overrides: dict[str, object] = {"state_dir": state_dir, "kafka_port": kafka_port,
                                    "postgres_port": postgres_port,
                                    "secure": True if secure else None}
    if kafka_port is not None:
        overrides["controller_port"] = kafka_port + 1
    from layer.localstack import LocalStack, StackConfig

    return LocalStack(StackConfig.from_env(**overrides))


@app.command()
def up(state_dir: StateDir = None, kafka_port: KafkaPort = None,
       postgres_port: PostgresPort = None, secure: Secure = False,
       json_out: JsonOut = False) -> None:
    """Start Kafka and PostgreSQL (idempotent) and print both endpoints.

    The first run fetches the Kafka jars with Maven into ~/.cache/qlayer and, as root on
    Debian without PostgreSQL, installs it with apt-get.
    """
    stack = _stack(state_dir, kafka_port, postgres_port, secure)
    started = time.monotonic()
    endpoints = stack.up()
    took = time.monotonic() - started
    secured = {}
    if endpoints.sasl_bootstrap_servers is not None:
        secured = {"sasl_bootstrap_servers": endpoints.sasl_bootstrap_servers,
                   "sasl_admin_user": "admin",
                   "sasl_admin_password_file": str(stack.kafka.admin_password_file)}
    if json_out:
        typer.echo(json.dumps({"bootstrap_servers": endpoints.bootstrap_servers,
                               "database_url": endpoints.database_url,
                               "state_dir": str(stack.config.state_dir),
                               "seconds": round(took, 2), **secured}))
        return
    typer.echo(f"kafka     {endpoints.bootstrap_servers}")
    if secured:
        typer.echo(f"kafka     {endpoints.sasl_bootstrap_servers} (SASL_PLAINTEXT, "
                   f"SCRAM-SHA-512, ACLs enforced; super user admin, password in "
                   f"{stack.kafka.admin_password_file})")
    typer.echo(f"postgres  {endpoints.database_url}")
    typer.echo(f"ready in {took:.1f}s; data in {stack.config.state_dir}")
    typer.echo(f"use: export QLAYER_BOOTSTRAP_SERVERS={endpoints.bootstrap_servers} "
               f"QLAYER_DATABASE_URL={endpoints.database_url}")


@app.command()
def status(state_dir: StateDir = None, kafka_port: KafkaPort = None,
           postgres_port: PostgresPort = None, json_out: JsonOut = False) -> None:
    """Show whether the local Kafka and PostgreSQL run. Exit status 1 when either is down.

    A server whose process lives but does not listen yet is "starting" (a broker with many
    partitions loads each one's log first).
    """
    stack = _stack(state_dir, kafka_port, postgres_port)
    nodes = stack.status()
    partitions = stack.kafka.partitions()
    limit = stack.kafka.open_file_limit()
    if json_out:
        kafka_data = {"partitions": partitions, "open_file_limit": limit}
        typer.echo(json.dumps([{"name": n.name, "running": n.running, "state": n.state,
                                "pid": n.pid,
                                "endpoint": n.endpoint,
                                **(kafka_data if n.name == "kafka" else {})}
                               for n in nodes]))
    else:
        table = Table("service", "state", "pid", "endpoint", "data")
        for n in nodes:
            color = {"running": "green", "starting": "yellow"}.get(n.state, "red")
            table.add_row(n.name, f"[{color}]{n.state}[/]",
                          str(n.pid or "-"), n.endpoint,
                          f"{partitions:,} partitions" if n.name == "kafka" else "")
        console = table_console()
        console.print(table)
        if limit is not None and partitions > limit * 0.7:
            # Each partition keeps a file open; at the limit the broker stops serving.
            console.print(f"[yellow]Kafka holds {partitions:,} partitions, near its limit of "
                          f"{limit:,} open files: delete topics you no longer need, or start "
                          "empty with `qlayer dev down --wipe` then `qlayer dev up`.[/]")
    if not all(n.running for n in nodes):
        raise typer.Exit(1)


Wipe = Annotated[bool, typer.Option(
    "--wipe", help="Also delete both servers' data (every topic and database); the next "
    "`up` starts empty. Logs are kept as kafka.log.1 and postgres.log.1.")]


@app.command()
def down(state_dir: StateDir = None, kafka_port: KafkaPort = None,
         postgres_port: PostgresPort = None, wipe: Wipe = False) -> None:
    """Stop the local Kafka and PostgreSQL. Data stays in the state directory unless --wipe.

    Every topic holds open files in the broker; one that collected tens of thousands of
    partitions runs out of them and stops (`qlayer dev status` shows the count).
    """
    stack = _stack(state_dir, kafka_port, postgres_port)
    stopped = stack.down()
    typer.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    if wipe:
        wiped = stack.wipe()
        typer.echo(f"wiped: {', '.join(wiped)} (data in {stack.config.state_dir})"
                   if wiped else "no data to wipe")
