"""Domain errors of the gateway and the one place that maps upstream gRPC statuses to ours.

Upstream INVALID_ARGUMENT, RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED pass through with the backend's
message and its google.rpc details (field violations, retry delay); an unreachable service is
UNAVAILABLE naming the service, and so is a call the backend cancelled (the gateway's own
cancellations never surface as an upstream error: a replica whose drain grace ran out mid-call), and
a connection that broke mid-call (gRPC core reports some
of those as INTERNAL or UNKNOWN, but without the details trailer every error from our services
carries); a backend's own INTERNAL stays INTERNAL (a bug somewhere). Public messages never name a
backend's address or the transport's error text: those go to the gateway's log.
"""

from __future__ import annotations

import logging

import grpc

from serving_common.errors import DETAILS_KEY, RETRY_SECONDS, ServiceError, details_of
from serving_common.logs import request_id_var

log = logging.getLogger(__name__)

PASS_THROUGH = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
})


class GatewayError(ServiceError):
    """An error that ends a request with `code` and an actionable `message` (see ServiceError)."""


invalid = GatewayError.invalid  # INVALID_ARGUMENT naming the field, with a BadRequest field violation


def down(service: str, detail: str = "") -> GatewayError:
    """UNAVAILABLE for a backend that cannot be reached (the public message names only the service)."""
    suffix = f" ({detail})" if detail else ""
    return GatewayError(grpc.StatusCode.UNAVAILABLE, f"the {service} service is unavailable{suffix}; retry later",
                        retry_after=RETRY_SECONDS)


TRANSPORT_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


def from_status(code: grpc.StatusCode, details: str, service: str, address: str,
                error: grpc.RpcError | None = None, trailers: object = None) -> GatewayError:
    """Map a failed call to the tokenizer or model service (its code and details) to the gateway's status."""
    if code in PASS_THROUGH:
        found = details_of(error) if error is not None else None
        return GatewayError(code, f"{service} service: {details}" if details else f"{service} service: {code.name}",
                            violations=found.violations if found else (),
                            retry_after=found.retry_after if found else None)
    log.warning("backend call failed", extra={"backend": service, "address": address, "code": code.name,
                                              "detail": details})
    if trailers is None and error is not None and hasattr(error, "trailing_metadata"):
        trailers = error.trailing_metadata()
    from_our_service = any(key == DETAILS_KEY for key, _ in trailers or ())  # type: ignore[attr-defined]
    if code == grpc.StatusCode.CANCELLED:
        return down(service, "it cancelled the call: restarting or shutting down")
    if code == grpc.StatusCode.UNAVAILABLE or (code in TRANSPORT_CODES and not from_our_service):
        return down(service)
    return GatewayError(grpc.StatusCode.INTERNAL, f"the {service} service failed ({code.name}); the gateway's "
                        f"logs have the details (request id {request_id_var.get()})")


def from_upstream(error: grpc.RpcError, service: str, address: str) -> GatewayError:
    """`from_status` for a raised grpc error."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else "") or ""
    return from_status(code, details, service, address, error)


async def from_finished_call(call: grpc.aio.Call, service: str, address: str) -> GatewayError:
    """The error of a call that ended before we were done with it (writing to it raised InvalidStateError)."""
    code = await call.code()
    if code == grpc.StatusCode.OK:  # the backend closed the stream early without an error
        log.warning("backend ended a stream early", extra={"backend": service, "address": address})
        return down(service, "it ended the stream early")
    return from_status(code, await call.details() or "", service, address, trailers=await call.trailing_metadata())
