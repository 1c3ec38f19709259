from __future__ import annotations

import pytest

from layer.protocol import Codec


@pytest.fixture(scope="session")
def codec() -> Codec:
    return Codec()
