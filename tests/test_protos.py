"""The API contract: stubs are fresh, buf lint is clean, and the fixed names exist."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.procs import ROOT


def test_generated_stubs_match_the_protos() -> None:
    result = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stale_check_detects_an_edited_stub(tmp_path, monkeypatch) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    fake_root = tmp_path / "repo"
    shutil.copytree(ROOT / "protos", fake_root / "protos")
    shutil.copytree(ROOT / "grok", fake_root / "grok")
    stub = fake_root / "grok" / "model" / "v1" / "model_pb2.py"
    stub.write_text(stub.read_text() + "\n# edited\n")
    monkeypatch.setattr(gen_protos, "ROOT", fake_root)
    monkeypatch.setattr(gen_protos, "PROTOS", fake_root / "protos")
    assert gen_protos.check() == 1


def buf() -> str:
    path = ROOT / "node_modules" / ".bin" / "buf"
    # CI installs buf (`make setup`); a missing buf is a broken setup, not a reason to skip the contract.
    assert path.exists(), "buf is not installed: run `make setup` (npm ci installs it into node_modules/)"
    return str(path)


def test_buf_lint_is_clean() -> None:
    result = subprocess.run([buf(), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_breaking_finds_no_break_against_the_committed_baseline() -> None:
    """protos/baseline.binpb is the published API (buf image). A change that breaks it fails here (and in `make
    lint`); accepting one on purpose means regenerating the baseline (`make proto-baseline`) in a reviewed commit."""
    result = subprocess.run([buf(), "breaking", "--against", "protos/baseline.binpb"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_breaking_catches_a_deleted_field(tmp_path) -> None:
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    proto = tmp_path / "protos" / "grok" / "gateway" / "v1" / "gateway.proto"
    text = proto.read_text()
    assert "  int32 top_k = 10;\n" in text
    proto.write_text(text.replace("  int32 top_k = 10;\n", ""))
    result = subprocess.run([buf(), "breaking", "--against", str(ROOT / "protos" / "baseline.binpb")], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode != 0 and "top_k" in result.stdout + result.stderr


def test_contract_names() -> None:
    from grok.gateway.v1 import gateway_pb2
    from grok.model.v1 import model_pb2
    from grok.tokenizer.v1 import tokenizer_pb2

    assert set(tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].methods_by_name) >= {
        "Encode", "Decode", "DecodeStream", "GetInfo"}
    assert set(model_pb2.DESCRIPTOR.services_by_name["ModelService"].methods_by_name) >= {"Generate", "GetInfo"}
    assert set(gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].methods_by_name) >= {
        "Generate", "Complete", "GetInfo"}
    model_fields = set(model_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    assert model_fields >= {"token_ids", "max_tokens", "temperature", "top_p", "seed", "ignore_eos",
                            "top_logprobs", "allowed_token_ids", "blocked_token_ids"}
    assert model_fields >= {"top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                            "logit_bias", "stop_token_ids"}
    gateway_fields = set(gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    assert gateway_fields == {"prompt", "prompt_token_ids", "sampling"}  # the prompt as text or as token ids
    assert gateway_fields == set(gateway_pb2.CompleteRequest.DESCRIPTOR.fields_by_name)
    sampling = gateway_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert set(sampling) >= {"max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos", "top_logprobs",
                             "allowed_token_ids", "blocked_token_ids", "top_k", "min_p", "repetition_penalty",
                             "presence_penalty", "frequency_penalty", "logit_bias", "stop_token_ids"}
    for field in ("seed", "max_tokens", "top_p", "repetition_penalty"):
        assert sampling[field].has_presence
    for message in (gateway_pb2.GenerateRequest, gateway_pb2.CompleteRequest):
        assert message.DESCRIPTOR.fields_by_name["sampling"].message_type is gateway_pb2.SamplingParams.DESCRIPTOR
