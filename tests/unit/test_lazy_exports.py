"""The packages that re-export lazily (`layer.lazy`): every public name still resolves, and the
light paths stay light (issue 33: a command's second went a third to imports it never used)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = ["layer.kafka", "layer.protocol", "layer.services"]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_resolves_to_its_home_module(name: str) -> None:
    package = importlib.import_module(name)
    for public in package.__all__:
        value = getattr(package, public)
        assert value is not None
        assert public in dir(package)
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        package.Nope  # noqa: B018


def _loaded_after(statement: str, modules: list[str]) -> dict[str, bool]:
    probe = (f"import sys\n{statement}\n"
             f"print(' '.join(str(m in sys.modules) for m in {modules!r}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.split()
    return dict(zip(modules, (v == "True" for v in out), strict=True))


def test_queue_list_s_service_loads_neither_kafka_nor_the_definition_models() -> None:
    loaded = _loaded_after("import layer.services.queues",
                           ["confluent_kafka", "layer.domain.definitions", "fastavro",
                            "layer.sdk"])
    assert loaded == {"confluent_kafka": False, "layer.domain.definitions": False,
                      "fastavro": False, "layer.sdk": False}


def test_stats_loads_no_sdk_and_no_avro() -> None:
    loaded = _loaded_after("import layer.services.views", ["layer.sdk", "fastavro"])
    assert loaded == {"layer.sdk": False, "fastavro": False}


def test_the_store_loads_no_pydantic() -> None:
    assert _loaded_after("import layer.store.store", ["pydantic"]) == {"pydantic": False}
