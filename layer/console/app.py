"""`qlayer console`: a read-mostly web console over what the `qlayer` commands compute.

Server-rendered (Starlette + Jinja2, inline SVG charts, one vendored stylesheet; no JavaScript
build, nothing from a CDN). Every page reads the same services as the CLI: `qlayer stats`
(`queue_stats`), `qlayer view` (`view_queue`), `qlayer dlq list | redrive`, `qlayer consumers`
and `qlayer coordinators`; SQL stays in `layer/store`. The one action, a redrive of a queue's
dead letters, exists only when the console was started with ``allow_actions``: a confirmation
page with a dry run first, then a POST carrying a per-process CSRF token (and, from a browser,
a same-origin ``Origin``). Endpoints are plain functions: Starlette runs them in its thread
pool, so a slow Kafka read blocks one request, not the server.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from layer.console.history import CHARTED_RATES, History, Sample, svg_chart
from layer.console.security import basic_auth_ok, csrf_token, csrf_token_ok, same_origin
from layer.domain.durations import format_duration
from layer.domain.errors import QlayerError, UnknownQueueError
from layer.settings import Settings

if TYPE_CHECKING:  # the services load SQLAlchemy and the Kafka client: imported where used
    from layer.services.views import QueueStats

__all__ = ["ConsoleOptions", "ConsoleState", "create_app"]

log = logging.getLogger(__name__)

#: How many active entries and dead letters a queue's page lists.
PAGE_ROWS = 50

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ConsoleOptions:
    allow_actions: bool = False
    """Offer and accept the redrive; without it the console is read-only (403 on actions)."""
    user: str | None = None
    password: str | None = None
    """Basic auth on every page when both are set."""
    sample_interval: float = 15.0
    """Seconds between two samples of every queue (the charts' resolution)."""
    window: float = 3600.0
    """How far back the charts reach (kept in memory, lost when the console stops)."""


@dataclass
class ConsoleState:
    """What one console process holds: its settings, options, chart history and secret."""

    settings: Settings
    options: ConsoleOptions
    clock: Callable[[], float] = time.time
    history: History = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def __post_init__(self) -> None:
        self.history = History(self.options.window, min_gap=self.options.sample_interval / 2)

    def sample(self) -> list[QueueStats]:
        """Every queue's figures now (as `qlayer stats` computes them), remembered for the
        charts."""
        from layer.services.views import queue_stats

        now = self.clock()
        found = queue_stats(self.settings, now=now)
        with self.lock:
            for s in found:
                self.history.add(s.queue, Sample(now, s.depth, dict(s.counters)))
            self.history.keep_only(s.queue for s in found)
        return found


class Sampler:
    """Samples every queue each ``interval`` seconds on a daemon thread, so the charts cover the
    time nobody was looking. A failed sample (Kafka or PostgreSQL away) is logged and retried at
    the next tick; the console keeps serving."""

    def __init__(self, state: ConsoleState) -> None:
        self.state = state
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="console-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.state.sample()
            except QlayerError as exc:  # a service away, no schema: one line, the next may do
                log.warning("console: sampling the queues failed (%s); retrying in %ss", exc,
                            self.state.options.sample_interval)
            except Exception:  # anything else is a bug: its traceback, and go on serving
                log.exception("console: sampling the queues failed; retrying in %ss",
                              self.state.options.sample_interval)
            self._stop.wait(self.state.options.sample_interval)


class BasicAuth:
    """HTTP basic auth in front of every route (static files included)."""

    def __init__(self, app: ASGIApp, user: str, password: str) -> None:
        self.app, self.user, self.password = app, user, password

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            raw = headers.get(b"authorization")
            if not basic_auth_ok(None if raw is None else raw.decode("latin-1"),
                                 self.user, self.password):
                response = PlainTextResponse(
                    "authentication required\n", status_code=401,
                    headers={"WWW-Authenticate": 'Basic realm="qlayer console", charset="UTF-8"'})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --- formatting (the pages' filters) -----------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    return format_duration(round(seconds))


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def _payload(value: bytes | None, limit: int = 80) -> str:
    if value is None:
        return "-"
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


#: Definition fields stored in seconds and read as durations (`30s`, `5m`), as `qlayer queue
#: describe` shows them.
_DURATION_FIELDS = frozenset({"lease_period", "expiration", "delivery_delay", "initial",
                              "maximum"})


def _value(value: Any, field: str | None = None) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if field in _DURATION_FIELDS and isinstance(value, int | float):
        return format_duration(float(value))
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_value(v, k)}" for k, v in value.items())
    return str(value)


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("layer.console", "templates"),
                      autoescape=select_autoescape(["html"]))
    env.filters.update(age=_age, when=_when, payload=_payload, value=_value)
    return env


# --- the application ---------------------------------------------------------------------------


def create_app(state: ConsoleState, *, sampler: bool = True) -> Starlette:
    """The console's ASGI app. ``sampler`` starts the background sampling with the app (tests
    of single routes leave it off and sample through the pages)."""
    env = _environment()
    options = state.options

    def page(request: Request, template: str, status_code: int = 200,
             **context: Any) -> HTMLResponse:
        body = env.get_template(template).render(
            request=request, allow_actions=options.allow_actions, path=request.url.path,
            **context)
        return HTMLResponse(body, status_code=status_code)

    def not_found(request: Request, what: str) -> HTMLResponse:
        return page(request, "error.html", 404, title="not found", message=what)

    def read_only(request: Request) -> HTMLResponse:
        return page(request, "error.html", 403, title="read-only",
                    message="this console is read-only: start it with `qlayer console "
                    "--allow-actions` to redrive dead letters")

    def home(request: Request) -> Response:
        return RedirectResponse("/queues", status_code=302)

    def queues(request: Request) -> HTMLResponse:
        found = state.sample()
        now = state.clock()
        window = options.window
        rows = []
        with state.lock:
            for s in found:
                charts = {"depth": Markup(svg_chart(
                    state.history.depth_series(s.queue), now=now, window=window,
                    label=f"{s.queue} depth"))}
                for name in CHARTED_RATES:
                    charts[name] = Markup(svg_chart(
                        state.history.rate_series(s.queue, name), now=now, window=window,
                        label=f"{s.queue} {name} per second"))
                rows.append({"stats": s, "charts": charts,
                             "rates": state.history.latest_rates(s.queue, CHARTED_RATES)})
        return page(request, "queues.html", title="queues", rows=rows, charted=CHARTED_RATES,
                    window=window, interval=options.sample_interval)

    def queue(request: Request) -> HTMLResponse:
        name = request.path_params["name"]
        try:
            details = _queue_details(state, name)
        except UnknownQueueError:
            return not_found(request, f"no queue named {name}")
        return page(request, "queue.html", title=f"queue {name}", name=name, **details)

    def redrive_confirm(request: Request) -> HTMLResponse:
        name = request.path_params["name"]
        if not options.allow_actions:
            return read_only(request)
        from layer.services.messages import redrive

        try:
            dry = redrive(state.settings, name, dry_run=True)
        except UnknownQueueError:
            return not_found(request, f"no queue named {name}")
        return page(request, "redrive.html", title=f"redrive {name}", name=name, result=dry,
                    csrf=csrf_token(state.secret, f"redrive:{name}"))

    async def redrive_run(request: Request) -> HTMLResponse:
        name = request.path_params["name"]
        if not options.allow_actions:
            return read_only(request)
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        given = form.get("csrf", [None])[0]
        if not (csrf_token_ok(state.secret, f"redrive:{name}", given)
                and same_origin(request.headers.get("origin"), request.url.scheme,
                                request.headers.get("host"))):
            return page(request, "error.html", 403, title="refused",
                        message="this form did not come from this console's confirmation "
                        "page (bad or missing token, or another origin): open the queue's "
                        "redrive page again")
        from layer.services.messages import redrive

        try:
            result = await run_in_threadpool(redrive, state.settings, name)
        except UnknownQueueError:
            return not_found(request, f"no queue named {name}")
        log.info("console: redrove %d dead letter(s) of %s", result.moved, name)
        return page(request, "redrive_done.html", title=f"redrove {name}", name=name,
                    result=result)

    def consumers(request: Request) -> HTMLResponse:
        from layer.services.consumers import ConsumerService

        with ConsumerService.from_settings(state.settings) as service:
            found = service.list_consumers()
        return page(request, "consumers.html", title="consumers", consumers=found)

    def coordinators(request: Request) -> HTMLResponse:
        from layer.services.coordinators import coordinator_status
        from layer.services.views import shard_counters
        from layer.store.store import Store

        with Store(state.settings.database_url) as store:
            status = coordinator_status(store, state.clock())
        return page(request, "coordinators.html", title="coordinators and shards",
                    status=status, faults=shard_counters(state.settings))

    def on_error(request: Request, exc: Exception) -> Response:
        # A QlayerError (Kafka away, a bad stored definition) is the operator's to read.
        return page(request, "error.html", 503, title="unavailable", message=str(exc))

    routes = [
        Route("/", home),
        Route("/queues", queues),
        Route("/queues/{name}", queue),
        Route("/queues/{name}/redrive", redrive_confirm, methods=["GET"]),
        Route("/queues/{name}/redrive", redrive_run, methods=["POST"]),
        Route("/consumers", consumers),
        Route("/coordinators", coordinators),
        Mount("/static", StaticFiles(packages=[("layer.console", "static")]), name="static"),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        background = Sampler(state) if sampler else None
        if background is not None:
            background.start()
        try:
            yield
        finally:
            if background is not None:
                background.stop()

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={QlayerError: on_error})
    if options.user is not None and options.password is not None:
        app.add_middleware(BasicAuth, user=options.user, password=options.password)
    return app


def _queue_details(state: ConsoleState, name: str) -> dict[str, Any]:
    """Everything a queue's page shows; ``UnknownQueueError`` when there is no such queue."""
    from layer.services.consumers import ConsumerService
    from layer.services.messages import list_dead_letters
    from layer.services.queues import QueueService
    from layer.services.views import queue_stats, view_queue
    from layer.store.store import Store

    settings = state.settings
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
    return {"description": description, "stats": stats, "entries": entries,
            "consumers": attached, "leases": leases, "letters": letters, "now": now,
            "problems": problems}
