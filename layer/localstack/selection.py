"""How the test suite finds its Kafka broker and PostgreSQL server.

Order of choice: endpoints given in QLAYER_TEST_BOOTSTRAP_SERVERS / QLAYER_TEST_DATABASE_URL;
else testcontainers when a Docker engine answers; else the local stack (real processes).
Kept pure so the choice itself is unit-tested; the fixtures in tests/conftest.py act on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Backend(StrEnum):
    ENV = "env"
    TESTCONTAINERS = "testcontainers"
    LOCALSTACK = "localstack"


@dataclass(frozen=True)
class ServiceChoice:
    kafka: Backend
    postgres: Backend
    bootstrap_servers: str | None = None
    database_url: str | None = None


def choose_services(env: Mapping[str, str], docker_answers: bool) -> ServiceChoice:
    """Each service independently: an explicit endpoint wins, then Docker, then the local stack.

    QLAYER_TEST_BACKEND=localstack|testcontainers forces the fallback for both services.
    """
    forced = env.get("QLAYER_TEST_BACKEND", "").strip().lower()
    if forced and forced not in (Backend.TESTCONTAINERS, Backend.LOCALSTACK):
        raise ValueError(
            f"QLAYER_TEST_BACKEND={forced!r}: use 'localstack' or 'testcontainers'"
        )
    if forced == Backend.TESTCONTAINERS and not docker_answers:
        raise ValueError("QLAYER_TEST_BACKEND=testcontainers but no Docker engine answers")
    if forced:
        fallback = Backend(forced)
    else:
        fallback = Backend.TESTCONTAINERS if docker_answers else Backend.LOCALSTACK
    bootstrap = env.get("QLAYER_TEST_BOOTSTRAP_SERVERS") or None
    database = env.get("QLAYER_TEST_DATABASE_URL") or None
    return ServiceChoice(
        kafka=Backend.ENV if bootstrap else fallback,
        postgres=Backend.ENV if database else fallback,
        bootstrap_servers=bootstrap,
        database_url=database,
    )


def docker_answers(timeout: float = 3.0) -> bool:
    """True when a Docker engine responds to a ping (the docker CLI alone is not enough)."""
    try:
        import docker  # installed with testcontainers
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=int(max(timeout, 1)))  # type: ignore[attr-defined]
        ok = bool(client.ping())
        client.close()
        return ok
    except Exception:
        return False
