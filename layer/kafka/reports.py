"""Delivery reports of a producer, collected without keeping the producer alive.

librdkafka holds a producer's delivery callback (producer-wide or per record) in C, where
Python's garbage collector cannot see it. A bound method of the object that owns the producer
therefore makes a reference cycle that is never collected: the producer, its librdkafka threads
and its broker connections then outlive the owner, its ``close()`` and its last reference (a
program that opened and closed consumers kept three threads and a connection per consumer). The
callback is this separate object instead, which refers to nothing but its own failures.
"""

from __future__ import annotations

import logging
import threading
from typing import Any


class DeliveryFailures:
    """The callback for a producer's delivery reports: keeps the failed ones, thread-safe.

    ``warning``, when given, is logged for each failure with the failure's text as its one
    argument (``"record not written: %s"``).
    """

    def __init__(self, log: logging.Logger | None = None, warning: str | None = None) -> None:
        # Re-entrant: reports run inside poll()/flush() on the calling thread, and a Ctrl-C
        # handler that flushes may land while this thread holds the lock in take().
        self._lock = threading.RLock()
        self._failures: list[str] = []
        self._log = log
        self._warning = warning
        self.count = 0
        """Failures reported so far, taken or not."""

    def __call__(self, error: Any, message: Any) -> None:
        if error is None:
            return
        text = f"{message.topic()}: {error.str() if hasattr(error, 'str') else error}"
        with self._lock:
            self.count += 1
            self._failures.append(text)
        if self._log is not None and self._warning is not None:
            self._log.warning(self._warning, text)

    def take(self) -> list[str]:
        """The failures reported since the last call."""
        with self._lock:
            found, self._failures = self._failures, []
        return found
