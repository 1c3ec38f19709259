"""`qlayer console`: a read-mostly web console over what the `qlayer` commands compute.

Server-rendered (Starlette + Jinja2, inline SVG charts, one vendored stylesheet and one small
script of our own; no JavaScript build, nothing from a CDN; every page works with scripts
off, the script only refreshes the open page's figures in place). Every page reads the same
services as the CLI: `qlayer stats` (`queue_stats`, sampled in the background by
`layer.console.state`), `qlayer view` (`view_queue`), `qlayer dlq list | redrive`, `qlayer
consumers` and `qlayer coordinators`; SQL stays in `layer/store`. The one action, a redrive of
a queue's dead letters, exists only when the console was started with ``allow_actions``: a
confirmation page with a dry run first, then a POST carrying a per-process CSRF token (and,
from a browser, a same-origin ``Origin``). Endpoints are plain functions: Starlette runs them
in its thread pool, so a slow Kafka read blocks one request, not the server.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from layer.console.history import CHARTED_RATES
from layer.console.listing import SORTS, ListQuery, list_page
from layer.console.pages import charts_of, overview, queue_details
from layer.console.security import basic_auth_ok, csrf_token, csrf_token_ok, same_origin
from layer.console.state import ConsoleOptions, ConsoleState, Sampler
from layer.domain.durations import format_duration
from layer.domain.errors import QlayerError, UnknownQueueError

__all__ = ["ConsoleOptions", "ConsoleState", "create_app"]

log = logging.getLogger(__name__)

#: The header the page script sends to get the page's live part only.
FRAGMENT_HEADER = "x-qlayer-fragment"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


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


def _ms(epoch_ms: int | None) -> str:
    return "-" if epoch_ms is None else _when(epoch_ms / 1000)


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}/s" if value < 100 else f"{value:,.0f}/s"


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
    env.filters.update(age=_age, when=_when, ms=_ms, rate=_rate, payload=_payload,
                       value=_value)
    return env


# --- the application ---------------------------------------------------------------------------


def create_app(state: ConsoleState, *, sampler: bool = True) -> Starlette:
    """The console's ASGI app. ``sampler`` starts the background sampling with the app (tests
    of single routes leave it off; the pages then sample when they find no sampling yet)."""
    env = _environment()
    options = state.options

    def page(request: Request, template: str, status_code: int = 200,
             **context: Any) -> HTMLResponse:
        tmpl = env.get_template(template)
        values = {"request": request, "allow_actions": options.allow_actions,
                  "path": request.url.path, "refresh": options.refresh,
                  "history_problem": state.history_problem, **context}
        if request.headers.get(FRAGMENT_HEADER) == "live" and "live" in tmpl.blocks:
            # The page script's refresh: the live part only, laid out as on the page.
            body = "".join(tmpl.blocks["live"](tmpl.new_context(values)))
        else:
            body = tmpl.render(values)
        return HTMLResponse(body, status_code=status_code,
                            headers={"Cache-Control": "no-store"})

    def not_found(request: Request, what: str) -> HTMLResponse:
        return page(request, "error.html", 404, title="not found", message=what)

    def read_only(request: Request) -> HTMLResponse:
        return page(request, "error.html", 403, title="read-only",
                    message="this console is read-only: start it with `qlayer console "
                    "--allow-actions` to redrive dead letters")

    def home(request: Request) -> HTMLResponse:
        return page(request, "overview.html", title="overview", o=overview(state),
                    now=state.clock(), charted=CHARTED_RATES, window=options.window,
                    interval=options.sample_interval)

    def queues(request: Request) -> HTMLResponse:
        found, at = state.current()
        query = ListQuery.parse(dict(request.query_params))
        listed = list_page(found, query)
        now = state.clock()
        rows = []
        with state.lock:
            for s in listed.rows:
                rows.append({"stats": s, "rates": state.history.latest_rates(s.queue,
                                                                             CHARTED_RATES),
                             "charts": charts_of(state.history, s.queue, now=now,
                                                 window=options.window, width=120,
                                                 height=28)})
        return page(request, "queues.html", title="queues", rows=rows, listed=listed,
                    query=query, sorts=list(SORTS), charted=CHARTED_RATES,
                    window=options.window, interval=options.sample_interval, sampled_at=at,
                    now=now)

    def queue(request: Request) -> HTMLResponse:
        name = request.path_params["name"]
        try:
            details = queue_details(state, name)
        except UnknownQueueError:
            return not_found(request, f"no queue named {name}")
        return page(request, "queue.html", title=f"queue {name}", name=name,
                    window=options.window, **details)

    def message(request: Request) -> HTMLResponse:
        from layer.services.lookup import BadBookmarkError, message_details

        name = request.path_params["name"]
        text = request.path_params["bookmark"]
        try:
            details = message_details(state.settings, name, text)
        except UnknownQueueError:
            return not_found(request, f"no queue named {name}")
        except BadBookmarkError as exc:
            return not_found(request, str(exc))
        return page(request, "message.html", title=f"{name} {text}", name=name, m=details,
                    now=state.clock())

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
        Route("/queues/{name}/messages/{bookmark:path}", message),
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
