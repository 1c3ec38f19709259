"""Hypothesis example counts by tier.

`make test` runs every property and state machine at its full example count. `make check`, the
quick tier run on every change, sets ``QLAYER_HYPOTHESIS_PROFILE=check`` (tests/conftest.py
loads that profile): a test without settings of its own runs 10 examples instead of
Hypothesis's 100, and one that names its count does it through `examples`, a tenth of it.
"""

from __future__ import annotations

import os

__all__ = ["PROFILE_ENV", "QUICK_PROFILE", "examples"]

PROFILE_ENV = "QLAYER_HYPOTHESIS_PROFILE"
QUICK_PROFILE = "check"


def examples(full: int) -> int:
    """``full`` in the whole suite; a tenth of it (at least 10) in the quick tier."""
    if os.environ.get(PROFILE_ENV) == QUICK_PROFILE:
        return max(10, full // 10)
    return full
