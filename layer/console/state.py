"""What one console process holds: its options, the last sampling of every queue, the chart
history (kept in PostgreSQL, `layer.store.history`), and the background sampler.

Pages never wait for a sampling of a thousand queues: the queue list and the overview show
the sampler's latest one (taken every ``sample_interval`` seconds, and once at start), and say
how old it is; a queue's own page reads that queue now.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from layer.console.history import CHARTED_RATES, History, Sample
from layer.domain.errors import QlayerError
from layer.settings import Settings

if TYPE_CHECKING:  # the services load SQLAlchemy and the Kafka client: imported where used
    from layer.services.views import QueueStats
    from layer.store.history import ConsoleSamples

__all__ = ["ConsoleOptions", "ConsoleState", "Sampler"]

log = logging.getLogger(__name__)

#: How often old samples are deleted from PostgreSQL (seconds).
_FORGET_EVERY = 60.0


@dataclass(frozen=True, slots=True)
class ConsoleOptions:
    allow_actions: bool = False
    """Offer and accept the redrive; without it the console is read-only (403 on actions)."""
    user: str | None = None
    password: str | None = None
    """Basic auth on every page when both are set."""
    sample_interval: float = 15.0
    """Seconds between two samplings of every queue (the charts' resolution)."""
    window: float = 3600.0
    """How far back the charts reach."""
    history_retention: float = 86400.0
    """How long samples stay in PostgreSQL (at least ``window``)."""
    refresh: float = 5.0
    """Seconds between two live refreshes of an open page (0: none)."""

    def __post_init__(self) -> None:
        if self.sample_interval <= 0 or self.window <= 0 or self.refresh < 0:
            raise ValueError("sample_interval and window must be positive, refresh not negative")
        if self.history_retention < self.window:
            raise ValueError(f"history_retention ({self.history_retention:g}s) must be at "
                             f"least the charts' window ({self.window:g}s)")


@dataclass
class ConsoleState:
    """One console process: settings, options, the last sampling, history and secret."""

    settings: Settings
    options: ConsoleOptions
    clock: Callable[[], float] = time.time
    history: History = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    #: The latest sampling of every queue, and when it was taken.
    latest: list[QueueStats] | None = field(default=None, init=False)
    latest_at: float | None = field(default=None, init=False)
    #: Why the history is not kept in PostgreSQL (the table missing, ...), or None.
    history_problem: str | None = field(default=None, init=False)
    _samples: ConsoleSamples | None = field(default=None, init=False)
    _history_loaded: bool = field(default=False, init=False)
    _forgot_at: float = field(default=0.0, init=False)
    _sampling: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.history = History(self.options.window, min_gap=self.options.sample_interval / 2)

    def _store(self) -> ConsoleSamples:
        if self._samples is None:
            from layer.store.history import ConsoleSamples
            from layer.store.store import Store

            self._samples = ConsoleSamples(Store(self.settings.database_url).engine)
        return self._samples

    def load_history(self) -> None:
        """Read the charts' window back from PostgreSQL (once; a failure leaves the charts
        to start empty, says why on the pages, and is tried again at the next sampling)."""
        if self._history_loaded:
            return
        try:
            rows = self._store().since(self.clock() - self.options.window)
        except QlayerError as exc:
            self._no_history(exc)
            return
        with self.lock:
            self.history.load(
                (r.queue, Sample(r.sampled_at, r.depth, r.counters, r.leased, r.consumers))
                for r in rows)
        self._history_loaded = True
        self.history_problem = None

    def _no_history(self, exc: QlayerError) -> None:
        problem = (f"the chart history is not kept in PostgreSQL ({exc}); run `qlayer db "
                   "upgrade` to add its table: until then the charts start with the console")
        if problem != self.history_problem:
            log.warning("console: %s", problem)
        self.history_problem = problem

    def sample(self) -> list[QueueStats]:
        """Every queue's figures now (as `qlayer stats` computes them): kept as the latest
        sampling and, where they changed, in the history."""
        from layer.services.views import queue_stats
        from layer.store.history import SampleRow

        with self._sampling:  # the sampler and a first page load at once: one sampling
            self.load_history()
            now = self.clock()
            found = queue_stats(self.settings, now=now)
            with self.lock:
                kept = self.history.sampling(now, {
                    s.queue: Sample(now, s.depth,
                                    {name: s.counters.get(name, 0) for name in CHARTED_RATES},
                                    s.leased, s.consumers)
                    for s in found})
                self.latest, self.latest_at = found, now
            if self._history_loaded:
                try:
                    self._store().write([SampleRow(q, s.at, s.depth, s.leased, s.consumers,
                                                   s.counters) for q, s in kept])
                    if now - self._forgot_at >= _FORGET_EVERY:
                        self._store().forget_before(now - self.options.history_retention)
                        self._forgot_at = now
                except QlayerError as exc:
                    self._no_history(exc)
        return found

    def current(self) -> tuple[list[QueueStats], float]:
        """The latest sampling and when it was taken; taken now when there is none yet."""
        with self.lock:
            latest, at = self.latest, self.latest_at
        if latest is None or at is None:
            latest = self.sample()
            with self.lock:
                at = self.latest_at
            assert at is not None
        return latest, at


class Sampler:
    """Samples every queue each ``sample_interval`` seconds on a daemon thread, so the charts
    cover the time nobody was looking. A failed sampling (Kafka or PostgreSQL away) is logged
    and tried again at the next tick; the console keeps serving."""

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
