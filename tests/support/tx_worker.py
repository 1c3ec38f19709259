"""A consume-transform-produce worker for the exactly-once tests:
``python -m tests.support.tx_worker QUEUE OUT CONSUMER_ID STATE_DIR [--plain] [--die-at POINT
--die-chance P]``; bootstrap servers and topic prefix from ``QLAYER_*``.

Each message's result, ``{"n": <the message's value>, "by": CONSUMER_ID}``, goes to OUT and
the message is acked in one Kafka transaction (``--plain``: the result is produced and
flushed, then the message is acked, at-least-once). With ``--die-at`` the process SIGKILLs
itself at that point of a message's processing, with probability ``--die-chance`` per message:
``before-produce``, ``after-produce`` (the result is sent, the transaction not committed) or
``after-commit`` (committed, before the next message); ``anytime``: after a random 1 to 8 s
from its start, wherever it is (in a commit, say; ``--die-chance`` is ignored). Runs until
SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from types import FrameType

from confluent_kafka import Producer

from layer.sdk import (
    LeaseLostError,
    Message,
    NoCoordinatorError,
    QueueConsumer,
    SessionEndedError,
    TransactionAbortedError,
    UnknownQueueError,
)

POINTS = ("before-produce", "after-produce", "after-commit", "anytime")


def _consumer(args: argparse.Namespace) -> QueueConsumer:
    """Retried while no coordinator answers yet (it may be starting or taking over)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return QueueConsumer(args.queue, os.environ["QLAYER_BOOTSTRAP_SERVERS"],
                                 topic_prefix=os.environ["QLAYER_TOPIC_PREFIX"],
                                 consumer_id=args.consumer_id, state_dir=args.state_dir,
                                 max_backlog=5, session_timeout=6.0, subscribe_timeout=20,
                                 transactional=not args.plain)
        except (UnknownQueueError, NoCoordinatorError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _maybe_die(args: argparse.Namespace, point: str, dice: random.Random) -> None:
    if args.die_at == point and dice.random() < args.die_chance:
        os.kill(os.getpid(), signal.SIGKILL)


def _result(args: argparse.Namespace, message: Message) -> bytes:
    return json.dumps({"n": int(message.value or b"-1"), "by": args.consumer_id}).encode()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("queue")
    parser.add_argument("out")
    parser.add_argument("consumer_id")
    parser.add_argument("state_dir")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--die-at", choices=POINTS)
    parser.add_argument("--die-chance", type=float, default=0.0)
    args = parser.parse_args()
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    dice = random.Random()
    if args.die_at == "anytime":
        timer = threading.Timer(dice.uniform(1.0, 8.0), os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
    consumer = _consumer(args)
    plain = (Producer({"bootstrap.servers": os.environ["QLAYER_BOOTSTRAP_SERVERS"],
                       "enable.idempotence": True}) if args.plain else None)
    while not stop.is_set():
        try:
            message = consumer.receive(timeout=0.2)
            if message is None:
                continue
            _maybe_die(args, "before-produce", dice)
            if plain is not None:
                plain.produce(args.out, _result(args, message), key=message.key)
                plain.flush(30)
                _maybe_die(args, "after-produce", dice)
                message.ack()
            else:
                with consumer.transaction() as tx:
                    tx.produce(args.out, _result(args, message), key=message.key)
                    _maybe_die(args, "after-produce", dice)
                    tx.ack(message)
            _maybe_die(args, "after-commit", dice)
        except (TransactionAbortedError, LeaseLostError) as exc:
            # The session's leases ended (a lease ran out, a takeover): the message goes to
            # another worker; this one goes on with its next session.
            print(f"{args.consumer_id}: {exc}", flush=True)
        except (SessionEndedError, NoCoordinatorError) as exc:
            print(f"{args.consumer_id}: {exc}; subscribing again", flush=True)
            consumer.close()
            consumer = _consumer(args)
    consumer.close()


if __name__ == "__main__":
    main()
