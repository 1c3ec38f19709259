"""Principals, grants and the authorization mode, for `qlayer security principal|grant|revoke|
mode` (docs/security.md, "Authorization"). Coordinators pick changes up at their next catalog
load (within their refresh interval, 2 s by default); a change that takes something away ends
the sessions that relied on it then."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from layer.domain.authorization import (
    AuthorizationMode,
    Credential,
    Entitlements,
    GrantKind,
    NamePattern,
    principal_name_problem,
)
from layer.domain.errors import QlayerError
from layer.services.queues import with_store_hints
from layer.settings import Settings
from layer.store.principals import PrincipalInfo, Principals
from layer.store.store import Store

__all__ = ["PrincipalService", "default_consumer_ids"]


class InvalidPatternError(QlayerError, ValueError):
    exit_status = 2


def default_consumer_ids(name: str) -> list[str]:
    """The consumer ids a new principal gets unless told otherwise: ``NAME-*`` (the SDK names
    a consumer given a credential and no id ``NAME-HOST-RANDOM``)."""
    return [f"{name}-*"]


def _pattern(text: str) -> NamePattern:
    try:
        return NamePattern(text)
    except ValueError as exc:
        raise InvalidPatternError(str(exc)) from None


@dataclass
class PrincipalService:
    store: Store
    clock: Callable[[], float] = time.time
    _owned: list[Store] = field(default_factory=list, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> PrincipalService:
        store = Store(settings.database_url)
        return cls(store=store, _owned=[store])

    def close(self) -> None:
        for store in self._owned:
            store.close()

    def __enter__(self) -> PrincipalService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def _principals(self) -> Principals:
        return Principals(self.store.engine)

    @with_store_hints
    def add(self, name: str, queues: list[str], consumer_ids: list[str] | None = None
            ) -> Credential:
        """A new principal with its grants; returns its credential (shown once)."""
        problem = principal_name_problem(name)
        if problem is not None:
            raise InvalidPatternError(problem)
        ids = [_pattern(p) for p in (consumer_ids if consumer_ids is not None
                                     else default_consumer_ids(name))]
        wanted = [_pattern(p) for p in queues]
        now = self.clock()
        credential = self._principals.add(name, now)
        try:
            for pattern in ids:
                self._principals.grant(name, GrantKind.CONSUMER_ID, pattern, now)
            for pattern in wanted:
                self._principals.grant(name, GrantKind.QUEUE, pattern, now)
        except QlayerError:
            # All or nothing: a principal whose consumer-id grant clashed is not left behind.
            self._principals.remove(name)
            raise
        return credential

    @with_store_hints
    def rotate(self, name: str) -> Credential:
        return self._principals.rotate(name, self.clock())

    @with_store_hints
    def remove(self, name: str) -> None:
        self._principals.remove(name)

    @with_store_hints
    def list_principals(self) -> list[PrincipalInfo]:
        return self._principals.list_principals()

    @with_store_hints
    def grant(self, name: str, kind: GrantKind, pattern: str) -> bool:
        return self._principals.grant(name, kind, _pattern(pattern), self.clock())

    @with_store_hints
    def revoke(self, name: str, kind: GrantKind, pattern: str) -> bool:
        return self._principals.revoke(name, kind, _pattern(pattern))

    @with_store_hints
    def opened(self, pattern: str) -> list[str]:
        """The queues ``pattern`` matches that no grant restricts any more while the mode is
        open: anyone may consume them now (Kafka's ``allow.everyone.if.no.acl.found``; the
        CLI warns after a revoke)."""
        entitlements = self._principals.load_entitlements()
        if entitlements.required:
            return []
        matcher = _pattern(pattern)
        return sorted(q.name for q in self.store.list_queues()
                      if matcher.matches(q.name) and not entitlements.restricted(q.name))

    @with_store_hints
    def mode(self) -> AuthorizationMode:
        return self._principals.mode()

    @with_store_hints
    def set_mode(self, mode: AuthorizationMode) -> None:
        self._principals.set_mode(mode)

    @with_store_hints
    def entitlements(self) -> Entitlements:
        return self._principals.load_entitlements()
