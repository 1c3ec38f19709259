"""`qlayer stats [QUEUE]`: depth, leases, consumers, age, counters and rates per queue."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from layer_cli.output import (
    BootstrapServers,
    DatabaseUrl,
    TopicPrefix,
    age_text,
    emit_json,
    load_settings,
    new_table,
    show,
)

# layer.services loads SQLAlchemy, the Kafka client and the domain models: the commands import
# what they use when they run, so `qlayer --help` and the other commands start without them.
if TYPE_CHECKING:
    from layer.kafka.admin import TopicListing
    from layer.services.views import QueueStats
    from layer.settings import Settings
    from layer.store.store import Store

_SHORT = {"enqueued": "enq", "delivered": "deliv", "acked": "ack", "redelivered": "redeliv",
          "rejected": "rejected", "dead_lettered": "dlq", "expired": "expired",
          "unparseable": "not JSON",
          "deletes": "deletes", "malformed_headers": "bad headers",
          "journal_deleted": "journal deleted"}


def _faults(stats: QueueStats) -> str:
    """The journal records read with a fault, e.g. "not JSON 3, deletes 1", or "-"."""
    from layer.services.views import FAULT_COUNTERS

    found = [f"{_SHORT[n]} {stats.counters[n]}" for n in FAULT_COUNTERS if stats.counters.get(n)]
    return ", ".join(found) or "-"


def _sample(settings: Settings, store: Store, queue: str | None,
            previous: dict[str, QueueStats], listing: TopicListing | None = None
            ) -> list[QueueStats]:
    from layer.services.views import queue_stats, rates

    sample = queue_stats(settings, None if queue is None else [queue], now=time.time(),
                         store=store, listing=listing)
    out = []
    for stats in sample:
        before = previous.get(stats.queue)
        out.append(stats if before is None else replace(stats, rates=rates(before, stats)))
    return out


def _document(stats: QueueStats) -> dict[str, Any]:
    return {
        "queue": stats.queue, "depth": stats.depth, "leased": stats.leased,
        "consumers": stats.consumers, "oldest_available_age": stats.oldest_available_age,
        "counters": stats.counters, "rates": stats.rates, "problem": stats.problem,
        "partitions": [{"topic": p.topic, "partition": p.partition,
                        "recovery_point": p.recovery_point, "end_offset": p.end_offset,
                        "lag": p.lag} for p in stats.partitions],
    }


def _tables(sample: list[QueueStats]) -> Group:
    from layer.services.views import RATE_COUNTERS

    with_rates = any(s.rates is not None for s in sample)
    table = new_table("queue", "depth", "leased", "consumers", "oldest",
                      *(f"{_SHORT[n]} (/s)" if with_rates else _SHORT[n]
                        for n in RATE_COUNTERS), "input faults",
                      title="queues")
    lags = new_table("queue", "partition", "recovery point", "end", "lag",
                     title="recovery-point lag")
    for s in sample:
        cells = []
        for name in RATE_COUNTERS:
            rate = "" if s.rates is None else f" ({s.rates[name]:.1f})"
            cells.append(f"{s.counters[name]}{rate}")
        table.add_row(s.queue, str(s.depth), str(s.leased), str(s.consumers),
                      age_text(s.oldest_available_age), *cells, _faults(s))
        for p in s.partitions:
            lags.add_row(s.queue, f"{p.topic}[{p.partition}]", str(p.recovery_point),
                         str(p.end_offset), str(p.lag))
    parts: list[Table | str] = [table]
    if sample and any(s.partitions for s in sample):
        parts.append(lags)
    parts.extend(f"[red]queue {s.queue}: {escape(s.problem)}[/]" for s in sample if s.problem)
    return Group(*parts)


def _shard_counters(settings: Settings, store: Store, queue: str | None
                    ) -> dict[str, dict[str, int]]:
    """The shards' fault counters (none when one queue was asked for: they are not its)."""
    if queue is not None:
        return {}
    from layer.services.views import shard_counters

    return shard_counters(settings, store)


def _refusals(shards: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Refusals by kind, reason and principal, added up over the shards (docs/security.md,
    "What operators see"): the ``refused:`` counters of `layer.coordinator.faults`."""
    from layer.coordinator.faults import split_refusal_key

    totals: dict[tuple[str, str, str], int] = {}
    for counters in shards.values():
        for name, n in counters.items():
            labels = split_refusal_key(name)
            if labels is not None and n:
                totals[labels] = totals.get(labels, 0) + n
    return [{"kind": k, "reason": r, "principal": p, "count": n}
            for (k, r, p), n in sorted(totals.items())]


def _without_refusals(shards: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    from layer.coordinator.faults import REFUSED_PREFIX

    kept = {shard: {k: n for k, n in c.items() if not k.startswith(REFUSED_PREFIX)}
            for shard, c in shards.items()}
    return {shard: c for shard, c in kept.items() if c}


def _shard_table(shards: dict[str, dict[str, int]]) -> Table:
    table = Table(title="shard faults (malformed or refused input, isolated poison input)")
    table.add_column("shard")
    table.add_column("counter")
    table.add_column("total", justify="right")
    for shard, counters in _without_refusals(shards).items():
        for name, n in counters.items():
            table.add_row(escape(shard), escape(name), str(n))
    return table


def _refusal_table(refusals: list[dict[str, Any]]) -> Table:
    table = Table(title="refused (by kind, reason and principal; all shards)")
    for column in ("kind", "reason", "principal"):
        table.add_column(column)
    table.add_column("count", justify="right")
    for r in refusals:
        table.add_row(escape(r["kind"]), escape(r["reason"]), escape(r["principal"]),
                      str(r["count"]))
    return table


def _warn_unowned(store: Store) -> None:
    """Numbers of a shard nobody runs stand still: say so before showing them."""
    from layer.services.coordinators import coordinator_status
    from layer_cli.coordinators import unowned_warning

    warning = unowned_warning(coordinator_status(store, time.time()))
    if warning:
        typer.echo(warning, err=True)


def stats(
    queue: Annotated[str | None, typer.Argument(help="One queue (default: every queue).")
                     ] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh in place until Ctrl-C.")
                     ] = False,
    interval: Annotated[float, typer.Option(
        "--interval", min=0.1, help="With --watch: seconds between two samples (rates are "
        "over it).")] = 2.0,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print one JSON document, for scripts; with --watch one per sample "
        "and line (JSON Lines).")] = False,
    bootstrap_servers: BootstrapServers = None,
    database_url: DatabaseUrl = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """Depth, leases, consumers, oldest age, counters, recovery-point lag; rates with --watch.

    Without --watch, stats answers at once with one sample: the totals and no rates
    ("rates": null in --json). A rate needs two samples of the stored totals --interval apart
    (PostgreSQL keeps the totals, not their history), so it is shown from --watch's second
    sample on; for rates over time, use the coordinator's metrics (docs/operations.md).
    """
    from layer.kafka.admin import KafkaAdmin

    settings = load_settings(database_url, bootstrap_servers, topic_prefix)
    # The broker's topic listing waits on the broker while SQLAlchemy loads and PostgreSQL
    # answers (~0.1 s of a one-second command at a thousand queues).
    listing = KafkaAdmin(settings.kafka_config()).topics_soon()
    from layer.store.store import Store

    # One store for the whole command (and every --watch sample): an engine and its
    # connection are made once, not per question.
    with Store(settings.database_url) as store:
        _report(settings, store, queue, watch=watch, interval=interval, json_out=json_out,
                listing=listing)


def _report(settings: Settings, store: Store, queue: str | None, *, watch: bool,
            interval: float, json_out: bool, listing: TopicListing) -> None:
    _warn_unowned(store)
    sample = _sample(settings, store, queue, {}, listing)
    if json_out and not watch:
        shards = _shard_counters(settings, store, queue)
        emit_json({"queues": [_document(s) for s in sample],
                   "shards": _without_refusals(shards), "refusals": _refusals(shards)})
        return
    if not watch:
        show(_tables(sample))
        shards = _shard_counters(settings, store, queue)
        if _without_refusals(shards):
            show(_shard_table(shards))
        refusals = _refusals(shards)
        if refusals:
            show(_refusal_table(refusals))
        return
    try:
        if json_out:
            # A stream for scripts: one JSON document per line and sample (JSON Lines).
            while True:
                typer.echo(json.dumps({"queues": [_document(s) for s in sample]}))
                time.sleep(interval)
                sample = _sample(settings, store, queue, {s.queue: s for s in sample})
        with Live(_tables(sample), refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                sample = _sample(settings, store, queue, {s.queue: s for s in sample})
                live.update(_tables(sample))
    except KeyboardInterrupt:
        return
