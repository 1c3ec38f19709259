"""What `qlayer queue describe` prints: the definition, the state, each part of a queue of
several parts, the journal partitions and the consumers (text, or the `--json` document)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from layer_cli.output import iso_or_none, new_table, show, time_text, value_text

if TYPE_CHECKING:
    from layer.services.queues import Placement, QueueDescription

__all__ = ["describe_json", "print_describe"]


def describe_json(d: QueueDescription) -> dict[str, Any]:
    counters = None
    if d.counters is not None:
        counters = {k: v for k, v in asdict(d.counters).items() if k not in ("queue",
                                                                            "updated_at")}
    return {
        "name": d.record.name,
        "version": d.record.version,
        "created_at": iso_or_none(d.record.created_at),
        "updated_at": iso_or_none(d.record.updated_at),
        "purge_requested_at": iso_or_none(d.record.purge_requested_at),
        "purged_at": iso_or_none(d.record.purged_at),
        "purge_pending": d.record.purge_pending,
        "purge_filter": d.record.purge_filter,
        "purge_acked": d.record.purge_acked,
        "reset_to": d.record.reset_to,
        "reset_requested_at": iso_or_none(d.record.reset_requested_at),
        "reset_done_at": iso_or_none(d.record.reset_done_at),
        "reset_pending": d.record.reset_pending,
        "positions_from": d.record.positions_from,
        "definition": d.definition,
        "shard": d.record.shard,
        "owner": _placement_json(d.placement),
        "parts": [{"part": part.part, "shard": part.placement.shard,
                   "owner": _placement_json(part.placement),
                   "partitions": [p.partition for p in part.partitions],
                   "journal_backlog": part.journal_backlog} for part in d.parts],
        "counters": counters,
        "journal_backlog": d.journal_backlog,
        "partitions": [{"topic": p.topic, "partition": p.partition,
                        "recovery_point": p.recovery_point, "end_offset": p.end_offset,
                        "backlog": p.backlog} for p in d.partitions],
        "consumers": [{"consumer_id": c.consumer_id, "session_id": c.session_id,
                       "queue": c.queue, "is_regex": c.is_regex,
                       "max_backlog": c.max_backlog, "filter": c.filter,
                       "delivery_topic": c.delivery_topic,
                       "last_heartbeat_at": iso_or_none(c.last_heartbeat_at)}
                      for c in d.consumers],
        "kafka_problem": d.kafka_problem,
        "definition_problem": d.definition_problem,
    }


def _placement_json(p: Placement | None) -> dict[str, Any] | None:
    """The process running the queue's (or a part's) shard: None when no process holds it."""
    if p is None or p.owner_id is None:
        return None
    return {"owner_id": p.owner_id, "epoch": p.epoch, "host": p.host, "pid": p.pid,
            "running": p.running}


def _placement_text(p: Placement | None) -> str:
    if p is None or p.owner_id is None:
        return "no coordinator holds the shard: the queue is not served"
    where = f" on {p.host} pid {p.pid}" if p.host is not None else ""
    state = "" if p.running else " (silent: not reporting; the group moves the shard)"
    return f"{p.owner_id}{where}, epoch {p.epoch}{state}"


def print_describe(d: QueueDescription) -> None:
    record = d.record
    definition = new_table("field", "value", title=f"queue {record.name} "
                           f"(version {record.version})")
    for field, value in d.definition.items():
        definition.add_row(field, value_text(field, value))
    state = new_table("figure", "value", title="state")
    if d.parts:
        for part in d.parts:
            backlog = part.journal_backlog
            state.add_row(f"part {part.part}", (
                f"shard {part.placement.shard}, partitions "
                f"{', '.join(str(p.partition) for p in part.partitions) or 'none yet'}"
                f"{'' if backlog is None else f', backlog {backlog}'}: "
                f"{_placement_text(part.placement)}"))
    else:
        state.add_row("shard", str(record.shard))
        state.add_row("served by", _placement_text(d.placement))
    state.add_row("created", time_text(record.created_at))
    state.add_row("updated", time_text(record.updated_at))
    if record.purge_requested_at is not None:
        what = "purge" if record.purge_filter is None else f"ack {record.purge_filter}"
        acked = "" if record.purge_acked is None else f", {record.purge_acked} acked"
        state.add_row(what, "pending" if record.purge_pending
                      else f"done {time_text(record.purged_at)}{acked}")
    if record.reset_requested_at is not None and record.reset_to is not None:
        state.add_row(f"reset to {record.reset_to}", "pending" if record.reset_pending
                      else f"done {time_text(record.reset_done_at)}")
    backlog = d.journal_backlog
    state.add_row("journal backlog", "-" if backlog is None else str(backlog))
    if d.counters is not None:
        for k, v in asdict(d.counters).items():
            if k not in ("queue", "updated_at"):
                state.add_row(k.replace("_", " "), str(v))
    partitions = new_table("journal", "partition", "recovery point", "end offset", "backlog",
                           title="journal partitions")
    for p in d.partitions:
        partitions.add_row(p.topic, str(p.partition), _opt(p.recovery_point),
                           _opt(p.end_offset), _opt(p.backlog))
    renderables: list[Any] = [definition, state]
    if d.partitions:
        renderables.append(partitions)
    elif d.kafka_problem is None:
        renderables.append(f"no journal matches {d.definition.get('underlying_topic')} yet")
    if d.consumers:
        consumers = new_table("consumer", "subscribed as", "max backlog", "filter",
                              title="consumers")
        for c in d.consumers:
            consumers.add_row(c.consumer_id, c.queue + (" (regex)" if c.is_regex else ""),
                              _opt(c.max_backlog), c.filter or "-")
        renderables.append(consumers)
    else:
        renderables.append("no consumers attached")
    if d.kafka_problem:
        renderables.append(f"[yellow]journal offsets unavailable: {d.kafka_problem}[/]")
    if d.counters is not None and d.counters.journal_deleted:
        renderables.append(
            f"[yellow]a journal partition was deleted while the queue read it: "
            f"{d.counters.journal_deleted} entries expired (reason journal_deleted); "
            f"the coordinator log names the partitions[/]")
    if d.definition_problem:
        renderables.append(
            f"[red]not served: the stored definition is invalid: {escape(d.definition_problem)}"
            f"\nfix it with `qlayer queue apply` (a valid definition of {record.name})[/]")
    show(*renderables)


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
