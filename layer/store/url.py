"""The PostgreSQL URL: checked before any engine is made, refused in one line.

SQLAlchemy reports a URL it cannot parse, a dialect it does not know (``postgres://``) or a
driver that is not installed (``mysql://``) with its own exception types, raised from
``create_engine``; they would reach the operator as a traceback. Here they become a
`DatabaseUrlError` (a `StoreError`, so the CLI prints ``error: ...`` and exits 1).

``postgres://`` and ``postgresql://`` are aliases of ``postgresql+psycopg://``: the first is what
Heroku, libpq tools and many hosted databases hand out (SQLAlchemy refuses it), and a bare
``postgresql://`` means psycopg2 to SQLAlchemy 2.0, which qlayer does not install.
"""

from __future__ import annotations

import re
from typing import Final

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from layer.store.errors import StoreError

__all__ = ["EXPECTED_FORM", "DatabaseUrlError", "parse_database_url", "redacted"]

EXPECTED_FORM: Final = "postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DATABASE"
_WHERE_SET: Final = "--database-url, QLAYER_DATABASE_URL or database_url in the config file"
# The drivers the store runs on: psycopg 3 (SQLAlchemy's default for postgresql://).
_DRIVER: Final = "postgresql+psycopg"
_ALIASES: Final = frozenset({"postgres", "postgresql", "postgres+psycopg"})
# USER:PASSWORD@ after the scheme (or at the start of a URL that has none).
_PASSWORD: Final = re.compile(r"(?<=://)([^:/@\s]*):[^@]*@")
_PASSWORD_NO_SCHEME: Final = re.compile(r"^([^:/@\s]*):[^@]*@")


class DatabaseUrlError(StoreError):
    """The database URL cannot be used; the message says why and the form expected."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


def redacted(url: str) -> str:
    """``url`` without its password, for messages (also when it does not parse)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (sa_exc.ArgumentError, ValueError):
        pattern = _PASSWORD if "://" in url else _PASSWORD_NO_SCHEME
        return pattern.sub(r"\1:***@", url, count=1)


def parse_database_url(url: str | URL) -> URL:
    """``url`` parsed (an alias's scheme as ``postgresql+psycopg``), or `DatabaseUrlError`
    naming the problem and the form expected."""
    if isinstance(url, URL):
        parsed = url
    else:
        if not isinstance(url, str) or not url.strip():
            raise DatabaseUrlError(
                f"no database URL: expected {EXPECTED_FORM} (set by {_WHERE_SET})"
            )
        try:
            parsed = make_url(url)
        except (sa_exc.ArgumentError, ValueError):
            # ValueError: a URL whose port is not a number ("host:port" with letters).
            raise DatabaseUrlError(
                f"database URL {redacted(url)!r} cannot be parsed: expected {EXPECTED_FORM} "
                f"(set by {_WHERE_SET})"
            ) from None
    if parsed.drivername in _ALIASES:
        return parsed.set(drivername=_DRIVER)
    if parsed.drivername != _DRIVER:
        raise DatabaseUrlError(
            f"database URL {parsed.render_as_string(hide_password=True)!r}: qlayer runs on "
            f"PostgreSQL with psycopg, not {parsed.drivername!r}: expected "
            f"{EXPECTED_FORM} (set by {_WHERE_SET})"
        )
    return parsed
