"""A maximum connection age makes connected `dns:///` clients find servers added behind the name,
without cutting calls in flight; the model service takes it from a flag or GROK_MODEL_* variable."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from model_service.__main__ import parser
from serving_common.grpc_server import NOT_SERVING, SERVING, connection_age_options
from tests.deploy.dns import DnsServer

AGE_SECONDS = 0.5
# Reconnecting and resolving again takes milliseconds; the rest is room for a busy machine.
SLACK_SECONDS = 5.0
# The client re-resolves at most this often; gRPC's default (30 s) would only make the test slow.
CLIENT_OPTIONS = [("grpc.lb_policy_name", "round_robin"), ("grpc.dns_min_time_between_resolutions_ms", 200)]


class CountingHealth(health.aio.HealthServicer):
    """A health servicer that counts the Check calls it answered."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext,
                    ) -> health_pb2.HealthCheckResponse:
        self.checks += 1
        return await super().Check(request, context)


async def start_server(ip: str, port: int, options: list[tuple[str, int]],
                       ) -> tuple[grpc.aio.Server, CountingHealth, int]:
    server = grpc.aio.server(options=options)
    servicer = CountingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{ip}:{port}")
    await server.start()
    return server, servicer, bound


def test_options_are_off_at_zero_and_leave_calls_in_flight_unlimited_by_default() -> None:
    assert connection_age_options(0) == []
    assert dict(connection_age_options(30)) == {"grpc.max_connection_age_ms": 30_000,
                                                "grpc.max_connection_age_grace_ms": 2**31 - 1}
    assert dict(connection_age_options(2.5, grace_seconds=60))["grpc.max_connection_age_grace_ms"] == 60_000
    assert dict(connection_age_options(float("inf")))["grpc.max_connection_age_ms"] == 2**31 - 1


async def calls_until_second_server_answers(with_age: bool, within: float) -> tuple[float | None, int]:
    """Seconds until a client connected before the second server existed reaches it (None: never
    within `within`), and how many of its calls failed."""
    options = connection_age_options(AGE_SECONDS) if with_age else []
    first, _, port = await start_server("127.0.0.1", 0, options)
    dns = DnsServer({"model": ["127.0.0.1"]})
    second = None
    try:
        target = f"dns://127.0.0.1:{dns.port}/model:{port}"
        async with grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            second, counter, _ = await start_server("127.0.0.2", port, options)
            dns.table["model"] = ("127.0.0.1", "127.0.0.2")
            added, failures = time.monotonic(), 0
            while time.monotonic() - added < within:
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                except grpc.aio.AioRpcError:
                    failures += 1
                if counter.checks:
                    return time.monotonic() - added, failures
                await asyncio.sleep(0.02)
            return None, failures
    finally:
        dns.close()
        await first.stop(0)
        if second is not None:
            await second.stop(0)


def test_a_connected_dns_client_finds_a_server_added_behind_the_name() -> None:
    waited, failures = asyncio.run(calls_until_second_server_answers(with_age=True, within=10))
    assert waited is not None and waited < 1.1 * AGE_SECONDS + SLACK_SECONDS, waited
    assert failures == 0


def test_without_a_connection_age_the_added_server_gets_nothing() -> None:
    # The control: the age above, not the DNS answer alone, is what brings the client to the new server.
    within = 1.1 * AGE_SECONDS + SLACK_SECONDS
    waited, failures = asyncio.run(calls_until_second_server_answers(with_age=False, within=within))
    assert waited is None and failures == 0


async def watch_across_connection_ages() -> list[int]:
    """Statuses a Watch stream receives while its connection passes the maximum age several times."""
    server = grpc.aio.server(options=connection_age_options(AGE_SECONDS))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", NOT_SERVING)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            statuses = [(await call.read()).status]
            await asyncio.sleep(4 * AGE_SECONDS)
            await servicer.set("", SERVING)
            statuses.append((await call.read()).status)
            call.cancel()
            # New calls go over a new connection once the old one was told to go away.
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            return [*statuses, reply.status]
    finally:
        await server.stop(0)


def test_a_stream_outlives_the_connection_age() -> None:
    assert asyncio.run(watch_across_connection_ages()) == [NOT_SERVING, SERVING, SERVING]


def test_model_service_reads_the_connection_age_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--config", "grok-1"]
    args = parser().parse_args(base)
    assert args.max_connection_age_seconds == 30.0 and args.max_connection_age_grace_seconds is None
    monkeypatch.setenv("GROK_MODEL_MAX_CONNECTION_AGE_SECONDS", "5")
    monkeypatch.setenv("GROK_MODEL_MAX_CONNECTION_AGE_GRACE_SECONDS", "600")
    args = parser().parse_args(base)
    assert (args.max_connection_age_seconds, args.max_connection_age_grace_seconds) == (5.0, 600.0)
    assert parser().parse_args([*base, "--max-connection-age-seconds", "0"]).max_connection_age_seconds == 0.0
    with pytest.raises(SystemExit):
        parser().parse_args([*base, "--max-connection-age-seconds", "-1"])
