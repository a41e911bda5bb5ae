"""`python -m serving_common.healthcheck HOST:PORT [SERVICE]`: exit 0 iff the server reports SERVING.

Used as the container HEALTHCHECK and by scripts that wait for the stack to come up.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
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
    args = parser.parse_args()
    ok = check(args.address, args.service, args.timeout)
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
