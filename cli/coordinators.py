"""`qlayer coordinators`: the coordinator processes, their shards, epochs and lag."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import typer

from layer_cli.output import (
    DatabaseUrl,
    JsonOut,
    age_text,
    emit_json,
    iso_or_none,
    load_settings,
    new_table,
    show,
)

if TYPE_CHECKING:  # SQLAlchemy and the store: loaded by the command (`qlayer --help` stays quick)
    from layer.services.coordinators import CoordinatorStatus


def _document(status: CoordinatorStatus) -> dict[str, Any]:
    return {
        "shard_count": status.shard_count,
        "processes": [{"owner_id": p.owner_id, "host": p.host, "pid": p.pid,
                       "started_at": iso_or_none(p.started_at),
                       "seen_at": iso_or_none(p.seen_at), "live": status.live(p),
                       "shards": list(p.shards)} for p in status.processes],
        "shards": [{"shard": s.shard, "owner_id": s.owner_id, "epoch": s.epoch,
                    "queues": s.queues, "lag": s.lag,
                    "reported_at": iso_or_none(s.reported_at), "running": s.running,
                    "parts": list(s.parts)}
                   for s in status.shards],
        "unowned_shards": [s.shard for s in status.unowned],
    }


def coordinators(json_out: JsonOut = False, database_url: DatabaseUrl = None) -> None:
    """Coordinator processes and the shards each runs: epoch, queues, lag, last report.

    Every process reports every 2 seconds; one silent for 10 seconds is shown as such (a
    killed process's shards move to the others after the group's session timeout).
    """
    settings = load_settings(database_url, None, None)
    from layer.services.coordinators import coordinator_status
    from layer.store.store import Store

    with Store(settings.database_url) as store:
        status = coordinator_status(store, time.time())
    if json_out:
        emit_json(_document(status))
        return
    processes = new_table("process", "host", "pid", "shards", "last seen",
                          title=f"coordinator processes ({status.shard_count} shards)")
    for p in status.processes:
        seen = age_text(status.now - p.seen_at) + ("" if status.live(p) else " (silent)")
        processes.add_row(p.owner_id, p.host, str(p.pid),
                          ",".join(map(str, p.shards)) or "none (standby)", seen)
    with_parts = any(s.parts for s in status.shards)
    shards = new_table("shard", "owner", "epoch", "queues", "lag", "reported",
                       *(("parts",) if with_parts else ()), title="shards")
    for s in status.shards:
        if s.owner_id is None and not s.queues:
            continue
        owner = s.owner_id or "-"
        if s.owner_id is not None and not s.running:
            owner += " (not running)"
        shards.add_row(str(s.shard), owner, "-" if s.epoch is None else str(s.epoch),
                       str(s.queues), "-" if s.lag is None else str(s.lag),
                       "-" if s.reported_at is None else age_text(status.now - s.reported_at),
                       *((", ".join(s.parts) or "-",) if with_parts else ()))
    show(processes, shards)
    warning = unowned_warning(status)
    if warning:
        typer.echo(warning, err=True)


def unowned_warning(status: CoordinatorStatus) -> str | None:
    """The warning `qlayer coordinators` and `qlayer stats` print while queues go unserved."""
    if not status.unowned:
        return None
    return (f"warning: shards {[s.shard for s in status.unowned]} hold queues and no running "
            "coordinator runs them; their queues are not served: start `qlayer coordinator "
            "run` (see `qlayer coordinators`)")
