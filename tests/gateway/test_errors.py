"""How the gateway maps a failed backend call (gateway/errors.py)."""

from __future__ import annotations

import grpc

from gateway.errors import from_upstream
from serving_common.errors import DETAILS_KEY, ServiceError, resource_exhausted


class FailedCall(grpc.RpcError):
    """What a grpc client call raises: code, details, trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple = ()) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailers


def from_our_service(error: ServiceError) -> FailedCall:
    """A failure as our services send it: the shared interceptor always attaches google.rpc details."""
    return FailedCall(error.code, error.message, ((DETAILS_KEY, error.status_proto().SerializeToString()),))


def test_a_connection_that_broke_mid_call_is_unavailable_not_internal() -> None:
    # gRPC core reports some transport failures (a write to a connection the peer reset) as INTERNAL
    # or UNKNOWN, without the details trailer every error from our services carries.
    for code, text in ((grpc.StatusCode.INTERNAL, "Internal error from Core"),
                       (grpc.StatusCode.UNKNOWN, "Stream removed")):
        mapped = from_upstream(FailedCall(code, text), "tokenizer", "127.0.0.1:1")
        assert mapped.code == grpc.StatusCode.UNAVAILABLE
        assert "tokenizer service is unavailable" in mapped.message and mapped.retry_after is not None


def test_a_real_internal_error_of_a_backend_stays_internal_and_names_no_address() -> None:
    bug = ServiceError(grpc.StatusCode.INTERNAL, "internal error in the model service (request id r1)")
    mapped = from_upstream(from_our_service(bug), "model", "10.0.0.7:50053")
    assert mapped.code == grpc.StatusCode.INTERNAL and "10.0.0.7" not in mapped.message


def test_pass_through_keeps_the_backends_message_and_retry_info() -> None:
    mapped = from_upstream(from_our_service(resource_exhausted("the waiting queue is full; retry later", 1.0)),
                           "model", "10.0.0.7:50053")
    assert mapped.code == grpc.StatusCode.RESOURCE_EXHAUSTED and mapped.retry_after == 1.0
    assert mapped.message == "model service: the waiting queue is full; retry later"


def test_a_call_the_backend_cancelled_is_unavailable_so_the_client_retries() -> None:
    # The gateway's own cancellations never come back as an RpcError (its reader is cancelled instead):
    # a CANCELLED status from upstream means the backend ended the call, e.g. a model replica whose
    # SIGTERM grace ran out while the call was still decoding. The client did not cancel anything.
    mapped = from_upstream(FailedCall(grpc.StatusCode.CANCELLED, "Cancelled"), "model", "10.0.0.7:50053")
    assert mapped.code == grpc.StatusCode.UNAVAILABLE
    assert "model service" in mapped.message and "10.0.0.7" not in mapped.message
    assert mapped.retry_after is not None
