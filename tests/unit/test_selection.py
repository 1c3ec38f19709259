"""Which Kafka and PostgreSQL the suite uses: env endpoints, then Docker, then the local stack."""

from __future__ import annotations

import pytest

from layer.localstack.selection import Backend, choose_services


def test_explicit_endpoints_win_over_docker_and_localstack() -> None:
    choice = choose_services(
        {"QLAYER_TEST_BOOTSTRAP_SERVERS": "k:9092",
         "QLAYER_TEST_DATABASE_URL": "postgresql+psycopg://u@h/db"},
        docker_answers=True,
    )
    assert (choice.kafka, choice.postgres) == (Backend.ENV, Backend.ENV)
    assert choice.bootstrap_servers == "k:9092"
    assert choice.database_url == "postgresql+psycopg://u@h/db"


def test_docker_is_used_when_it_answers_and_no_endpoint_is_given() -> None:
    choice = choose_services({}, docker_answers=True)
    assert (choice.kafka, choice.postgres) == (Backend.TESTCONTAINERS, Backend.TESTCONTAINERS)


def test_localstack_is_the_fallback_without_docker() -> None:
    choice = choose_services({}, docker_answers=False)
    assert (choice.kafka, choice.postgres) == (Backend.LOCALSTACK, Backend.LOCALSTACK)


def test_each_service_is_chosen_on_its_own() -> None:
    choice = choose_services({"QLAYER_TEST_BOOTSTRAP_SERVERS": "k:1"}, docker_answers=False)
    assert (choice.kafka, choice.postgres) == (Backend.ENV, Backend.LOCALSTACK)
    choice = choose_services({"QLAYER_TEST_DATABASE_URL": "postgresql://x"}, docker_answers=True)
    assert (choice.kafka, choice.postgres) == (Backend.TESTCONTAINERS, Backend.ENV)


def test_empty_variables_count_as_unset() -> None:
    choice = choose_services({"QLAYER_TEST_BOOTSTRAP_SERVERS": ""}, docker_answers=False)
    assert choice.kafka == Backend.LOCALSTACK


def test_backend_can_be_forced_to_localstack_even_with_docker() -> None:
    choice = choose_services({"QLAYER_TEST_BACKEND": "localstack"}, docker_answers=True)
    assert (choice.kafka, choice.postgres) == (Backend.LOCALSTACK, Backend.LOCALSTACK)


def test_forcing_testcontainers_without_docker_is_an_error_not_a_skip() -> None:
    with pytest.raises(ValueError, match="no Docker engine"):
        choose_services({"QLAYER_TEST_BACKEND": "testcontainers"}, docker_answers=False)


def test_unknown_forced_backend_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="'podman'"):
        choose_services({"QLAYER_TEST_BACKEND": "podman"}, docker_answers=False)

