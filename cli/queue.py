"""`qlayer queue apply | create | list | describe | delete | purge | ack | reset | move`."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml

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
    time_text,
    value_text,
)
from layer_cli.queue_describe import describe_json, print_describe

# layer.services loads SQLAlchemy, the Kafka client and the domain models: the commands import
# what they use when they run, so `qlayer --help` and the other commands start without them.
if TYPE_CHECKING:
    from layer.services.queues import (
        AckResult,
        ApplyResult,
        QueueChange,
        QueueService,
        ResetResult,
    )

app = typer.Typer(help="Define, inspect, delete, purge, acknowledge and reset queues.",
                  no_args_is_help=True)

_MARKS = {"create": "+", "change": "~", "delete": "-", "unchanged": "="}


def _service(database_url: str | None, bootstrap_servers: str | None = None,
              topic_prefix: str | None = None) -> QueueService:
    from layer.services.queues import QueueService

    return QueueService.from_settings(load_settings(database_url, bootstrap_servers,
                                                    topic_prefix))


# --- apply ---------------------------------------------------------------------------------------


@app.command()
def apply(
    file: Annotated[Path, typer.Option(
        "--file", "-f", help="YAML queue file ('-' reads stdin)", allow_dash=True)],
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print what would change; change nothing.")] = False,
    prune: Annotated[bool, typer.Option(
        "--prune/--no-prune", help="Also delete the stored queues the file does not name (the "
        "file is then the whole truth). Off by default: without it, apply only creates and "
        "changes, so a file never deletes queues it does not know about.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Delete queues even while consumers are attached.")] = False,
    database_url: DatabaseUrl = None,
    json_out: JsonOut = False,
) -> None:
    """Make the stored queues match a queue file: create and change (and with --prune, delete).

    The whole file is validated first; on any problem nothing is changed. An identical
    definition keeps its version, so applying the same file twice changes nothing.
    """
    if str(file) == "-":
        text, source = sys.stdin.read(), "<stdin>"
    else:
        try:
            text, source = file.read_text(), str(file)
        except OSError as exc:
            raise typer.BadParameter(f"cannot read {file}: {exc.strerror}",
                                     param_hint="--file") from None
    with _service(database_url) as service:
        result = service.apply(text, source=source, prune=prune, dry_run=dry_run, force=force)
    if json_out:
        emit_json(_apply_json(result))
    else:
        _print_apply(result)


def _apply_json(result: ApplyResult) -> dict[str, Any]:
    return {
        "dry_run": result.dry_run,
        "prune": result.plan.prune,
        "changed": result.plan.has_changes,
        "refused": {name: sorted(ids) for name, ids in sorted(result.refused.items())},
        "kept": list(result.plan.kept),
        "queues": [
            {
                "name": change.name,
                "action": change.action,
                "version_before": change.version,
                "version_after": result.versions.get(change.name),
                "fields": [asdict(f) for f in change.fields],
            }
            for change in result.plan.changes
        ],
    }


def _print_apply(result: ApplyResult) -> None:
    for change in result.plan.changes:
        typer.echo(_change_line(change, result))
        for f in change.fields:
            typer.echo(f"    {f.field}: {value_text(f.field, f.old)} -> "
                       f"{value_text(f.field, f.new)}")
    counts = {action: len(result.plan.of(action))
              for action in ("create", "change", "delete")}
    summary = ", ".join(f"{n} to {action}" for action, n in counts.items() if n)
    if not result.plan.has_changes:
        typer.echo("no changes: the stored queues match the file")
    elif result.dry_run:
        typer.echo(f"dry run: {summary}; nothing was changed")
        if result.refused:
            listed = "; ".join(f"{name}: {', '.join(sorted(ids))}"
                               for name, ids in sorted(result.refused.items()))
            typer.echo(f"the apply would be refused: consumers are attached ({listed}); stop "
                       "or evict them (`qlayer consumers evict ID`) or apply with --force")
    else:
        done = {"create": "created", "change": "changed", "delete": "deleted"}
        typer.echo("applied: " + ", ".join(f"{n} {done[action]}"
                                          for action, n in counts.items() if n))
    if result.plan.kept:
        kept = result.plan.kept
        names = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        typer.echo(f"kept {len(kept)} stored queue(s) the file does not name ({names}); "
                   "--prune would delete them")


def _change_line(change: QueueChange, result: ApplyResult) -> str:
    mark = _MARKS[change.action]
    after = result.versions.get(change.name)
    if change.action == "create":
        version = "" if result.dry_run else f" (version {after})"
        return f"{mark} create {change.name}{version}"
    if change.action == "change":
        version = f"version {change.version}" + ("" if result.dry_run else f" -> {after}")
        return f"{mark} change {change.name} ({version})"
    if change.action == "delete":
        attached = result.refused.get(change.name)
        refused = f": refused, consumers attached ({', '.join(sorted(attached))})" \
            if attached else ""
        return f"{mark} delete {change.name} (version {change.version}){refused}"
    return f"{mark} unchanged {change.name} (version {change.version})"


# --- create --------------------------------------------------------------------------------------


def _parse_sets(pairs: list[str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{pair!r} is not field=value (e.g. leasing=permissive)",
                                     param_hint="--set")
        try:
            # YAML scalars, as in a queue file: `key_groups=true`, `max_deliveries=3`.
            values[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            values[key.strip()] = raw
    return values


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="Queue name (also its journal by default).")],
    underlying_topic: Annotated[str | None, typer.Option(
        help="Journal name or regex the queue reads [default: NAME]")] = None,
    semantics: Annotated[str | None, typer.Option(
        help="at-least-once (default) or at-most-once")] = None,
    lease_period: Annotated[str | None, typer.Option(help="e.g. 30s, 5m [default: 5m]")] = None,
    max_deliveries: Annotated[int | None, typer.Option(help="0 = unlimited")] = None,
    max_cancels: Annotated[int | None, typer.Option(help="0 = unlimited")] = None,
    expiration: Annotated[str | None, typer.Option(help="e.g. 1h [default: never]")] = None,
    max_backlog: Annotated[int | None, typer.Option(
        "--max-backlog", help="max_per_subscription_backlog [default: 10]")] = None,
    fairness: Annotated[str | None, typer.Option(
        help="fast, round-robin or proportional")] = None,
    priority: Annotated[str | None, typer.Option(help="Priority expression")] = None,
    barrier: Annotated[str | None, typer.Option(
        "--barrier", help="barrier_expression")] = None,
    target_queue_depth: Annotated[int | None, typer.Option()] = None,
    filter: Annotated[str | None, typer.Option(help="Enqueue filter expression")] = None,
    dead_letter_topic: Annotated[str | None, typer.Option()] = None,
    default_publish_target: Annotated[str | None, typer.Option()] = None,
    leasing: Annotated[str | None, typer.Option(help="strict or permissive")] = None,
    recovery_point: Annotated[str | None, typer.Option(
        help="beginning, end or an ISO-8601 timestamp with offset")] = None,
    key_groups: Annotated[bool, typer.Option(
        "--key-groups", help="At most one leased entry per record key")] = False,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Any field as field=value (repeatable), e.g. "
        "--set 'redelivery_backoff={initial: 1s}'")] = None,
    database_url: DatabaseUrl = None,
    json_out: JsonOut = False,
) -> None:
    """Create one queue from flags (for many, or to change one, use `queue apply`)."""
    flags: dict[str, object] = {
        "underlying_topic": underlying_topic,
        "semantics": semantics,
        "lease_period": lease_period,
        "max_deliveries": max_deliveries,
        "max_cancels": max_cancels,
        "expiration": expiration,
        "max_per_subscription_backlog": max_backlog,
        "fairness": fairness,
        "priority": priority,
        "barrier_expression": barrier,
        "target_queue_depth": target_queue_depth,
        "filter": filter,
        "dead_letter_topic": dead_letter_topic,
        "default_publish_target": default_publish_target,
        "leasing": leasing,
        "recovery_point": recovery_point,
        "key_groups": key_groups or None,
    }
    values: dict[str, object] = {"name": name}
    values.update({k: v for k, v in flags.items() if v is not None})
    values.update(_parse_sets(set_ or []))
    with _service(database_url) as service:
        definition, version = service.create(values)
    if json_out:
        emit_json({"name": definition.name, "version": version,
                   "definition": definition.model_dump(mode="json")})
    else:
        typer.echo(f"created queue {definition.name} (version {version}); "
                   f"see `qlayer queue describe {definition.name}`")


# --- list / describe -----------------------------------------------------------------------------


@app.command("list")
def list_(database_url: DatabaseUrl = None, json_out: JsonOut = False) -> None:
    """Every queue: name, underlying topic, semantics, version, consumers attached."""
    with _service(database_url) as service:
        summaries = service.list_queues()
    if json_out:
        emit_json([asdict(s) for s in summaries])
        return
    if not summaries:
        typer.echo("no queues; create one with `qlayer queue apply -f FILE` or "
                   "`qlayer queue create NAME`")
        return
    table = new_table("queue", "underlying topic", "semantics", "version", "consumers")
    for s in summaries:
        table.add_row(s.name, s.underlying_topic, s.semantics, str(s.version), str(s.consumers))
    show(table)


@app.command()
def describe(
    name: Annotated[str, typer.Argument(help="Queue name.")],
    database_url: DatabaseUrl = None,
    bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None,
    json_out: JsonOut = False,
) -> None:
    """A queue's definition plus live figures.

    Counters, recovery points, journal backlog (journal end offsets minus recovery points)
    and the consumers attached.
    """
    with _service(database_url, bootstrap_servers, topic_prefix) as service:
        found = service.describe(name)
    if json_out:
        emit_json(describe_json(found))
    else:
        print_describe(found)


# --- delete / purge ------------------------------------------------------------------------------


@app.command()
def delete(
    name: Annotated[str, typer.Argument(help="Queue name.")],
    force: Annotated[bool, typer.Option(
        "--force", help="Delete even while consumers are attached.")] = False,
    database_url: DatabaseUrl = None,
) -> None:
    """Delete a queue and its stored state (its journals are untouched).

    Refuses while consumers are attached, unless --force.
    """
    with _service(database_url) as service:
        version = service.delete(name, force=force)
    typer.echo(f"deleted queue {name} (version {version}); its journals are untouched")


@app.command()
def purge(
    name: Annotated[str, typer.Argument(help="Queue name.")],
    wait: Annotated[bool, typer.Option(
        "--wait", help="Wait until the coordinator has emptied the queue.")] = False,
    timeout: Annotated[float, typer.Option(
        help="Seconds to wait with --wait before giving up (exit 1).")] = 30.0,
    database_url: DatabaseUrl = None,
) -> None:
    """Empty a queue: every entry it holds leaves it, acknowledged by the operator.

    The owning coordinator carries it out within its refresh interval, for every record it has
    read from the journals by then (it reads them as they arrive); later records enter as usual.
    """
    with _service(database_url) as service:
        result = service.purge(name, wait=timeout if wait else None)
    if result.purged_at is not None:
        typer.echo(f"purged queue {name} at {time_text(result.purged_at)}")
    else:
        typer.echo(f"purge of queue {name} requested (version {result.version}); the "
                   "coordinator carries it out shortly (--wait waits for it)")


@app.command()
def ack(
    name: Annotated[str, typer.Argument(help="Queue name.")],
    filter: Annotated[str, typer.Option(
        "--filter", help="Acknowledge the entries whose payload matches this expression "
        "(docs/expressions.md), e.g. \"/status = 'cancelled'\".")],
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Count the matching entries now (a snapshot); acknowledge nothing.")
                       ] = False,
    wait: Annotated[float | None, typer.Option(
        "--wait", min=0, metavar="SECONDS",
        help="Wait up to SECONDS for the coordinator to carry it out (exit 1 if it has not).")
                    ] = None,
    database_url: DatabaseUrl = None,
    bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None,
    json_out: JsonOut = False,
) -> None:
    """Acknowledge the queue's entries that match a filter, leased or not (AMPS: a sow_delete
    with a filter).

    Each leaves the queue with an ACKED event (reason admin); a lease on one ends and its
    holder's late ack is answered DUPLICATE. The owning coordinator carries it out within its
    refresh interval, over the entries it has read by then that are deliverable (not those
    past target_queue_depth); later records enter as usual. --dry-run counts the matching
    entries from the stored state and the journals: a snapshot, which the coordinator's
    answer may differ from by what happens meanwhile.
    """
    with _service(database_url, bootstrap_servers, topic_prefix) as service:
        result = service.ack(name, filter, dry_run=dry_run, wait=wait)
    if json_out:
        emit_json(_ack_json(result))
        return
    if result.matching is not None:
        m = result.matching
        typer.echo(f"dry run: {m.total} entries of queue {name} match {filter} now "
                   f"({m.available} available, {m.leased} leased, {m.delayed} delayed); "
                   "nothing was acknowledged")
        if m.sample:
            typer.echo("    e.g. " + ", ".join(m.sample))
    elif result.done_at is not None:
        count = "" if result.acked is None else f"{result.acked} entries "
        typer.echo(f"acknowledged {count}of queue {name} matching {filter} at "
                   f"{time_text(result.done_at)}")
    else:
        typer.echo(f"ack of queue {name} entries matching {filter} requested (version "
                   f"{result.version}); the coordinator carries it out shortly (--wait "
                   "waits for it)")


def _ack_json(r: AckResult) -> dict[str, Any]:
    m = r.matching
    return {"queue": r.name, "filter": r.filter, "dry_run": r.dry_run, "version": r.version,
            "requested_at": iso_or_none(r.requested_at), "done_at": iso_or_none(r.done_at),
            "acked": r.acked,
            "matching": None if m is None else {
                "total": m.total, "available": m.available, "leased": m.leased,
                "delayed": m.delayed, "sample": list(m.sample)}}


@app.command()
def reset(
    name: Annotated[str, typer.Argument(help="Queue name.")],
    to: Annotated[str, typer.Option(
        "--to", metavar="beginning|end|TIMESTAMP|OFFSETS",
        help="Where the positions go: beginning, end, an ISO-8601 timestamp with an offset, "
        "or PARTITION:OFFSET,... (e.g. 0:120,1:88; TOPIC:PARTITION:OFFSET when the queue "
        "reads several journals; partitions not named keep theirs).")],
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print each partition's position before and after; change nothing.")
                       ] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Reset even while consumers are attached.")] = False,
    wait: Annotated[float | None, typer.Option(
        "--wait", min=0, metavar="SECONDS",
        help="Wait up to SECONDS for the coordinator to carry it out (exit 1 if it has not).")
                    ] = None,
    database_url: DatabaseUrl = None,
    bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None,
    json_out: JsonOut = False,
) -> None:
    """Move a queue's journal positions; the coordinator rebuilds the queue from there.

    Moved forward: the entries before the new position leave the queue, each with an ACKED
    event (reason admin); those after it keep their state (acked stay acked, leases stay).
    Moved back: a replay, as a Kafka consumer-group reset: the entries the partition holds
    are closed the same way and every record from the new position enters the queue again.
    Refused while consumers are attached unless --force. beginning, end and timestamps are
    resolved when the coordinator carries the reset out (the dry run resolves them now).
    """
    with _service(database_url, bootstrap_servers, topic_prefix) as service:
        result = service.reset(name, to, dry_run=dry_run, force=force, wait=wait)
    if json_out:
        emit_json(_reset_json(result))
        return
    for p in result.partitions:
        before = "-" if p.before is None else str(p.before)
        note = ""
        if p.passed:
            note = f"  (up to {p.passed} entries leave)"
        elif p.replayed:
            note = f"  ({p.replayed} records come back)"
        elif p.before == p.after:
            note = "  (unchanged)"
        typer.echo(f"    {p.topic}[{p.partition}]: {before} -> {p.after}{note}")
    if result.dry_run:
        attached = (f"; {len(result.consumers)} consumers attached (the reset needs --force)"
                    if result.consumers else "")
        typer.echo(f"dry run: reset of queue {name} to {result.target} moves "
                   f"{len(result.changes)} of {len(result.partitions)} partitions"
                   f"{attached}; nothing was changed")
    elif result.done_at is not None:
        typer.echo(f"reset queue {name} to {result.target} at {time_text(result.done_at)}")
    else:
        typer.echo(f"reset of queue {name} to {result.target} requested (version "
                   f"{result.version}); the coordinator carries it out shortly (--wait "
                   "waits for it)")


def _reset_json(r: ResetResult) -> dict[str, Any]:
    return {"queue": r.name, "to": r.target, "dry_run": r.dry_run, "version": r.version,
            "requested_at": iso_or_none(r.requested_at), "done_at": iso_or_none(r.done_at),
            "consumers": r.consumers,
            "partitions": [{"topic": p.topic, "partition": p.partition, "before": p.before,
                            "after": p.after, "passed": p.passed, "replayed": p.replayed}
                           for p in r.partitions]}


@app.command()
def move(
    name: Annotated[str, typer.Argument(help="Queue name.")],
    shard: Annotated[int, typer.Option("--shard", min=0, help="The shard to serve it from.")],
    json_out: JsonOut = False,
    database_url: DatabaseUrl = None,
) -> None:
    """Serve a queue from another shard (and so, maybe, another coordinator process).

    Safe while consumers work: the queue's state (leases, positions) goes with it, the old
    shard's coordinator is fenced at once, and consumers' acks and heartbeats sent to the old
    shard are passed on. A `shard:` or `shard_group:` in the queue file moves it too.
    """
    import time

    from layer.services.coordinators import move_queue
    from layer.store.store import Store

    settings = load_settings(database_url)
    with Store(settings.database_url) as store:
        moved = move_queue(store, name, shard, time.time())
    if json_out:
        emit_json({"queue": moved.queue, "from_shard": moved.from_shard,
                   "to_shard": moved.to_shard, "version": moved.version})
    elif moved.from_shard == moved.to_shard:
        typer.echo(f"queue {name} is on shard {shard} already; nothing changed")
    else:
        typer.echo(f"moved queue {name} from shard {moved.from_shard} to shard "
                   f"{moved.to_shard} (version {moved.version}); shard {moved.to_shard}'s "
                   "coordinator serves it within its refresh interval")
