"""Lazy re-exports for a package's ``__init__`` (PEP 562).

``from layer.protocol import Codec`` stays the public spelling, but a command that only needs
``layer.protocol.topics`` must not pay for every sibling module (Avro schemas, SQLAlchemy
models, the Kafka client): `qlayer stats` at a thousand queues has a one-second budget, and a
third of it went to imports nobody used (issue 33). The package lists where each name lives;
the module is imported the first time one of its names is asked for.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["exports"]


def exports(package: str, public: Sequence[str], homes: Mapping[str, Sequence[str]]
            ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, from module -> names; every name of
    ``public`` (the package's ``__all__``, kept literal for type checkers) must have a home."""
    where = {name: module for module, names in homes.items() for name in names}
    if sorted(where) != sorted(public):
        raise ImportError(f"{package}: __all__ and its lazy homes differ: "
                          f"{sorted(set(where) ^ set(public))}")

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # later lookups: ordinary attribute reads
        return value

    def dir_() -> list[str]:
        return sorted(set(where) | set(vars(sys.modules[package])))

    return getattr_, dir_
