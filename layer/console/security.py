"""The console's guards, pure: HTTP basic auth and the redrive form's CSRF token."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

__all__ = ["basic_auth_ok", "csrf_token", "csrf_token_ok", "same_origin"]


def basic_auth_ok(header: str | None, user: str, password: str) -> bool:
    """Whether an ``Authorization`` header carries exactly ``user``:``password`` (Basic)."""
    if not header:
        return False
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic" or not encoded:
        return False
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return False
    given_user, sep, given_password = decoded.partition(":")
    if not sep:
        return False
    # Both compared in constant time, and both always compared: no early exit on the user.
    user_ok = hmac.compare_digest(given_user.encode(), user.encode())
    password_ok = hmac.compare_digest(given_password.encode(), password.encode())
    return user_ok and password_ok


def csrf_token(secret: bytes, action: str) -> str:
    """The token a form for ``action`` (e.g. ``redrive:Jobs``) carries: an HMAC under the
    console process's secret, so only a page this console served can post it."""
    return hmac.new(secret, action.encode("utf-8"), hashlib.sha256).hexdigest()


def csrf_token_ok(secret: bytes, action: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(csrf_token(secret, action), given)


def same_origin(origin: str | None, scheme: str, host: str | None) -> bool:
    """A browser's ``Origin`` header names this console (or is absent: a non-browser client,
    which the token still guards)."""
    if origin is None:
        return True
    return host is not None and origin == f"{scheme}://{host}"
