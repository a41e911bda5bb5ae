"""The whole stack with TLS on the public ports, mutual TLS between the services, and an API key.

tokenizer_service and model_service (the tiny golden Grok-1) require a client certificate signed by
the test CA; the gateway presents one, serves gRPC and HTTP over TLS and requires `Bearer KEY`. The
official openai client and grpc then get the reference's seeded text, and the same text as each other.
Certificates are made for this test (tests/certs.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import GatewayClient, completion_request
from gateway.http.chat import ChatTemplate
from gateway.http.schemas import ChatMessage
from grok.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from serving_common.healthcheck import check
from serving_common.tls import ChannelTLS
from tests.certs import Pki, make_pki
from tests.gateway.conftest import model_args
from tests.gateway.http_client import curl, sse_events
from tests.gateway.test_e2e import GOLDEN_REQUESTS
from tests.procs import GOLDEN, ROOT, Service, free_port

pytestmark = pytest.mark.slow

KEY = "sk-test-0123456789"
CASE = GOLDEN_REQUESTS[1]


@dataclass
class SecureStack:
    pki: Pki
    tokenizer: Service
    model: Service
    gateway: Service
    http_port: int

    @property
    def https(self) -> str:
        return f"https://127.0.0.1:{self.http_port}"

    def services(self) -> tuple[Service, ...]:
        return (self.gateway, self.model, self.tokenizer)


def server_flags(pki: Pki) -> list[str]:
    """An internal service: TLS with the server certificate, clients must be signed by the CA."""
    return ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-ca", str(pki.ca)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, jax_cache: str) -> Iterator[SecureStack]:
    logs = tmp_path_factory.mktemp("tls")
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    tp, mp, gp, hp = free_port(), free_port(), free_port(), free_port()
    tokenizer = Service("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"), "--host", "127.0.0.1",
                                              "--port", str(tp), *server_flags(pki)], tp, log_dir=logs)
    model = Service("model_service", [*model_args(mp, free_port(), jax_cache), *server_flags(pki)], mp, log_dir=logs)
    gateway = Service("gateway", [
        "--tokenizer", tokenizer.address, "--model", model.address, "--host", "127.0.0.1", "--port", str(gp),
        "--http-port", str(hp), "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-ca", str(pki.ca), "--tls-client-cert", str(pki.client_cert), "--tls-client-key", str(pki.client_key),
    ], gp, env={"GROK_GATEWAY_API_KEY": KEY}, log_dir=logs)
    secure = SecureStack(pki, tokenizer, model, gateway, hp)
    internal = ChannelTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    try:
        tokenizer.wait_serving(120, tls=internal)
        model.wait_serving(600, tls=internal)
        gateway.wait_serving(120, tls=ChannelTLS(str(pki.ca)))
        yield secure
    finally:
        for service in secure.services():
            service.terminate()


def grpc_stub(stack: SecureStack) -> tuple[grpc.Channel, gateway_pb2_grpc.GatewayServiceStub]:
    credentials = grpc.ssl_channel_credentials(stack.pki.ca.read_bytes())
    channel = grpc.secure_channel(stack.gateway.address, credentials)
    return channel, gateway_pb2_grpc.GatewayServiceStub(channel)


def sdk(stack: SecureStack, key: str = KEY) -> openai.OpenAI:
    verify = ssl.create_default_context(cafile=str(stack.pki.ca))
    return openai.OpenAI(base_url=f"{stack.https}/v1", api_key=key, max_retries=0, timeout=120,
                         http_client=openai.DefaultHttpxClient(verify=verify))


def sampling() -> dict:
    r = CASE["request"]
    # The reference's runner has no EOS stop, so neither may these requests.
    return {"max_tokens": r["max_len"], "temperature": r["temperature"], "top_p": r["nucleus_p"],
            "seed": r["rng_seed"]}


def grpc_text(stack: SecureStack, prompt: str) -> str:
    """The text of the gRPC API (through the project's client, with the key and the CA)."""
    with GatewayClient(stack.gateway.address, timeout=120, api_key=KEY, tls_ca=str(stack.pki.ca)) as client:
        return "".join(message.text for message in client.generate(prompt, ignore_eos=True, **sampling()))


def test_sdk_streams_the_reference_text_over_tls_as_grpc_does(stack: SecureStack) -> None:
    prompt = CASE["request"]["prompt"]
    chunks = sdk(stack).completions.create(model="grok-1", prompt=prompt, stream=True,
                                           extra_body={"ignore_eos": True}, **sampling())
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == CASE["output_text"]
    assert grpc_text(stack, prompt) == streamed


def test_sdk_streams_chat_with_the_same_text_as_grpc_on_the_rendered_prompt(stack: SecureStack) -> None:
    messages = [{"role": "user", "content": CASE["request"]["prompt"]}]
    client = sdk(stack)
    chunks = client.chat.completions.create(model="grok-1", messages=messages, stream=True,
                                            extra_body={"ignore_eos": True}, **sampling())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="grok-1", messages=messages, extra_body={"ignore_eos": True},
                                           **sampling())
    prompt = ChatTemplate.load().render([ChatMessage(**m) for m in messages])
    assert streamed and streamed == whole.choices[0].message.content == grpc_text(stack, prompt)
    assert whole.usage.completion_tokens == sampling()["max_tokens"]


def test_wrong_or_missing_key_is_refused_on_grpc_and_http_while_health_stays_open(stack: SecureStack) -> None:
    channel, stub = grpc_stub(stack)
    with channel:
        for metadata in ([("authorization", "Bearer wrong")], [("authorization", KEY)], []):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Complete(completion_request("x", max_tokens=1), timeout=30, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in caught.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(openai.AuthenticationError) as refused:
        sdk(stack, key="wrong").completions.create(model="grok-1", prompt="x", max_tokens=1)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    ca = ["--cacert", str(stack.pki.ca)]
    assert curl(*ca, "-o", "/dev/null", "-w", "%{http_code}", f"{stack.https}/v1/models").stdout == "401"
    assert curl(*ca, f"{stack.https}/health").stdout == '{"status":"SERVING"}'


def test_curl_streams_over_https_with_the_key(stack: SecureStack) -> None:
    body = json.dumps({"model": "grok-1", "prompt": "In the beginning", "max_tokens": 4, "ignore_eos": True,
                       "stream": True})
    out = curl("--cacert", str(stack.pki.ca), "-H", f"authorization: Bearer {KEY}", "-H",
               "content-type: application/json", "-d", body, f"{stack.https}/v1/completions")
    assert out.returncode == 0, out.stderr
    events = sse_events(out.stdout)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_client_cli_needs_the_key_and_the_ca(stack: SecureStack) -> None:
    command = [sys.executable, "-m", "gateway.client", "In the beginning", "--max-tokens", "3", "--quiet",
               "--address", stack.gateway.address, "--tls-ca", str(stack.pki.ca)]
    with_key = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={**os.environ, "GROK_CLIENT_API_KEY": KEY})
    assert with_key.returncode == 0 and with_key.stdout.strip(), with_key.stderr
    without = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert without.returncode == 1 and "UNAUTHENTICATED" in without.stderr


def test_plaintext_clients_are_refused_on_the_public_ports(stack: SecureStack) -> None:
    assert not check(stack.gateway.address, timeout=3)
    out = curl("-o", "/dev/null", "-w", "%{http_code}", f"http://127.0.0.1:{stack.http_port}/health")
    assert out.stdout != "200"


@pytest.mark.parametrize("name", ["tokenizer", "model"])
def test_internal_services_accept_only_clients_with_a_certificate_from_the_ca(stack: SecureStack, name: str) -> None:
    address = getattr(stack, name).address
    pki = stack.pki
    assert check(address, timeout=5, tls=ChannelTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key)))
    assert not check(address, timeout=5, tls=ChannelTLS(str(pki.ca)))  # no client certificate
    assert not check(address, timeout=5,
                     tls=ChannelTLS(str(pki.ca), str(pki.rogue_client_cert), str(pki.rogue_client_key)))
    assert not check(address, timeout=3)  # plaintext


def test_services_exit_cleanly_on_sigterm(stack: SecureStack) -> None:
    for service in stack.services():
        assert service.terminate() == 0, service.logs()[-2000:]


def test_server_tls_files_are_checked_at_start(tmp_path: pathlib.Path) -> None:
    port = free_port()
    service = Service("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"), "--port", str(port),
                                            "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key",
                                            str(tmp_path / "missing.key")], port, log_dir=tmp_path)
    assert service.proc.wait(60) == 2
    assert "--tls-key: cannot read" in service.logs() or "--tls-cert: cannot read" in service.logs()
