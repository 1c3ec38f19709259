"""What an SDK consumer spends decoding a delivery batch, per message: the native decoder
(`native/src/batch.rs`, through `decode_delivery_batch_fields` as the SDK calls it when the
extension is installed) beside the Python reference.

    .venv/bin/python benchmarks/batch_decode.py [--messages 500] [--repetitions 5]

Batches of `--messages` messages of 200 B and 1 KiB, without headers and with 8 headers of
16 bytes (a producer's tracing and routing headers); prints the best of `--repetitions`
passes of 200 decodes each, in µs per message, and the ratio.
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from layer.protocol.batch import (
    _decode_delivery_batch,
    decode_delivery_batch_fields,
    encode_delivery_batch,
    encode_entry,
)

PASSES = 200


def batch(messages: int, size: int, headers: int) -> bytes:
    value = os.urandom(size)
    hdrs = [(f"header-{i}", os.urandom(16)) for i in range(headers)]
    return encode_delivery_batch([
        encode_entry(b"Orders", b"orders-journal", i % 4, 1_000_000 + i,
                     os.urandom(16).hex().encode(), 1_800_000_000_000, 1, False,
                     1_800_000_000_000, b"key", value, hdrs)
        for i in range(messages)])


def best(decode: Callable[[bytes], Any], data: bytes, messages: int, repetitions: int) -> float:
    times = []
    for _ in range(repetitions):
        started = time.perf_counter()
        for _ in range(PASSES):
            decode(data)
        times.append(time.perf_counter() - started)
    return min(times) * 1e6 / (PASSES * messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    print(f"{'payload':>8} {'headers':>7} {'reference µs':>13} {'native µs':>10} {'ratio':>6}")
    for size in (200, 1024):
        for headers in (0, 8):
            data = batch(args.messages, size, headers)
            python = best(_decode_delivery_batch, data, args.messages, args.repetitions)
            native = best(decode_delivery_batch_fields, data, args.messages, args.repetitions)
            print(f"{size:>8} {headers:>7} {python:>13.2f} {native:>10.2f} {python / native:>6.1f}")


if __name__ == "__main__":
    main()
