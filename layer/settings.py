"""qlayer's settings: defaults < config file < QLAYER_* environment variables < CLI flags.

The config file is YAML (`QLAYER_CONFIG`, else ./qlayer.yaml when present) with the same
names in snake_case: `bootstrap_servers: ...`. Kafka client security (SASL/TLS) settings go in
`kafka:` as librdkafka properties and are passed to every Kafka client qlayer creates.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)
from pydantic_settings import SettingsError as SourceError
from pydantic_settings.sources.utils import parse_env_vars

from layer.domain.errors import QlayerError

DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"
DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:15432/qlayer"


class SettingsError(QlayerError):
    """The configuration cannot be used; the message names the setting and the fix.

    A usage error, as a wrong flag value is: the CLI exits with status 2 (`exit_status`).
    """

    exit_status = 2


class _ConfigFile(YamlConfigSettingsSource):
    """pydantic-settings' YAML source with qlayer's errors: one `SettingsError` line naming the
    file, not a traceback from the YAML parser or from a file that holds a list."""

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        try:
            data = super()._read_file(file_path)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            # YAML's messages span lines (the problem, then where): one line for the CLI.
            why = " ".join(str(exc).split())
            raise SettingsError(f"cannot read config file {file_path}: {why}") from exc
        if not isinstance(data, dict):
            raise SettingsError(f"config file {file_path} must be a mapping of setting: value")
        return data


class _Environment(EnvSettingsSource):
    """QLAYER_* variables from a given mapping (the SDK's ``env=`` argument, tests) instead of
    os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty,
                              self.env_parse_none_str)


def config_file_path(env: Mapping[str, str] | None = None) -> Path | None:
    """QLAYER_CONFIG, else ./qlayer.yaml when it exists, else None."""
    e = os.environ if env is None else env
    if e.get("QLAYER_CONFIG"):
        return Path(e["QLAYER_CONFIG"])
    local = Path("qlayer.yaml")
    return local if local.exists() else None


# The environment a load() reads: settings_customise_sources is a classmethod that pydantic
# calls with no way to pass it one, so load() sets it here for the duration of the call.
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("qlayer_settings_environ",
                                                            default=None)


class Settings(BaseSettings):
    """Where qlayer's Kafka and PostgreSQL are, and how its internal topics are named."""

    model_config = SettingsConfigDict(env_prefix="QLAYER_", extra="forbid")

    bootstrap_servers: str = DEFAULT_BOOTSTRAP_SERVERS
    database_url: str = DEFAULT_DATABASE_URL
    topic_prefix: str = "qlayer."
    # librdkafka takes numbers and booleans too (`linger.ms: 5`, `enable.idempotence: true`).
    kafka: dict[str, str | int | float | bool] = Field(default_factory=dict)
    # A consumer's credential (protocol 7, docs/security.md "Authorization"): `NAME:SECRET` as
    # `qlayer security principal add` printed it. A secret: kept out of reprs and dumps.
    credential: SecretStr | None = None
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
        # First wins: flags or SDK arguments (init) > environment > config file > defaults.
        environ = _ENVIRON.get()
        env = env_settings if environ is None else _Environment(settings_cls, environ)
        path = config_file_path(environ)
        if path is not None and not path.exists():
            # pydantic's source skips a missing file; one named by QLAYER_CONFIG is a mistake.
            # (QLAYER_CONFIG=/dev/null, "no file", exists and reads as empty.)
            raise SettingsError(f"cannot read config file {path}: no such file "
                                "(set by QLAYER_CONFIG)")
        files = _ConfigFile(settings_cls, yaml_file=path) if path is not None else None
        return (init_settings, env) if files is None else (init_settings, env, files)

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings with CLI flag overrides (None means 'not given'). Raises SettingsError.

        ``env`` replaces os.environ (QLAYER_* variables and QLAYER_CONFIG) when given.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        token = _ENVIRON.set(env)
        try:
            return cls(**given)
        except ValidationError as exc:
            problems: dict[str, str] = {}
            for err in exc.errors():
                loc = err["loc"]
                if loc[:1] == ("kafka",) and len(loc) > 2:
                    # One line per property, not one per branch of str | int | float | bool.
                    loc, msg = loc[:2], "should be a string, a number or a boolean"
                else:
                    msg = err["msg"]
                problems.setdefault(_where(loc), msg)
            problems_text = "; ".join(f"{where}: {msg}" for where, msg in problems.items())
            raise SettingsError(f"invalid settings: {problems_text}") from exc
        except SourceError as exc:
            raise SettingsError(_source_problem(exc)) from exc
        finally:
            _ENVIRON.reset(token)

    def kafka_config(self, **extra: Any) -> dict[str, Any]:
        """librdkafka properties for a client: bootstrap servers, security settings, extras."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.kafka, **extra}


def _source_problem(exc: Exception) -> str:
    """pydantic-settings' "error parsing value for field "kafka" from source ..." as one line
    that names the variable, the reason and the form expected."""
    cause = exc.__cause__
    if "\"kafka\"" in str(exc):
        why = f": {cause}" if isinstance(cause, json.JSONDecodeError) else ""
        return ("QLAYER_KAFKA is not a JSON object of librdkafka properties" + why + "; "
                """write it like QLAYER_KAFKA='{"security.protocol": "SASL_SSL"}'""")
    return f"invalid settings: {exc}" + (f": {cause}" if cause is not None else "")


def _where(loc: tuple[int | str, ...]) -> str:
    """A setting's name and where it can be set: `kafka.linger.ms (QLAYER_KAFKA or kafka: in
    the config file)`; the error alone would not say which of the three sources is wrong."""
    if not loc:
        return "settings"
    field = str(loc[0])
    name = ".".join(str(p) for p in loc)
    if field not in Settings.model_fields or field == "config_file":
        return name  # an unknown key: only the config file can hold one
    return f"{name} (QLAYER_{field.upper()} or {field}: in the config file)"
