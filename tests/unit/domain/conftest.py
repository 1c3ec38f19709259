"""Engine tests run against the Python reference engine and the native port: a module opts in
with ``pytestmark = pytest.mark.usefixtures("engine_implementation")``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from layer.domain.native import native_available

from . import engine_helpers


@pytest.fixture(params=["python", "native"])
def engine_implementation(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "native" and not native_available():
        pytest.fail("the qlayer_native extension is not installed: run `make install`")
    engine_helpers.IMPLEMENTATION[0] = request.param
    yield request.param
    engine_helpers.IMPLEMENTATION[0] = "python"
