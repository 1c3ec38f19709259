"""Where the local stack listens and keeps its data: defaults, QLAYER_DEV_* and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from layer.localstack import LocalStackError, StackConfig


def test_moving_the_broker_moves_its_controller_port_too() -> None:
    assert StackConfig.from_env({}).controller_port == 9093
    assert StackConfig.from_env({}, kafka_port=29092).controller_port == 29093
    assert StackConfig.from_env({"QLAYER_DEV_KAFKA_PORT": "19092"}).controller_port == 19093
    explicit = StackConfig.from_env({}, kafka_port=29092, controller_port=30000)
    assert explicit.controller_port == 30000


def test_environment_then_overrides() -> None:
    env = {"QLAYER_DEV_STATE_DIR": "/srv/q", "QLAYER_DEV_POSTGRES_PORT": "5555",
           "QLAYER_CACHE_DIR": "/cache"}
    config = StackConfig.from_env(env)
    assert (config.state_dir, config.postgres_port, config.cache_dir) == (
        Path("/srv/q"), 5555, Path("/cache"))
    assert StackConfig.from_env(env, postgres_port=6666).postgres_port == 6666


def test_a_port_that_is_not_a_number_is_named() -> None:
    with pytest.raises(LocalStackError, match="QLAYER_DEV_KAFKA_PORT='ninety'"):
        StackConfig.from_env({"QLAYER_DEV_KAFKA_PORT": "ninety"})
