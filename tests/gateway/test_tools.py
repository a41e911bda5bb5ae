"""grpcurl against the gateway (reflection, Generate with -d JSON, health) and the client CLI."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.gateway.conftest import Stack
from tests.procs import ROOT, grpcurl


def test_grpcurl_lists_services_via_reflection(fast_stack: Stack) -> None:
    out = grpcurl("-plaintext", fast_stack.address, "list")
    assert out.returncode == 0, out.stderr
    assert {"grok.gateway.v1.GatewayService", "grpc.health.v1.Health"} <= set(out.stdout.split())


def test_grpcurl_describes_the_gateway_service(fast_stack: Stack) -> None:
    out = grpcurl("-plaintext", fast_stack.address, "describe", "grok.gateway.v1.GatewayService")
    assert out.returncode == 0, out.stderr
    for rpc in ("rpc Generate", "returns ( stream .grok.gateway.v1.GenerateResponse )", "rpc Complete", "rpc GetInfo"):
        assert rpc in out.stdout


def test_grpcurl_generate_with_json_streams_messages(fast_stack: Stack) -> None:
    body = json.dumps({"prompt": "p|hello world", "sampling": {"max_tokens": 8, "stop": ["ld"]}})
    out = grpcurl("-plaintext", "-d", body, fast_stack.address, "grok.gateway.v1.GatewayService/Generate")
    assert out.returncode == 0, out.stderr
    messages = [json.loads(chunk) for chunk in out.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert "".join(m.get("text", "") for m in messages) == "hello wor"
    # grpcurl 1.8.6 prints the proto's field names when it has the descriptors from reflection.
    assert messages[-1]["finish_reason"] == "FINISH_REASON_STOP"
    assert messages[-1]["usage"]["completion_tokens"] == 4


def test_grpcurl_invalid_request_exits_with_invalid_argument(fast_stack: Stack) -> None:
    out = grpcurl("-plaintext", "-d", '{"prompt": "p|a", "sampling": {"top_p": 2}}', fast_stack.address,
                  "grok.gateway.v1.GatewayService/Complete")
    assert out.returncode == 64 + 3, out.stderr  # grpcurl exits 64 + status code
    assert "top_p" in out.stderr


def test_grpcurl_health_check_is_serving(fast_stack: Stack) -> None:
    for service in ("", "grok.gateway.v1.GatewayService"):
        out = grpcurl("-plaintext", "-d", json.dumps({"service": service}), fast_stack.address,
                      "grpc.health.v1.Health/Check")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"status": "SERVING"}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.client", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_cli_streams_the_completion_to_stdout(fast_stack: Stack) -> None:
    out = cli("p|hello world", "--max-tokens", "10", "--stop", "wor", "--temperature", "0.5", "--top-p", "0.9",
              "--seed", "3", "--address", fast_stack.address)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello \n"
    assert "finish: stop" in out.stderr


def test_cli_reports_errors_with_status_and_exit_code_1(fast_stack: Stack) -> None:
    out = cli("p|a", "--temperature", "-1", "--address", fast_stack.address)
    assert out.returncode == 1
    assert "INVALID_ARGUMENT: temperature" in out.stderr
