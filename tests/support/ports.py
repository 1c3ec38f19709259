"""Free local ports for the brokers and databases some tests start of their own, reserved.

A port that is only probed (bind, then close) is free for anyone at the next instant: two
sessions of the suite on one machine (two engineers, or CI beside a developer) or two xdist
workers of one run probed the same port and both started a broker on it. Worse, the outage
and soak tests kill their broker and start it again on the same port: while it is down the
port looks free to every other probe. So a port chosen here is also *reserved*: a file lock
per port in ``$TMPDIR/qlayer-test-ports`` (an OS lock, released when the reservation is, or
when its process ends however it ends), and a port whose lock another process holds is never
chosen, whether or not something listens on it.
"""

from __future__ import annotations

import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from filelock import FileLock, Timeout

__all__ = ["PortReservation", "bindable", "reserve_ports"]


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing holds ``port``: a listener, or a client connection's local end.
    (A connect test sees listeners only; an outgoing connection in the ephemeral range can
    hold a port too, and the broker then fails with "Address already in use".)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / "qlayer-test-ports"


@dataclass
class PortReservation:
    """Ports ``first`` .. ``first + count - 1``, held until `release` (or the process ends)."""

    first: int
    count: int
    _locks: list[FileLock] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for lock in self._locks:
            lock.release(force=True)
        self._locks.clear()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def _hold(port: int) -> FileLock | None:
    directory = lock_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # Not a singleton: two reservations in one process must exclude each other too (flock
    # locks belong to the open file, and each FileLock here opens its own).
    lock = FileLock(directory / f"{port}.lock", is_singleton=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return lock


def reserve_ports(first: int, count: int, span: int = 400) -> PortReservation:
    """The first ports p .. p + count - 1 from ``first`` that no other reservation holds and
    nothing is bound to, reserved. Choose ``first`` below Linux's ephemeral range
    (32768-60999), where client connections take no ports."""
    for port in range(first, first + span, count):
        held: list[FileLock] = []
        for p in range(port, port + count):
            lock = _hold(p)
            if lock is None:
                break
            held.append(lock)
        if len(held) == count and all(bindable(p) for p in range(port, port + count)):
            return PortReservation(port, count, held)
        for lock in held:
            lock.release(force=True)
    raise RuntimeError(f"no {count} free ports in {first}..{first + span}")
