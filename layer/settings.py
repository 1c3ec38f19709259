"""qlayer's settings: defaults < config file < QLAYER_* environment variables < CLI flags.

The config file is YAML (`QLAYER_CONFIG`, else ./qlayer.yaml when present) with the same
names in snake_case: `bootstrap_servers: ...`. Kafka client security (SASL/TLS) settings go in
`kafka:` as librdkafka properties and are passed to every Kafka client qlayer creates.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from layer.domain.errors import QlayerError

DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"
DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:15432/qlayer"


class SettingsError(QlayerError):
    """The configuration cannot be used; the message names the setting and the fix."""


class _YamlFileSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole mapping

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            data = yaml.safe_load(self.path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise SettingsError(f"cannot read config file {self.path}: {exc}") from exc
        if not isinstance(data, dict):
            raise SettingsError(f"config file {self.path} must be a mapping of setting: value")
        return data


def config_file_path(env: dict[str, str] | None = None) -> Path | None:
    e = os.environ if env is None else env
    if e.get("QLAYER_CONFIG"):
        return Path(e["QLAYER_CONFIG"])
    local = Path("qlayer.yaml")
    return local if local.exists() else None


class Settings(BaseSettings):
    """Where qlayer's Kafka and PostgreSQL are, and how its internal topics are named."""

    model_config = SettingsConfigDict(env_prefix="QLAYER_", extra="forbid")

    bootstrap_servers: str = DEFAULT_BOOTSTRAP_SERVERS
    database_url: str = DEFAULT_DATABASE_URL
    topic_prefix: str = "qlayer."
    kafka: dict[str, str] = Field(default_factory=dict)
    config_file: Path | None = Field(default=None, exclude=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First wins: flags (init) > environment > config file.
        return (init_settings, env_settings, _YamlFileSource(settings_cls, config_file_path()))

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Settings with CLI flag overrides (None means 'not given'). Raises SettingsError."""
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            return cls(**given)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
                for err in exc.errors()
            )
            raise SettingsError(f"invalid settings: {problems}") from exc

    def kafka_config(self, **extra: Any) -> dict[str, Any]:
        """librdkafka properties for a client: bootstrap servers, security settings, extras."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.kafka, **extra}
