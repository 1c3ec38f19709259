"""Driver errors become qlayer errors at the Kafka adapter boundary (no broker needed: these
are the driver's own exception objects, as confluent-kafka raises them)."""

from __future__ import annotations

import concurrent.futures

import pytest
from confluent_kafka import KafkaError, KafkaException

from layer.domain.errors import QlayerError
from layer.kafka import KafkaAdmin, RecordWriter
from layer.kafka.errors import (
    DeliveryFailed,
    KafkaAdapterError,
    driver_error,
    translated,
)
from layer.kafka.journal import JournalReader


def kafka_exception(code: int, **flags: bool) -> KafkaException:
    return KafkaException(KafkaError(code, "as librdkafka says", **flags))


def test_a_kafka_exception_keeps_librdkafkas_verdict() -> None:
    conflict = kafka_exception(KafkaError._CONFLICT, retriable=True)
    error = driver_error("beginning a transaction", conflict, DeliveryFailed)
    assert isinstance(error, DeliveryFailed) and isinstance(error, QlayerError)
    assert error.code == "_CONFLICT" and error.retriable
    assert not error.fatal and not error.abortable
    assert "beginning a transaction" in str(error) and "as librdkafka says" in str(error)

    fenced = driver_error("commit", kafka_exception(KafkaError._FENCED, fatal=True))
    assert fenced.fatal and not fenced.retriable
    abortable = driver_error("commit", kafka_exception(KafkaError._MSG_TIMED_OUT,
                                                       txn_requires_abort=True))
    assert abortable.abortable


@pytest.mark.parametrize(("raised", "retriable"), [
    (BufferError("Local: Queue full"), True),
    (TimeoutError(), True),  # an admin future's result(timeout=...)
    (concurrent.futures.CancelledError(), False),
    (RuntimeError("Consumer closed"), False),
])
def test_the_drivers_other_exceptions_become_adapter_errors(raised: BaseException,
                                                            retriable: bool) -> None:
    with pytest.raises(KafkaAdapterError) as caught, translated("an admin request"):
        raise raised
    assert caught.value.retriable is retriable
    assert caught.value.__cause__ is raised
    # An exception without a text still says what it was.
    assert str(caught.value) != "an admin request: "


def test_qlayers_own_bugs_are_not_translated() -> None:
    with pytest.raises(TypeError), translated("producing"):
        raise TypeError("a bug in qlayer, not a Kafka failure")


def test_an_adapter_error_passes_unchanged() -> None:
    original = DeliveryFailed("already translated", retriable=True)
    with pytest.raises(DeliveryFailed) as caught, translated("outer"):
        raise original
    assert caught.value is original


def test_clients_refused_by_the_driver_raise_adapter_errors() -> None:
    """A setting librdkafka refuses fails the client's construction with KafkaException;
    the adapters raise it as a qlayer error."""
    bad = {"bootstrap.servers": "127.0.0.1:1", "no.such.property": "1"}
    with pytest.raises(KafkaAdapterError, match=r"no\.such\.property"):
        RecordWriter(bad)
    with pytest.raises(KafkaAdapterError, match=r"no\.such\.property"):
        JournalReader(bad, group_id="g")
    with pytest.raises(KafkaAdapterError, match=r"no\.such\.property"):
        KafkaAdmin(bad)


def test_a_refused_login_is_one_line_naming_broker_user_and_fix() -> None:
    from layer.kafka.errors import LoginWatch

    login = LoginWatch()
    login(KafkaError(KafkaError._AUTHENTICATION,
                     "sasl_plaintext://127.0.0.1:42096/bootstrap: SASL authentication error: "
                     "Authentication failed during authentication due to invalid credentials "
                     "with SASL mechanism SCRAM-SHA-512 (after 335ms in state AUTH_REQ)"))
    login(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))  # not a login
    config = {"bootstrap.servers": "k1:9093", "security.protocol": "SASL_SSL",
              "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "bob"}
    error = driver_error("cannot list topics", KafkaException(
        KafkaError(KafkaError._TRANSPORT, "Failed to get metadata")), config=config, login=login)
    assert str(error) == (
        "cannot list topics: Kafka at k1:9093 refused the login of user 'bob' (SCRAM-SHA-512): "
        "SASL authentication error: Authentication failed during authentication due to "
        "invalid credentials with SASL mechanism SCRAM-SHA-512. Check sasl.username / "
        "sasl.password (or the TLS files) in the kafka: settings (config file or QLAYER_KAFKA) "
        "and that the user exists on the cluster")
    assert not error.retriable


def test_a_missing_acl_names_the_user_and_the_recipe() -> None:
    config = {"bootstrap.servers": "k1:9093", "sasl.username": "bob"}
    error = driver_error("cannot read topic qlayer.ack", KafkaException(
        KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)), config=config)
    assert str(error).startswith("cannot read topic qlayer.ack: Kafka at k1:9093 does not "
                                 "allow user 'bob' this (TOPIC_AUTHORIZATION_FAILED)")
    assert "qlayer security acls" in str(error)
    # Without a client config (older callers), the driver's verdict as before.
    plain = driver_error("x", KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))
    assert "does not allow" not in str(plain) and plain.code == "TOPIC_AUTHORIZATION_FAILED"


def test_a_topic_listing_asked_early_raises_its_failure_where_it_is_read() -> None:
    """`KafkaAdmin.topics_soon` runs in a thread: a broker that never answers is the reader's
    error, the same one `topics` raises, not an empty listing."""
    import socket

    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    listing = KafkaAdmin({"bootstrap.servers": f"127.0.0.1:{port}"}).topics_soon(timeout=1.0)
    with pytest.raises(KafkaAdapterError, match="cannot list topics"):
        listing.result()
