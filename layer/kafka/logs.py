"""librdkafka's own log lines, through Python logging, each said at most once a minute.

librdkafka logs every failed connection attempt, from every client: with the broker away, a
coordinator's dozen clients wrote about a hundred lines a second to stderr (measured: 1,000 to
3,000 lines in a 30 s outage). Given to the clients as their ``logger`` (confluent-kafka then
hands the lines over in ``poll``, on the polling thread), a `ClientLog` passes each line on to
the ``layer.kafka.client`` logger, except one that says again what a line said in the last
``window`` seconds (same facility, same text once the timings in it are left out, whichever
client): that one is counted, and the count is told with the next such line that passes.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ClientLog", "logged"]

# "(after 0ms in state CONNECT, 12 identical error(s) suppressed)", "(after 3971ms in state
# UP)": what differs between two reports of one failure.
_TIMINGS = re.compile(r"\s*\(after \d+ms[^)]*\)")
_KEPT = 1000  # distinct lines remembered; past it they are forgotten (and said again)


class ClientLog:
    """A ``logger`` for confluent-kafka clients that says repeated lines once per window."""

    def __init__(self, logger: logging.Logger | None = None, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger or logging.getLogger("layer.kafka.client")
        self._window = window
        self._clock = clock
        self._lock = threading.Lock()
        # Per line: when it was last said, and how often it came since.
        self._seen: dict[tuple[str, str], list[float]] = {}

    def log(self, level: int, msg: str, *args: object) -> None:
        """What confluent-kafka calls: ``log(level, "%s [%s] %s", facility, client, text)``."""
        if not self._logger.isEnabledFor(level):
            return
        if level <= logging.DEBUG or len(args) != 3:
            # Debugging output someone asked for (the `debug` setting) passes as it is.
            self._logger.log(level, msg, *args)
            return
        facility, client, text = (str(a) for a in args)
        key = (facility, _TIMINGS.sub("", text))
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self._window:
                seen[1] += 1
                return
            repeats = int(seen[1]) if seen is not None else 0
            if len(self._seen) >= _KEPT:
                self._seen.clear()
            self._seen[key] = [now, 0]
        if repeats:
            self._logger.log(level, "%s [%s] %s (and %d more like it in the last %.0fs, "
                             "from this process's Kafka clients)", facility, client, text,
                             repeats, self._window)
        else:
            self._logger.log(level, "%s [%s] %s", facility, client, text)


def logged(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with a `ClientLog` as its ``logger``, unless it names one already: every
    Kafka client qlayer makes (CLI, SDK, services, coordinator) sends librdkafka's lines
    through Python logging (``layer.kafka.client``) instead of writing them to stderr itself.
    The lines reach Python when the client is polled; a client never polled keeps them."""
    out = dict(config)
    out.setdefault("logger", ClientLog())
    return out
