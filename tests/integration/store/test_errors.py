"""Driver failures become `StoreError`s, and a store survives its connections being killed."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from layer.domain.errors import QlayerError
from layer.store.errors import StoreError
from layer.store.store import Store

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0


def test_an_unreachable_server_is_a_retryable_store_error() -> None:
    url = "postgresql+psycopg://postgres@127.0.0.1:1/qlayer?connect_timeout=2"
    with Store(url) as store, pytest.raises(StoreError) as failed:
        store.list_queues()
    assert failed.value.retryable is True
    assert isinstance(failed.value, QlayerError)


def test_killed_connections_fail_one_call_then_the_store_reconnects(database_url: str) -> None:
    with Store(database_url) as store:
        assert store.take_shard("Work", "a", T0) == 1  # a pooled connection now exists

        # What a server restart or an administrator does to the coordinator's connections.
        admin = sa.create_engine(database_url)
        try:
            with admin.connect() as conn:
                killed = conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).scalar_one()
        finally:
            admin.dispose()
        assert killed >= 1

        with pytest.raises(StoreError) as failed:
            store.report_shard("Work", "a", 1, 0, T0 + 1)
        assert failed.value.retryable is True
        assert store.report_shard("Work", "a", 1, 0, T0 + 2) is True
