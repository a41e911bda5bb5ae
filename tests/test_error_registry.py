"""serving_common.errors.status_of: the one map from a raised error to the status a call ends with."""

from __future__ import annotations

import grpc
import pytest

from serving_common.errors import RETRY_SECONDS, FieldViolation, ServiceError, status_of
from serving_common.failures import DomainError, ErrorKind


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_domain_failure_kind_has_the_status_of_its_name(kind: ErrorKind) -> None:
    status = status_of(DomainError(kind, "field: what is wrong"))
    assert status is not None and status.code.name == kind.name


def test_an_invalid_argument_without_a_field_names_the_field_its_message_starts_with() -> None:
    status = status_of(DomainError(ErrorKind.INVALID_ARGUMENT, "max_tokens: must be at least 1"))
    assert status is not None and status.message == "max_tokens: must be at least 1"
    assert status.violations == (FieldViolation("max_tokens", "must be at least 1"),)


def test_an_invalid_argument_with_a_field_keeps_its_message_whole() -> None:
    status = status_of(DomainError(ErrorKind.INVALID_ARGUMENT, "token_ids[1] = 9 is out of range", field="token_ids"))
    assert status is not None and status.message == "token_ids[1] = 9 is out of range"
    assert status.violations == (FieldViolation("token_ids", "token_ids[1] = 9 is out of range"),)


@pytest.mark.parametrize("kind", [ErrorKind.RESOURCE_EXHAUSTED, ErrorKind.UNAVAILABLE])
def test_retryable_failures_say_when_to_retry(kind: ErrorKind) -> None:
    status = status_of(DomainError(kind, "busy; retry"))
    assert status is not None and status.retry_after == RETRY_SECONDS and not status.violations


def test_service_errors_pass_unchanged_and_anything_else_has_no_status() -> None:
    error = ServiceError(grpc.StatusCode.NOT_FOUND, "no such model")
    assert status_of(error) is error
    assert status_of(KeyError("bug")) is None
