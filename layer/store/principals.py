"""Principals, their grants and the installation's authorization mode in PostgreSQL (0013;
docs/security.md, "Authorization"). The CLI writes them (`qlayer security principal ...`,
`qlayer security grant ...`); coordinators read them all at each catalog load
(`load_entitlements`), in one connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Engine

from layer.domain.authorization import (
    AuthorizationMode,
    Credential,
    Entitlements,
    Grant,
    GrantKind,
    NamePattern,
    Principal,
    issue_credential,
    overlapping,
)
from layer.domain.errors import GrantConflictError, PrincipalExistsError, UnknownPrincipalError
from layer.store import statements as sql
from layer.store.errors import StoreError, translate_errors

__all__ = ["PrincipalInfo", "Principals"]


def _to_datetime(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


@dataclass(frozen=True, slots=True)
class PrincipalInfo:
    """A principal as `qlayer security principal list` shows it (never its credential)."""

    name: str
    created_at: float
    issued_at: float
    grants: tuple[Grant, ...]


class Principals:
    """The authorization tables behind a narrow API; ``engine`` is the store's."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def load_entitlements(self) -> Entitlements:
        """Mode, principals and grants, as one snapshot (one connection, one transaction)."""
        with translate_errors("loading principals and grants"), self._engine.begin() as conn:
            mode = conn.execute(sql.SELECT_AUTHORIZATION_MODE).scalar_one_or_none()
            principals = [Principal(row.name, bytes(row.secret_sha256))
                          for row in conn.execute(sql.SELECT_PRINCIPALS)]
            grants = [Grant(row.principal, GrantKind(row.kind), NamePattern(row.pattern))
                      for row in conn.execute(sql.SELECT_GRANTS)]
        if mode is None:
            raise StoreError("the database has no installation row: run `qlayer db upgrade`",
                             retryable=False)
        return Entitlements.of(AuthorizationMode(mode), principals, grants)

    def mode(self) -> AuthorizationMode:
        return self.load_entitlements().mode

    def set_mode(self, mode: AuthorizationMode) -> None:
        with translate_errors("setting the authorization mode"), self._engine.begin() as conn:
            if conn.execute(sql.SET_AUTHORIZATION_MODE,
                            {"the_mode": mode.value}).scalar_one_or_none() is None:
                raise StoreError("the database has no installation row: run `qlayer db "
                                 "upgrade`", retryable=False)

    def add(self, name: str, now: float) -> Credential:
        """A new principal; returns its credential (stored as a hash only: shown once)."""
        credential = issue_credential(name)
        with translate_errors(f"adding principal {name!r}"), self._engine.begin() as conn:
            added = conn.execute(sql.INSERT_PRINCIPAL, {
                "the_name": name, "the_hash": credential.sha256,
                "now": _to_datetime(now)}).scalar_one_or_none()
        if added is None:
            raise PrincipalExistsError(name)
        return credential

    def rotate(self, name: str, now: float) -> Credential:
        """A new credential for ``name``; sessions of the old one end at the coordinators'
        next catalog load."""
        credential = issue_credential(name)
        with translate_errors(f"rotating principal {name!r}"), self._engine.begin() as conn:
            done = conn.execute(sql.ROTATE_PRINCIPAL, {
                "the_name": name, "the_hash": credential.sha256,
                "now": _to_datetime(now)}).scalar_one_or_none()
        if done is None:
            raise UnknownPrincipalError(name)
        return credential

    def remove(self, name: str) -> None:
        """Remove a principal and its grants; its sessions end at the next catalog load."""
        with translate_errors(f"removing principal {name!r}"), self._engine.begin() as conn:
            if conn.execute(sql.DELETE_PRINCIPAL, {"the_name": name}).scalar_one_or_none() \
                    is None:
                raise UnknownPrincipalError(name)

    def list_principals(self) -> list[PrincipalInfo]:
        with translate_errors("listing principals"), self._engine.begin() as conn:
            grants = [Grant(row.principal, GrantKind(row.kind), NamePattern(row.pattern))
                      for row in conn.execute(sql.SELECT_GRANTS)]
            return [PrincipalInfo(row.name, row.created_at.timestamp(),
                                  row.issued_at.timestamp(),
                                  tuple(g for g in grants if g.principal == row.name))
                    for row in conn.execute(sql.SELECT_PRINCIPALS)]

    def grant(self, name: str, kind: GrantKind, pattern: NamePattern, now: float) -> bool:
        """Grant ``name`` a queue or consumer-id pattern; False when it had it already.

        Raises `GrantConflictError` for a consumer-id pattern that overlaps another
        principal's (checked under a lock, so two concurrent grants cannot both pass)."""
        grant = Grant(name, kind, pattern)
        with translate_errors(f"granting {kind.value} {pattern} to {name!r}"), \
                self._engine.begin() as conn:
            conn.execute(sql.LOCK_GRANTS)
            known = {row.name for row in conn.execute(sql.SELECT_PRINCIPALS)}
            if name not in known:
                raise UnknownPrincipalError(name)
            existing = [Grant(row.principal, GrantKind(row.kind), NamePattern(row.pattern))
                        for row in conn.execute(sql.SELECT_GRANTS)]
            clash = overlapping(grant, existing)
            if clash:
                raise GrantConflictError(str(pattern), name,
                                         [(g.principal, str(g.pattern)) for g in clash])
            added = conn.execute(sql.INSERT_GRANT, {
                "the_principal": name, "the_kind": kind.value, "the_pattern": pattern.text,
                "now": _to_datetime(now)}).scalar_one_or_none()
        return added is not None

    def revoke(self, name: str, kind: GrantKind, pattern: NamePattern) -> bool:
        """Take a grant back; False when ``name`` did not have it. Sessions that relied on it
        end at the coordinators' next catalog load."""
        with translate_errors(f"revoking {kind.value} {pattern} of {name!r}"), \
                self._engine.begin() as conn:
            return conn.execute(sql.DELETE_GRANT, {
                "the_principal": name, "the_kind": kind.value,
                "the_pattern": pattern.text}).scalar_one_or_none() is not None
