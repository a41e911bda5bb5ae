"""A --tls-key that is not the key of --tls-cert stops each service at start-up with one line naming
the mismatch and both flags (it used to fail later, as "could not bind ... (in use)" under a traceback,
though the port was free)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from serving_common.tls import server_tls
from tests.certs import make_pki
from tests.procs import GROK1_TOKENIZER, ROOT, free_port


def test_server_tls_refuses_a_key_of_another_certificate(tmp_path: pathlib.Path) -> None:
    pki = make_pki(tmp_path)
    with pytest.raises(ValueError, match="--tls-key.*does not match.*--tls-cert"):
        server_tls(str(pki.server_cert), str(pki.client_key))


@pytest.mark.parametrize("module", ["tokenizer_service", "gateway", "model_service"])
def test_each_service_exits_with_one_line_naming_the_mismatch(tmp_path: pathlib.Path, module: str) -> None:
    pki = make_pki(tmp_path)
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.client_key)]
    args = {"tokenizer_service": ["--model", str(GROK1_TOKENIZER), "--port", str(free_port())],
            "gateway": ["--tokenizer", "127.0.0.1:1", "--model", "127.0.0.1:2", "--port", "0", "--http-port", "0"],
            "model_service": ["--config", "configs/demo.json", "--random-init", "--port", str(free_port())]}[module]
    result = subprocess.run([sys.executable, "-m", module, *args, *tls], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "in use" not in result.stderr
    problem = [line for line in result.stderr.splitlines() if "does not match" in line]
    assert len(problem) == 1 and "--tls-key" in problem[0] and "--tls-cert" in problem[0], result.stderr
