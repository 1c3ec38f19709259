"""Settings precedence: defaults < config file < QLAYER_* variables < flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from layer.settings import DEFAULT_BOOTSTRAP_SERVERS, Settings, SettingsError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("QLAYER_BOOTSTRAP_SERVERS", "QLAYER_DATABASE_URL", "QLAYER_TOPIC_PREFIX",
                 "QLAYER_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


def test_defaults_point_at_the_local_stack() -> None:
    s = Settings.load()
    assert s.bootstrap_servers == DEFAULT_BOOTSTRAP_SERVERS
    assert s.database_url.endswith("@127.0.0.1:15432/qlayer")
    assert s.topic_prefix == "qlayer."


def test_file_then_env_then_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = tmp_path / "q.yaml"
    cfg.write_text("bootstrap_servers: file:1\ntopic_prefix: fromfile.\n"
                   "kafka:\n  security.protocol: SASL_SSL\n")
    monkeypatch.setenv("QLAYER_CONFIG", str(cfg))
    assert Settings.load().bootstrap_servers == "file:1"
    monkeypatch.setenv("QLAYER_BOOTSTRAP_SERVERS", "env:2")
    s = Settings.load()
    assert s.bootstrap_servers == "env:2"
    assert s.topic_prefix == "fromfile."
    assert Settings.load(bootstrap_servers="flag:3").bootstrap_servers == "flag:3"
    # A flag that was not given (None) does not override.
    assert Settings.load(bootstrap_servers=None).bootstrap_servers == "env:2"
    assert s.kafka_config()["security.protocol"] == "SASL_SSL"
    assert s.kafka_config()["bootstrap.servers"] == "env:2"


def test_qlayer_yaml_in_the_working_directory_is_read(tmp_path: Path) -> None:
    (tmp_path / "qlayer.yaml").write_text("topic_prefix: here.\n")
    assert Settings.load().topic_prefix == "here."


def test_unknown_setting_in_file_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("bootstrap_server: typo:1\n")
    monkeypatch.setenv("QLAYER_CONFIG", str(cfg))
    with pytest.raises(SettingsError, match="bootstrap_server"):
        Settings.load()


def test_unreadable_or_non_mapping_config_file(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("QLAYER_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(SettingsError, match="cannot read config file"):
        Settings.load()
    cfg = tmp_path / "list.yaml"
    cfg.write_text("- a\n- b\n")
    monkeypatch.setenv("QLAYER_CONFIG", str(cfg))
    with pytest.raises(SettingsError, match="must be a mapping"):
        Settings.load()
