"""Failures in a service's own terms, with no gRPC in sight.

The scheduler, the tokenizer and the other domain layers raise a `DomainError` of one `ErrorKind`;
`serving_common.errors.status_of` is the one place that turns it into a gRPC status with its
google.rpc details, and the shared interceptor ends the call with that. Keeping this module free of
grpc lets the domain layers be imported and tested without the transport.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """Failure classes; `serving_common.errors.STATUS` gives each its one gRPC status code."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class DomainError(Exception):
    """A failure of `kind` whose `message` makes sense to a client.

    `field` names the bad request field of an INVALID_ARGUMENT; None means the message itself starts
    with `field: ` (the scheduler's validation writes them that way).
    """

    def __init__(self, kind: ErrorKind, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field
