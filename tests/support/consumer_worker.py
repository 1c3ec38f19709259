"""A consumer process for the tests: `python -m tests.support.consumer_worker OUT QUEUE...`.

One `QueueConsumer` per queue, all in this process; every message received is acked and
written to OUT as ``queue<TAB>value`` (one line each, flushed), so the test reads what was
received even after this process is gone. Runs until SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType

from layer.sdk import NoCoordinatorError, QueueConsumer, UnknownQueueError


def _consumer(queue: str, bootstrap: str, prefix: str) -> QueueConsumer:
    """Retried while no coordinator answers yet (they may still be joining their group)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return QueueConsumer(queue, bootstrap, topic_prefix=prefix, max_backlog=50,
                                 subscribe_timeout=20)
        except (UnknownQueueError, NoCoordinatorError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main(out_path: str, queues: list[str]) -> None:
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    bootstrap = os.environ["QLAYER_BOOTSTRAP_SERVERS"]
    prefix = os.environ["QLAYER_TOPIC_PREFIX"]
    consumers = [_consumer(q, bootstrap, prefix) for q in queues]
    with open(out_path, "a", encoding="utf-8") as out:
        while not stop.is_set():
            for queue, consumer in zip(queues, consumers, strict=True):
                for _ in range(200):
                    message = consumer.receive(timeout=0.01)
                    if message is None:
                        break
                    message.ack()
                    value = (message.value or b"").decode()
                    out.write(f"{queue}\t{value}\n")
                out.flush()
    for consumer in consumers:
        consumer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
