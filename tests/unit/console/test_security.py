"""Basic auth and the redrive form's CSRF token: pure checks."""

from __future__ import annotations

import base64

from layer.console.security import basic_auth_ok, csrf_token, csrf_token_ok, same_origin


def header(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


def test_basic_auth_accepts_exactly_the_user_and_password() -> None:
    assert basic_auth_ok(header("ops:pa:ss"), "ops", "pa:ss")  # a colon in the password
    assert basic_auth_ok("basic " + header("ops:pw")[6:], "ops", "pw")
    for bad in (None, "", "Bearer abc", header("ops:wrong"), header("root:pw"), header("ops"),
                "Basic !!!not-base64", "Basic " + base64.b64encode(b"\xff:pw").decode()):
        assert not basic_auth_ok(bad, "ops", "pw"), bad


def test_the_csrf_token_is_bound_to_the_secret_and_the_action() -> None:
    token = csrf_token(b"k" * 32, "redrive:Jobs")
    assert csrf_token_ok(b"k" * 32, "redrive:Jobs", token)
    assert not csrf_token_ok(b"k" * 32, "redrive:Other", token)
    assert not csrf_token_ok(b"j" * 32, "redrive:Jobs", token)
    assert not csrf_token_ok(b"k" * 32, "redrive:Jobs", None)


def test_same_origin() -> None:
    assert same_origin(None, "http", "127.0.0.1:8080")
    assert same_origin("http://127.0.0.1:8080", "http", "127.0.0.1:8080")
    assert not same_origin("http://evil.example", "http", "127.0.0.1:8080")
    assert not same_origin("http://127.0.0.1:8080", "http", None)
