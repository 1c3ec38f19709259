"""What each console page shows, gathered from the services the CLI uses (SQL stays in
`layer/store`, Kafka in `layer/kafka`). The templates only lay it out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from markupsafe import Markup

from layer.console.history import CHARTED_RATES, TOTALS, History, svg_chart
from layer.domain.errors import QlayerError

if TYPE_CHECKING:
    from layer.console.state import ConsoleState
    from layer.services.coordinators import CoordinatorStatus
    from layer.services.views import QueueStats

__all__ = ["PAGE_ROWS", "Overview", "charts_of", "overview", "queue_details"]

#: How many active entries and dead letters a queue's page lists.
PAGE_ROWS = 50
#: How many queues the overview names in each of its "top" lists.
TOP = 10


def charts_of(history: History, queue: str, *, now: float, window: float, width: int = 240,
              height: int = 48) -> dict[str, Markup]:
    """The depth chart and the charted rates of one queue (or of the totals)."""
    label = "all queues" if queue == TOTALS else queue
    charts = {"depth": Markup(svg_chart(history.depth_series(queue), now=now, window=window,
                                        label=f"{label} depth", width=width, height=height))}
    for name in CHARTED_RATES:
        charts[name] = Markup(svg_chart(history.rate_series(queue, name), now=now,
                                        window=window, label=f"{label} {name} per second",
                                        width=width, height=height))
    return charts


@dataclass(frozen=True)
class Overview:
    queues: int
    depth: int
    leased: int
    consumers: int
    counters: dict[str, int]
    rates: dict[str, float] | None
    charts: dict[str, Markup]
    deepest: list[QueueStats]
    oldest: list[QueueStats]
    problems: list[QueueStats]
    coordinators: CoordinatorStatus | None
    coordinator_problem: str | None
    sampled_at: float

    @property
    def live_processes(self) -> int:
        if self.coordinators is None:
            return 0
        status = self.coordinators
        return sum(1 for p in status.processes if status.live(p))

    @property
    def healthy(self) -> bool:
        return (self.coordinator_problem is None and self.coordinators is not None
                and not self.coordinators.unowned and self.live_processes > 0)


def overview(state: ConsoleState) -> Overview:
    """The installation at a glance, from the latest sampling and the coordinators' reports."""
    from layer.services.coordinators import coordinator_status
    from layer.store.store import Store

    found, at = state.current()
    now = state.clock()
    options = state.options
    with state.lock:
        charts = charts_of(state.history, TOTALS, now=now, window=options.window, width=480,
                           height=96)
        rates = state.history.latest_rates(TOTALS, CHARTED_RATES)
    counters = dict.fromkeys(CHARTED_RATES, 0)
    for s in found:
        for name in CHARTED_RATES:
            counters[name] += s.counters.get(name, 0)
    status: CoordinatorStatus | None = None
    problem: str | None = None
    try:
        with Store(state.settings.database_url) as store:
            status = coordinator_status(store, now)
    except QlayerError as exc:
        problem = str(exc)
    waiting = [s for s in found if s.oldest_available_age is not None]
    return Overview(
        queues=len(found), depth=sum(s.depth for s in found),
        leased=sum(s.leased for s in found), consumers=sum(s.consumers for s in found),
        counters=counters, rates=rates, charts=charts,
        deepest=sorted((s for s in found if s.depth),
                       key=lambda s: (-s.depth, s.queue))[:TOP],
        oldest=sorted(waiting, key=lambda s: (-(s.oldest_available_age or 0.0), s.queue))[:TOP],
        problems=[s for s in found if s.problem], coordinators=status,
        coordinator_problem=problem, sampled_at=at)


def queue_details(state: ConsoleState, name: str) -> dict[str, Any]:
    """Everything a queue's page shows; ``UnknownQueueError`` when there is no such queue."""
    from layer.services.consumers import ConsumerService
    from layer.services.messages import list_dead_letters
    from layer.services.queues import QueueService
    from layer.services.views import queue_stats, view_queue
    from layer.store.store import Store

    settings = state.settings
    state.load_history()  # a console just started charts what an earlier one sampled
    now = state.clock()
    with QueueService.from_settings(settings) as service:
        description = service.describe(name)
    stats = queue_stats(settings, [name], now=now)[0]
    problems: list[str] = []
    entries: list[Any] = []
    try:
        entries = view_queue(settings, name, now=now, limit=PAGE_ROWS)
    except QlayerError as exc:  # e.g. a stored definition that no longer validates
        problems.append(f"active entries: {exc}")
    with ConsumerService.from_settings(settings) as consumer_service:
        attached = consumer_service.list_consumers(name)
    with Store(settings.database_url) as store:
        leased = [r for r in store.load_entries(name) if r.state == "LEASED"]
    leases: dict[str, list[Any]] = {}
    for row in sorted(leased, key=lambda r: (r.topic, r.partition, r.offset)):
        leases.setdefault(row.lease_consumer or "-", []).append(row)
    try:
        letters = list_dead_letters(settings, name, limit=PAGE_ROWS)
    except QlayerError as exc:
        letters = None
        problems.append(f"dead letters: {exc}")
    with state.lock:
        charts = charts_of(state.history, name, now=now, window=state.options.window)
    return {"description": description, "stats": stats, "entries": entries,
            "consumers": attached, "leases": leases, "letters": letters, "now": now,
            "problems": problems, "charts": charts, "charted": CHARTED_RATES}
