"""`python -m benchmarks.attack`: attack a fresh local stack with the table of bad and extreme inputs.

Starts tokenizer, one model replica (with the tokenizer's vocabulary, for structured output), the gateway
(gRPC and HTTP) and a second gateway that requires API keys, on 127.0.0.1 (the committed demo model by
default), runs every case of benchmarks/attack_cases.py, attack_http.py and the classes of attack_structured.py
(structured-output abuse), attack_pressure.py (KV pressure), attack_wire.py (tracing headers, HTTP streaming
faults) and attack_tenants.py (cache_salt, API keys), and prints a table
of each case's expected and actual status, then a JSON report. A case passes when its call ends with the
expected status; an error must also name the expected field and leak no internals (exception classes,
addresses, paths), and a success marked `finite` must hold no NaN or infinity. At the end every service
must still answer and still be running. `--quick` is the table alone (CI); the default adds a bounded
slowloris against the HTTP port and truncated gRPC bodies sent with curl. Exit code 0: all as expected.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from benchmarks.attack_cases import UNARY_METHODS, Case, Facts, grpc_cases
from benchmarks.attack_http import HttpError, finite_json, http_cases
from benchmarks.attack_pressure import pressure_cases
from benchmarks.attack_round4 import round4_cases
from benchmarks.attack_slow import slowloris
from benchmarks.attack_structured import structured_cases
from benchmarks.attack_tenants import KEYS, tenant_cases
from benchmarks.attack_wire import streaming_cases, tracing_cases
from benchmarks.chaos_stack import Proc
from grok.gateway.v1 import gateway_pb2_grpc
from grok.model.v1 import model_pb2, model_pb2_grpc
from grok.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from serving_common.errors import details_of
from serving_common.processes import free_port

INTERNALS = ("Traceback", "<class", "Exception", "Error:", "127.0.0.1", "ipv4:", "/tmp/", "site-packages")
TOKENIZER_LIMITS = ("--max-text-bytes", "4096", "--max-batch", "4", "--max-tokens", "256")
PROMPT = "The quick brown fox"


@dataclass
class Targets:
    """Stubs and raw channels to every service, and the gateway's HTTP base URL."""

    gateway: gateway_pb2_grpc.GatewayServiceStub
    tokenizer: tokenizer_pb2_grpc.TokenizerServiceStub
    model: model_pb2_grpc.ModelServiceStub
    channels: dict[str, grpc.Channel]
    http: str
    keyed_gateway: gateway_pb2_grpc.GatewayServiceStub  # the gateway started with --api-key (attack_tenants.KEYS)
    keyed_http: str


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.json", help="model preset or config JSON")
    p.add_argument("--checkpoint", default="demo/checkpoint", help="directory holding ckpt-0/")
    p.add_argument("--tokenizer", default="demo/tokenizer.model", help="SentencePiece model file")
    p.add_argument("--dtype", default="float32", help="model compute dtype")
    p.add_argument("--compile-cache", default=".jax_cache", help="JAX compilation cache")
    p.add_argument("--quick", action="store_true", help="the case table only (CI); no slowloris, no curl")
    p.add_argument("--log-dir", default=None, help="where the services' logs go (default: a temporary folder)")
    p.add_argument("--json-out", default=None, help="also write the JSON report to this file")
    return p.parse_args(argv)


def start(args: argparse.Namespace, log_dir: pathlib.Path) -> tuple[list[Proc], dict[str, int]]:
    """tokenizer, model, gateway (HTTP on), keyed gateway; SERVING when returned, with each gateway's HTTP port."""
    tokenizer_port, model_port, gateway_port, http_port = free_port(), free_port(), free_port(), free_port()
    keyed_port, keyed_http_port = free_port(), free_port()
    tokenizer = Proc("tokenizer", "tokenizer_service", ["--model", args.tokenizer, "--port", str(tokenizer_port),
                                                        *TOKENIZER_LIMITS], tokenizer_port, log_dir)
    model = Proc("model", "model_service", [
        "--config", args.config, "--checkpoint", args.checkpoint, "--dtype", args.dtype, "--port", str(model_port),
        "--slots", "2", "--compile-cache", args.compile_cache, "--tokenizer", args.tokenizer],
        model_port, log_dir)
    gateway = Proc("gateway", "gateway", ["--tokenizer", tokenizer.address, "--model", model.address,
                                          "--port", str(gateway_port), "--http-port", str(http_port)],
                   gateway_port, log_dir)
    keyed = Proc("keyed-gateway", "gateway", ["--tokenizer", tokenizer.address, "--model", model.address,
                                              "--port", str(keyed_port), "--http-port", str(keyed_http_port),
                                              "--api-key", ",".join(KEYS)], keyed_port, log_dir)
    procs = [tokenizer, model, gateway, keyed]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.wait_serving(900)
    except Exception:
        stop(procs)
        raise
    return procs, {"gateway": http_port, "keyed-gateway": keyed_http_port}


def stop(procs: Sequence[Proc]) -> dict[str, int | None]:
    return {p.name: p.terminate() for p in reversed(procs) if p.proc is not None}


def facts_of(targets: Targets) -> Facts:
    info = targets.model.GetInfo(model_pb2.GetInfoRequest(), timeout=30)
    ids = targets.tokenizer.Encode(tokenizer_pb2.EncodeRequest(text=PROMPT), timeout=30).token_ids
    pieces = [p for chunk in targets.tokenizer.GetPieces(tokenizer_pb2.GetPiecesRequest(), timeout=30)
              for p in chunk.pieces]
    return Facts(vocab=info.config.vocab_size, context=info.config.sequence_len, bucket=info.config.sequence_len - 1,
                 prompt=PROMPT, prompt_ids=tuple(ids), slots=info.slots,
                 pieces=tuple(bytes([p.byte_value]) if p.is_byte else p.text.encode() for p in pieces))


def finite_messages(result: Any) -> bool:
    """No NaN anywhere in a gRPC answer (one message or a list); probabilities in [0, 1]; a log-probability
    is finite, or -inf for a probability of exactly 0 (an alternative the filters removed)."""
    messages = result if isinstance(result, list) else [result]
    for message in messages:
        for token in getattr(message, "tokens", ()):
            pairs = [(token.probability, token.logprob)] + [(t.probability, t.logprob) for t in token.top_tokens]
            if not all(_sound(p, lp) for p, lp in pairs):
                return False
    return True


def _sound(probability: float, logprob: float) -> bool:
    if not 0.0 <= probability <= 1.0:  # NaN fails this too
        return False
    return math.isfinite(logprob) or (logprob == -math.inf and probability == 0.0)


def run_case(case: Case, targets: Targets) -> dict[str, Any]:
    """Run one case: what it got, and what was wrong with that (empty: as expected)."""
    began = time.monotonic()
    problems: list[str] = []
    try:
        result = case.call(targets)
        got: str | int = 200 if case.service == "gateway-http" else "OK"
        if "finite" in case.tags:
            body = result[1] if case.service == "gateway-http" else result
            if not (finite_json(body) if case.service == "gateway-http" else finite_messages(result)):
                problems.append("NaN or infinity in the answer")
    except HttpError as error:
        got = error.status
        if "Traceback" in str(error.body) or "Internal Server Error" in str(error.body):
            problems.append(f"body leaks internals: {str(error.body)[:120]}")
    except grpc.RpcError as error:
        got = error.code().name
        message = error.details() or ""
        if got == "INTERNAL" or any(word in message for word in INTERNALS):
            problems.append(f"message: {message[:160]}")
        if case.field and got == case.code and case.field not in message:
            problems.append(f"message does not name {case.field}: {message[:160]}")
        if case.field and got == case.code and case.field != "x-request-id" and case.field not in [
                v.field for v in details_of(error).violations]:
            problems.append(f"no BadRequest violation for {case.field}")
        if case.says and case.says not in message:
            problems.append(f"message lacks {case.says!r}: {message[:160]}")
    except Exception as error:  # noqa: BLE001 - the harness reports it as the case's outcome
        got = type(error).__name__
        problems.append(str(error)[:200])
    if got != case.code:
        problems.insert(0, f"expected {case.code}, got {got}")
    return {"case": case.name, "service": case.service, "expected": case.code, "got": got,
            "passed": not problems, "problems": problems, "seconds": round(time.monotonic() - began, 3)}


def truncated_bodies(channels: dict[str, grpc.Channel], ports: dict[str, int]) -> list[dict[str, Any]]:
    """Each unary method over curl --http2-prior-knowledge, its body's length prefix promising more than it
    holds: a gRPC status must come back (3 or 13), within curl's 10 s limit."""
    if shutil.which("curl") is None:
        return [{"case": "curl-truncated", "passed": False, "problems": ["curl not installed"]}]
    out = []
    with tempfile.NamedTemporaryFile(suffix=".bin") as body:
        body.write(b"\x00\x00\x00\x00\x64\x0a\x02hi")
        body.flush()
        for service, method in UNARY_METHODS:
            headers = subprocess.run(["curl", "-s", "-m", "10", "--http2-prior-knowledge", "-D", "-", "-o", "/dev/null",
                                      "-H", "content-type: application/grpc", "-H", "te: trailers", "--data-binary",
                                      f"@{body.name}", f"http://127.0.0.1:{ports[service]}{method}"],
                                     capture_output=True, text=True, timeout=30).stdout.lower()
            status = next((line.split(":")[1].strip() for line in headers.splitlines()
                           if line.startswith("grpc-status:")), "none")
            out.append({"case": f"{service}-curl-truncated-{method.rsplit('/', 1)[1]}", "service": service,
                        "expected": "3 or 13", "got": status, "passed": status in ("3", "13"), "problems": []})
    return out


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| case | service | expected | got | as expected |", "|---|---|---|---|---|"]
    for r in results:
        note = "yes" if r["passed"] else "NO: " + "; ".join(r["problems"])
        lines.append(f"| {r['case']} | {r.get('service', '')} | {r.get('expected', '')} | {r.get('got', '')} | {note} |")
    return "\n".join(lines)


def cases_of(facts: Facts) -> list[Case]:
    """Every case of the table: the original bad-input and protocol tables, then the third round's classes."""
    return (grpc_cases(facts) + http_cases(facts) + structured_cases(facts) + pressure_cases(facts)
            + tracing_cases(facts) + streaming_cases(facts) + tenant_cases(facts) + round4_cases(facts))


def attack(targets: Targets, procs: Sequence[Proc], http_port: int, quick: bool) -> dict[str, Any]:
    facts = facts_of(targets)
    cases = cases_of(facts)
    results = [run_case(case, targets) for case in cases]
    if not quick:
        ports = {p.name: p.port for p in procs}
        results += truncated_bodies(targets.channels, ports)
        results.append(slowloris(http_port))
    alive = {p.name: p.alive() for p in procs}
    serving = {p.name: p.serving() for p in procs}
    failed = [r["case"] for r in results if not r["passed"]]
    by_service: dict[str, int] = {}
    for r in results:
        by_service[r.get("service", "")] = by_service.get(r.get("service", ""), 0) + 1
    return {"mode": "quick" if quick else "full", "cases": len(results), "by_service": by_service,
            "failed": failed, "alive": alive, "serving_after": serving,
            "passed": not failed and all(alive.values()) and all(serving.values()), "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="attack-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    procs, http_ports = start(args, log_dir)
    address = {p.name: p.address for p in procs}
    channels = {name: grpc.insecure_channel(a) for name, a in address.items()}
    try:
        targets = Targets(gateway_pb2_grpc.GatewayServiceStub(channels["gateway"]),
                          tokenizer_pb2_grpc.TokenizerServiceStub(channels["tokenizer"]),
                          model_pb2_grpc.ModelServiceStub(channels["model"]), channels,
                          f"http://127.0.0.1:{http_ports['gateway']}",
                          gateway_pb2_grpc.GatewayServiceStub(channels["keyed-gateway"]),
                          f"http://127.0.0.1:{http_ports['keyed-gateway']}")
        report = attack(targets, procs, http_ports["gateway"], args.quick)
    finally:
        for channel in channels.values():
            channel.close()
        exit_codes = stop(procs)
    report.update(exit_codes=exit_codes, seconds=round(time.monotonic() - began, 1), log_dir=str(log_dir))
    report["passed"] = report["passed"] and set(exit_codes.values()) == {0}
    print(table(report["results"]))
    print(f"\n{report['cases']} cases ({report['mode']}), {len(report['failed'])} not as expected; "
          f"services alive and serving after: {all(report['serving_after'].values())}; exit codes {exit_codes}")
    summary = {k: v for k, v in report.items() if k != "results"}
    print(json.dumps(summary, indent=1))
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
