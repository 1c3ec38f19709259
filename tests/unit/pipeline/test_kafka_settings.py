"""qlayer's `kafka:` settings (librdkafka names) as Spark Kafka source options (Java names)."""

from __future__ import annotations

import pytest

from layer.domain.errors import QlayerError
from layer.pipeline.io import java_kafka_settings, kafka_options


def test_sasl_scram_over_tls_becomes_a_jaas_line_and_a_pem_trust_store() -> None:
    java, left_out = java_kafka_settings({
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "spark", "sasl.password": 'p"w\\1', "ssl.ca.location": "/etc/ca.pem",
        "linger.ms": 5, "enable.idempotence": True})
    assert java == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                            'username="spark" password="p\\"w\\\\1";',
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": "/etc/ca.pem",
    }
    assert left_out == ["enable.idempotence", "linger.ms"]
    options = kafka_options("k1:9093", java)
    assert options["kafka.sasl.jaas.config"].startswith("org.apache.kafka.common.security.scram")
    assert options["kafka.security.protocol"] == "SASL_SSL"


def test_plain_is_the_default_mechanism_and_hostname_checks_can_be_off() -> None:
    java, _ = java_kafka_settings({"security.protocol": "SASL_PLAINTEXT", "sasl.username": "u",
                                   "sasl.password": "p",
                                   "ssl.endpoint.identification.algorithm": "none"})
    assert java["sasl.jaas.config"] == ('org.apache.kafka.common.security.plain.PlainLoginModule'
                                        ' required username="u" password="p";')
    assert java["ssl.endpoint.identification.algorithm"] == ""


def test_a_login_it_cannot_write_is_refused_with_the_way_out() -> None:
    with pytest.raises(QlayerError, match="--kafka-option"):
        java_kafka_settings({"sasl.mechanism": "GSSAPI", "sasl.username": "u",
                             "sasl.password": "p"})
    with pytest.raises(QlayerError, match="--kafka-option"):
        java_kafka_settings({"sasl.mechanism": "PLAIN", "sasl.username": "u"})
