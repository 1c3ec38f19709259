"""The demo's crashing consumer: takes leases, never settles them, and waits to be SIGKILLed.

Run as its own process (``python -m layer.demo.crash``) so that the demo can kill it for real:
no ``close()``, no Unsubscribe, no more heartbeats. Its leases break when the coordinator sees
its session time out, and the entries go to other consumers. It prints one JSON line per
event on stdout: ``{"subscribed": true}``, then ``{"bookmark": ..., "id": ...}`` per message.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from layer.sdk import NoCoordinatorError, QueueConsumer, UnknownQueueError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topic-prefix", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--consumer-id", required=True)
    parser.add_argument("--max-backlog", type=int, required=True)
    parser.add_argument("--session-timeout", type=float, required=True)
    parser.add_argument("--kafka-config", type=json.loads, default={},
                        help="librdkafka properties as a JSON object (security settings)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + 20
    consumer: QueueConsumer | None = None
    while consumer is None:
        try:
            consumer = QueueConsumer(args.queue, args.bootstrap_servers,
                                     topic_prefix=args.topic_prefix,
                                     consumer_id=args.consumer_id, max_backlog=args.max_backlog,
                                     session_timeout=args.session_timeout,
                                     kafka_config=args.kafka_config)
        except (UnknownQueueError, NoCoordinatorError):
            # A coordinator that was already running picks new queues up within seconds.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    print(json.dumps({"subscribed": True}), flush=True)
    while True:
        msg = consumer.receive(timeout=0.5)
        if msg is None:
            continue
        print(json.dumps({"bookmark": str(msg.bookmark), "id": msg.json()["id"]}), flush=True)
        # Never settled: the process is killed while it holds the lease.


if __name__ == "__main__":
    main(sys.argv[1:])
