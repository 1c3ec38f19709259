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

from confluent_kafka import KafkaError

from layer.kafka.records import OutgoingRecord


class DeliveryFailures:
    """The callback for a producer's delivery reports: keeps the failed ones, thread-safe.

    ``warning``, when given, is logged for each failure with the failure's text as its one
    argument (``"record not written: %s"``).
    """

    def __init__(self, log: logging.Logger | None = None, warning: str | None = None, *,
                 keep_too_large: bool = False) -> None:
        # Re-entrant: reports run inside poll()/flush() on the calling thread, and a Ctrl-C
        # handler that flushes may land while this thread holds the lock in take().
        self._lock = threading.RLock()
        self._failures: list[str] = []
        self._log = log
        self._warning = warning
        self.count = 0
        """Failures reported so far, taken or not."""
        # With ``keep_too_large``, records the broker refused as larger than their topic's
        # ``max.message.bytes`` are kept whole (`take_too_large`) instead of failing: the
        # owner decides what they mean (the coordinator sends each message again alone).
        self._keep_too_large = keep_too_large
        self._too_large: list[OutgoingRecord] = []

    def __call__(self, error: Any, message: Any) -> None:
        if error is None:
            return
        if self._keep_too_large and _is_too_large(error):
            with self._lock:
                self._too_large.append(OutgoingRecord(
                    message.topic(), message.value(), message.key(), message.headers() or [],
                    _timestamp(message)))
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

    def take_too_large(self) -> list[OutgoingRecord]:
        """The records refused as too large since the last call (``keep_too_large`` only)."""
        with self._lock:
            found, self._too_large = self._too_large, []
        return found

    def has_too_large(self) -> bool:
        """Whether records refused as too large wait for `take_too_large`."""
        with self._lock:
            return bool(self._too_large)

    def put_back(self, records: list[OutgoingRecord]) -> None:
        """Records taken by `take_too_large` and not dealt with: the next take has them."""
        if records:
            with self._lock:
                self._too_large[:0] = records


def _is_too_large(error: Any) -> bool:
    code = getattr(error, "code", None)
    return callable(code) and code() == KafkaError.MSG_SIZE_TOO_LARGE



def _timestamp(message: Any) -> int | None:
    timestamp: int = message.timestamp()[1]
    return timestamp if timestamp > 0 else None
