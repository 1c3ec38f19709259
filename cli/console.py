"""`qlayer console`: the web console (layer/console), served by uvicorn.

Starlette, uvicorn and Jinja2 are imported when the command runs, so `qlayer --help` and the
other commands start without them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from layer_cli.output import BootstrapServers, DatabaseUrl, TopicPrefix, load_settings


def _password(password_file: Path | None) -> str | None:
    if password_file is not None:
        try:
            text = password_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise typer.BadParameter(f"cannot read {password_file}: {exc.strerror}",
                                     param_hint="--password-file") from None
        # A file written by `echo secret > file` ends in a newline that is not the password.
        return text.rstrip("\r\n")
    return os.environ.get("QLAYER_CONSOLE_PASSWORD")


def console(
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on. The default serves this machine only; "
        "anything wider should come with --user.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on.")
                    ] = 8080,
    allow_actions: Annotated[bool, typer.Option(
        "--allow-actions", help="Offer the dead-letter redrive (with a dry run and a "
        "confirmation). Without it the console is read-only and refuses actions (403).")
                             ] = False,
    user: Annotated[str | None, typer.Option(
        "--user", envvar="QLAYER_CONSOLE_USER",
        help="Require HTTP basic auth as this user (with --password-file or "
        "QLAYER_CONSOLE_PASSWORD).")] = None,
    password_file: Annotated[Path | None, typer.Option(
        "--password-file", help="File holding the basic-auth password (one line); default: "
        "the QLAYER_CONSOLE_PASSWORD variable.")] = None,
    sample_interval: Annotated[float, typer.Option(
        "--sample-interval", min=1.0, help="Seconds between two samplings of every queue: "
        "the figures the queue list and the overview show, and the charts' resolution.")
                               ] = 15.0,
    window: Annotated[float, typer.Option(
        "--window", min=60.0, help="Seconds the charts reach back.")] = 3600.0,
    history_retention: Annotated[float, typer.Option(
        "--history-retention", min=60.0, help="Seconds the samples stay in PostgreSQL "
        "(at least --window); older ones are deleted by the console.")] = 86400.0,
    refresh: Annotated[float, typer.Option(
        "--refresh", min=0.0, help="Seconds between two live refreshes of an open page's "
        "figures (0: only on reload).")] = 5.0,
    bootstrap_servers: BootstrapServers = None,
    database_url: DatabaseUrl = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """A web console: an overview, the queues (searchable, sortable, paged, with rates and
    charts), a queue's entries, consumers, leases and dead letters, one message with its
    events, coordinators and shards. Ctrl-C stops it.

    Read-only unless started with --allow-actions. The charts come from samples the console
    takes every --sample-interval and keeps in PostgreSQL for --history-retention, so they
    survive a restart (`qlayer db upgrade` adds their table).
    """
    password = _password(password_file)
    if (user is None) != (password is None):
        raise typer.BadParameter(
            "basic auth needs both a user (--user or QLAYER_CONSOLE_USER) and a password "
            "(--password-file or QLAYER_CONSOLE_PASSWORD)", param_hint="--user")
    if password == "":
        raise typer.BadParameter("the password is empty", param_hint="--password-file")
    settings = load_settings(database_url, bootstrap_servers, topic_prefix)

    import uvicorn  # the web server and the app's libraries: only when the console runs

    from layer.console.app import ConsoleOptions, ConsoleState, create_app

    if history_retention < window:
        raise typer.BadParameter(f"--history-retention ({history_retention:g}s) must be at "
                                 f"least --window ({window:g}s)",
                                 param_hint="--history-retention")
    options = ConsoleOptions(allow_actions=allow_actions, user=user, password=password,
                             sample_interval=sample_interval, window=window,
                             history_retention=history_retention, refresh=refresh)
    app = create_app(ConsoleState(settings, options))
    where = f"http://{host if ':' not in host else f'[{host}]'}:{port}/"
    mode = "actions allowed" if allow_actions else "read-only"
    auth = f", basic auth as {user}" if user else ""
    typer.echo(f"qlayer console on {where} ({mode}{auth}); Ctrl-C stops it", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
