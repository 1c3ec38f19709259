"""`qlayer view QUEUE`: the queue's AVAILABLE entries, read-only (nothing is leased)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from layer_cli.messages import payload_json, payload_text
from layer_cli.output import (
    BootstrapServers,
    DatabaseUrl,
    JsonOut,
    TopicPrefix,
    emit_json,
    iso_or_none,
    load_settings,
    new_table,
    show,
)

_PREVIEW = 70


def view(
    queue: Annotated[str, typer.Argument(help="The queue to look into.")],
    filter: Annotated[str | None, typer.Option(
        "--filter", help="Only entries whose payload matches this expression.")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="Show at most this many.")
                     ] = 20,
    json_out: JsonOut = False,
    bootstrap_servers: BootstrapServers = None,
    database_url: DatabaseUrl = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """The AVAILABLE entries in delivery order. Read-only: leases nothing, acks nothing.

    Computed from the stored state (recovery points, entries) and the journals, so a decision
    the coordinator took in the last moment may not show yet; delayed entries are left out.
    """
    settings = load_settings(database_url, bootstrap_servers, topic_prefix)
    from layer.services.views import view_queue  # SQLAlchemy, Kafka: only when it runs

    entries = view_queue(settings, queue, now=time.time(), filter=filter, limit=limit)
    if json_out:
        emit_json({"queue": queue, "entries": [{
            "bookmark": e.bookmark, "key": payload_json(e.key), "value": payload_json(e.value),
            "timestamp": iso_or_none(e.timestamp_ms / 1000), "delivery_count": e.delivery_count,
            "priority": e.priority} for e in entries]})
        return
    has_priority = any(e.priority is not None for e in entries)
    columns = ["bookmark", "deliveries", "published", "key", "value"]
    if has_priority:
        columns.insert(1, "priority")
    table = new_table(*columns, title=f"{queue}: {len(entries)} available entr"
                      f"{'y' if len(entries) == 1 else 'ies'} shown")
    for e in entries:
        value = payload_text(e.value)
        if len(value) > _PREVIEW:
            value = value[: _PREVIEW - 1] + "…"
        row = [e.bookmark, str(e.delivery_count), iso_or_none(e.timestamp_ms / 1000) or "-",
               payload_text(e.key), value]
        if has_priority:
            row.insert(1, "-" if e.priority is None else f"{e.priority:g}")
        table.add_row(*row)
    show(table)
