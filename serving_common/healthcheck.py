"""`python -m serving_common.healthcheck HOST:PORT [SERVICE]`: exit 0 iff the server reports SERVING.

Used as the container HEALTHCHECK and by scripts that wait for the stack to come up.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving_common.tls import ChannelTLS


def _channel(address: str, tls: ChannelTLS | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.grpc_credentials(), options=tls.channel_options())


def check(address: str, service: str = "", timeout: float = 3.0, tls: ChannelTLS | None = None) -> bool:
    """True iff the server at `address` answers SERVING (over TLS when `tls` is given)."""
    with _channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("address", help="HOST:PORT of a gRPC server")
    parser.add_argument("service", nargs="?", default="", help="service name ('' = whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--tls-ca", default=None, help="PEM CA certificate: connect over TLS, verifying the server")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate (servers that require mutual TLS)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None, help="name to verify instead of the address's host")
    args = parser.parse_args()
    tls = ChannelTLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name) if args.tls_ca else None
    ok = check(args.address, args.service, args.timeout, tls)
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
