"""The tokenizer service driven by the real grpcurl binary (through server reflection)."""

from __future__ import annotations

import json
import subprocess

from tests.procs import Service, grpcurl
from tests.tokenizer.conftest import MAX_BATCH, MAX_TEXT_BYTES
from tokenizer_service.tokenizer import Tokenizer

SERVICE = "grok.tokenizer.v1.TokenizerService"


# grpcurl 1.8.6 prints the proto field names (token_ids), not lowerCamelCase.
def call(service: Service, method: str, body: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return grpcurl("-plaintext", "-max-time", "20", *extra, "-d", body, service.address, method)


def test_list_shows_tokenizer_health_and_reflection(service: Service) -> None:
    result = grpcurl("-plaintext", service.address, "list")
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) >= {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


def test_describe_shows_the_methods(service: Service) -> None:
    result = grpcurl("-plaintext", service.address, "describe", SERVICE)
    assert result.returncode == 0, result.stderr
    for line in ("rpc Encode ( .grok.tokenizer.v1.EncodeRequest ) returns ( .grok.tokenizer.v1.EncodeResponse )",
                 "rpc DecodeStream ( stream .grok.tokenizer.v1.DecodeStreamRequest ) returns "
                 "( stream .grok.tokenizer.v1.DecodeStreamResponse )"):
        assert line in result.stdout
    message = grpcurl("-plaintext", service.address, "describe", "grok.tokenizer.v1.DecodeStreamResponse")
    assert "repeated string token_texts = 2;" in message.stdout


def test_encode_with_json_matches_sentencepiece(service: Service, grok_tokenizer: Tokenizer) -> None:
    text = "Grok says: héllo 😀"
    result = call(service, f"{SERVICE}/Encode", json.dumps({"text": text}))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == grok_tokenizer.sp.encode(text)


def test_health_check_reports_serving(service: Service) -> None:
    for name in ("", SERVICE):
        result = call(service, "grpc.health.v1.Health/Check", json.dumps({"service": name}))
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"status": "SERVING"}


def test_decode_stream_answers_each_message_and_flushes(service: Service, grok_tokenizer: Tokenizer) -> None:
    emoji = [grok_tokenizer.sp.piece_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    hello = grok_tokenizer.sp.encode("hello")
    messages = [{"token_ids": hello}, {"token_ids": emoji[:2]}, {"token_ids": emoji[2:]}, {"token_ids": emoji[:1]}]
    result = call(service, f"{SERVICE}/DecodeStream", " ".join(json.dumps(m) for m in messages), "-emit-defaults")
    assert result.returncode == 0, result.stderr
    replies = [json.loads(chunk) for chunk in result.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert [r["text"] for r in replies] == ["hello", "", "😀", "", "\ufffd"]
    assert replies[1]["token_texts"] == ["", ""] and replies[2]["token_texts"] == ["", "😀"]
    assert replies[-1]["token_texts"] == []


def test_bad_input_exits_with_invalid_argument(service: Service) -> None:
    cases = [
        (f"{SERVICE}/Decode", {"token_ids": [1, 131072]}, "0..131071"),
        (f"{SERVICE}/Encode", {"text": "a" * (MAX_TEXT_BYTES + 1)}, "--max-text-bytes"),
        (f"{SERVICE}/EncodeBatch", {"requests": [{"text": "a"}] * (MAX_BATCH + 1)}, "--max-batch"),
        (f"{SERVICE}/DecodeStream", {"token_ids": [-5]}, "0..131071"),
    ]
    for method, body, needle in cases:
        result = call(service, method, json.dumps(body))
        assert result.returncode == 64 + 3, (method, result.returncode, result.stderr)
        assert "InvalidArgument" in result.stderr and needle in result.stderr
