"""docker/compose.yaml's structure (no Docker engine runs in the tests: this checks the file,
not the containers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from layer.localstack.kafka import KAFKA_VERSION

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    return data


def test_kafka_is_the_local_stacks_version_and_keeps_its_log_in_a_volume() -> None:
    kafka = _compose()["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{KAFKA_VERSION}"
    log_dirs = kafka["environment"]["KAFKA_LOG_DIRS"]
    assert f"kafkadata:{log_dirs}" in kafka["volumes"]
    assert "kafkadata" in _compose()["volumes"]


def test_two_coordinators_with_a_healthcheck() -> None:
    services = _compose()["services"]
    for name in ("coordinator", "coordinator-standby"):
        coordinator = services[name]
        assert coordinator["command"] == ["coordinator", "run"]
        test = coordinator["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        compile(test[3], f"{name} healthcheck", "exec")  # the check's code is Python


def test_the_build_context_leaves_the_venv_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ".venv/" in ignored and ".git/" in ignored
    # ...but keeps what the Dockerfile copies.
    copied = [line.split()[1] for line in (ROOT / "docker" / "Dockerfile").read_text()
              .splitlines() if line.startswith("COPY")]
    for path in copied:
        assert f"{path.rstrip('/')}/" not in ignored and path not in ignored
