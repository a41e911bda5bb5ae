"""The error registry: every error that ends an RPC becomes its status here, with `google.rpc` details.

A service raises a `DomainError` (serving_common.failures: the scheduler's and the tokenizer's errors
are ones) or a `ServiceError` (built with `invalid_argument`, `resource_exhausted`, `unavailable`);
`status_of` is the one match from either to a status, and the shared server interceptor
(`serving_common.interceptor`) ends the call with what it returns. Clients get a plain message a person can act on, plus machine-readable details in the
`grpc-status-details-bin` trailer: `BadRequest` field violations for INVALID_ARGUMENT and `RetryInfo`
for RESOURCE_EXHAUSTED (and for UNAVAILABLE when a retry delay is known). `details_of` reads them
back from a failed call, so the gateway can pass a backend's details on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from serving_common.failures import DomainError, ErrorKind

DETAILS_KEY = "grpc-status-details-bin"
STATUS = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
# RetryInfo of RESOURCE_EXHAUSTED / UNAVAILABLE: about when a slot, the service or a backend may be back.
RETRY_SECONDS = 1.0


@dataclass(frozen=True)
class FieldViolation:
    """One bad request field: its path (`stop[1]`, `requests[0].text`) and what is wrong with it."""

    field: str
    description: str


class ServiceError(Exception):
    """Ends the current RPC with `code` and `message` (the message must make sense to a client)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, violations: Sequence[FieldViolation] = (),
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.violations = tuple(violations)
        self.retry_after = retry_after

    def status_proto(self) -> status_pb2.Status:
        """The google.rpc.Status: code, message and the details that apply."""
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        if self.violations:
            bad = error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in self.violations])
            status.details.append(_pack(bad))
        if self.retry_after is not None:
            status.details.append(_pack(error_details_pb2.RetryInfo(retry_delay=_duration(self.retry_after))))
        return status

    def to_status(self) -> grpc.Status:
        """A grpc.Status for `context.abort_with_status` (the details ride in the trailing metadata)."""
        return rpc_status.to_status(self.status_proto())

    @classmethod
    def invalid(cls, field: str, description: str) -> Self:
        """INVALID_ARGUMENT whose message starts with the field's name, with one BadRequest violation."""
        return cls(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {description}",
                   violations=(FieldViolation(field, description),))


invalid_argument = ServiceError.invalid


def invalid_message(message: str) -> ServiceError:
    """INVALID_ARGUMENT from a `field: description` message (the field is the part before ': ')."""
    field, sep, description = message.partition(": ")
    if not sep or " " in field:
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message,
                            violations=(FieldViolation("", message),))
    return invalid_argument(field, description)


def resource_exhausted(message: str, retry_after: float) -> ServiceError:
    """RESOURCE_EXHAUSTED with a RetryInfo saying when a retry has a chance."""
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after=retry_after)


def unavailable(message: str, retry_after: float | None = None) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, retry_after=retry_after)


def status_of(error: BaseException) -> ServiceError | None:
    """The status a raised error ends its call with; None for an unexpected error (INTERNAL, logged)."""
    if isinstance(error, ServiceError):
        return error
    if isinstance(error, DomainError):
        return domain_status(error)
    return None


def domain_status(error: DomainError) -> ServiceError:
    """The one match from a domain failure to its status and google.rpc details."""
    match error:
        case DomainError(kind=ErrorKind.INVALID_ARGUMENT, field=None):
            return invalid_message(error.message)
        case DomainError(kind=ErrorKind.INVALID_ARGUMENT, field=str(field)):
            return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, error.message,
                                violations=(FieldViolation(field, error.message),))
        case DomainError(kind=ErrorKind.RESOURCE_EXHAUSTED | ErrorKind.UNAVAILABLE):
            return ServiceError(STATUS[error.kind], error.message, retry_after=RETRY_SECONDS)
        case _:
            return ServiceError(STATUS[error.kind], error.message)


@dataclass(frozen=True)
class Details:
    """The standard details found on a failed call."""

    violations: tuple[FieldViolation, ...] = ()
    retry_after: float | None = None


def details_of(error: grpc.RpcError) -> Details:
    """BadRequest violations and RetryInfo from a failed call's trailers (empty when it has none)."""
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            return _parse(value)
    return Details()


def _parse(raw: bytes) -> Details:
    try:
        status = status_pb2.Status.FromString(raw)
    except Exception:  # noqa: BLE001 - a peer's garbage trailer is not our crash
        return Details()
    violations: list[FieldViolation] = []
    retry_after = None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry_after = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return Details(tuple(violations), retry_after)


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = math.floor(max(seconds, 0.0))
    return duration_pb2.Duration(seconds=whole, nanos=int(round((max(seconds, 0.0) - whole) * 1e9)) % 1_000_000_000)
