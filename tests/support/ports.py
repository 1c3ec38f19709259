"""Free local ports for the brokers and databases some tests start of their own."""

from __future__ import annotations

import socket


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


def free_ports(first: int, count: int, span: int = 400) -> int:
    """The first port p from ``first`` with p .. p + count - 1 all free. Choose ``first``
    below Linux's ephemeral range (32768-60999), where client connections take no ports."""
    for port in range(first, first + span, count):
        if all(bindable(p) for p in range(port, port + count)):
            return port
    raise RuntimeError(f"no {count} free ports in {first}..{first + span}")
