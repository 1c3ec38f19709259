"""Fencing a consumer's Kafka producer by its transactional.id (exactly-once processing,
protocol 9; `layer.coordinator.fences` says when and why).

Initialising a producer with a transactional.id (Kafka's InitProducerId) aborts any
transaction of that id still open and bumps the id's epoch, so the producer that had it can
write nothing more: a paused consumer that wakes up finds its transaction aborted and its
commit refused (``PRODUCER_FENCED``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from confluent_kafka import Producer

from layer.kafka.errors import KafkaAdapterError, translated
from layer.kafka.logs import logged

__all__ = ["Fencer", "fence_producer"]

K = TypeVar("K")


def fence_producer(config: Mapping[str, Any], transactional_id: str, timeout: float) -> None:
    """Fence ``transactional_id``; raises `KafkaAdapterError` when it could not be done within
    ``timeout`` (the caller tries again: until then the session's leases stay held)."""
    with translated(f"cannot fence transactional id {transactional_id!r}"):
        producer = Producer(logged({**config, "transactional.id": transactional_id,
                                    "client.id": "qlayer-fence"}))
        try:
            producer.init_transactions(timeout)
        finally:
            # Nothing was sent: the client goes without waiting for anything.
            producer.flush(0)


class Fencer(Generic[K]):
    """Fences producers on a thread of its own, each followed by the end (high watermark) of
    one partition: a slow transaction coordinator holds up the sessions it fences, never the
    loop that asks. ``end_offsets`` is an admin client's (thread-safe)."""

    def __init__(self, config: Mapping[str, Any],
                 end_offsets: Callable[[Iterable[tuple[str, int]], float], dict[tuple[str, int],
                                                                                   int]],
                 partition: tuple[str, int], timeout: float, name: str) -> None:
        self._config = dict(config)
        self._end_offsets = end_offsets
        self._partition = partition
        self._timeout = timeout
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._finished: list[tuple[K, int | KafkaAdapterError]] = []

    def submit(self, key: K, transactional_id: str) -> None:
        """Fence ``transactional_id``; ``key`` comes back with the outcome (`finished`)."""
        self._pool.submit(self._make, key, transactional_id)

    def finished(self) -> list[tuple[K, int | KafkaAdapterError]]:
        """The fences made since the last call: the partition's end after each, or why it
        could not be made."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def close(self) -> None:
        """No more fences; one under way finishes on its own (its outcome is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _make(self, key: K, transactional_id: str) -> None:
        outcome: int | KafkaAdapterError
        try:
            fence_producer(self._config, transactional_id, self._timeout)
            outcome = self._end_offsets([self._partition], self._timeout)[self._partition]
        except KafkaAdapterError as exc:
            outcome = exc
        with self._lock:
            self._finished.append((key, outcome))
