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


def test_buf_lint_is_clean() -> None:
    buf = ROOT / "node_modules" / ".bin" / "buf"
    # CI installs buf (`make setup`); a missing buf is a broken setup, not a reason to skip the contract.
    assert buf.exists(), "buf is not installed: run `make setup` (npm ci installs it into node_modules/)"
    result = subprocess.run([str(buf), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


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
    gateway_fields = set(gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    assert gateway_fields >= {"prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos",
                              "top_logprobs", "allowed_token_ids", "blocked_token_ids"}
    assert gateway_fields == set(gateway_pb2.CompleteRequest.DESCRIPTOR.fields_by_name)
    assert gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["seed"].has_presence
