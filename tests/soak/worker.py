"""A soak consumer process: `python -m tests.soak.worker OUT QUEUE...`.

One SDK `QueueConsumer` per queue. Each message is *processed* by writing ``queue<TAB>value``
to OUT (flushed) **before** it is acked, as a real consumer must: a SIGKILL between the two
leaves the message recorded and unacked (redelivered under at-least-once, which the soak counts
as a duplicate), never acked and unrecorded (which would look like a lost message). Acks the
coordinator refused (`LeaseLostError`: the lease ended first) are printed and the worker goes
on. Runs until SIGTERM. Exits with status 3 when the SDK raises, after printing why: the soak
counts that as an unplanned exit and starts another worker, as a supervisor would.

Once subscribed it writes each consumer's id to OUT with the suffix ``.ids``
(``queue<TAB>consumer id`` lines): the soak's hostile tenant forges records naming them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType

from layer.sdk import LeaseLostError, NoCoordinatorError, QueueConsumer, UnknownQueueError


def _consumer(queue: str, bootstrap: str, prefix: str) -> QueueConsumer:
    """Retried while no coordinator answers yet (they may be restarting or rebalancing)."""
    deadline = time.monotonic() + 180
    while True:
        try:
            return QueueConsumer(queue, bootstrap, topic_prefix=prefix, max_backlog=50,
                                 subscribe_timeout=20, session_timeout=15)
        except (UnknownQueueError, NoCoordinatorError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main(out_path: str, queues: list[str]) -> int:
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    bootstrap = os.environ["QLAYER_BOOTSTRAP_SERVERS"]
    prefix = os.environ["QLAYER_TOPIC_PREFIX"]
    try:
        consumers = [_consumer(q, bootstrap, prefix) for q in queues]
        # Not in OUT: its lines are what was processed.
        with open(Path(out_path).with_suffix(".ids"), "w", encoding="utf-8") as ids:
            ids.writelines(f"{q}\t{c.consumer_id}\n" for q, c in zip(queues, consumers,
                                                                     strict=True))
        with open(out_path, "a", encoding="utf-8") as out:
            while not stop.is_set():
                for queue, consumer in zip(queues, consumers, strict=True):
                    batch = []
                    for _ in range(200):
                        try:
                            message = consumer.receive(timeout=0.01)
                        except LeaseLostError as exc:
                            # Acks that came too late (the lease had ended, e.g. in a broker
                            # outage): those messages come again. Said, not fatal.
                            print(f"lease lost: {exc}", file=sys.stderr, flush=True)
                            continue
                        if message is None:
                            break
                        batch.append(message)
                        out.write(f"{queue}\t{(message.value or b'').decode()}"
                                  f"\t{time.time():.3f}\n")
                    out.flush()  # recorded (in the kernel: a SIGKILL keeps it) before acked
                    for message in batch:
                        message.ack()
        for consumer in consumers:
            consumer.close()
    except Exception:  # reported to the soak as an unplanned exit
        traceback.print_exc()
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
