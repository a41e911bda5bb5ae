"""scripts/run_stack.py takes every tokenizer, model and gateway flag (scripts/stack_flags.py): by its own name, or
as --<service>-<flag> for one service, generated from the services' own parsers."""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys

import pytest

from scripts import stack_flags
from scripts.run_stack import client_key, parse_args
from scripts.stack_endpoints import listener
from scripts.stack_flags import MANAGED, PREFIXED_EVEN_IF_MANAGED, service_actions, service_args
from tests.procs import ROOT

SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 4})


def given(argv: list[str]) -> dict[str, list[str]]:
    args = parse_args(argv)
    return {service: service_args(args, args.passes, service) for service in ("tokenizer", "model", "gateway")}


def test_a_flag_of_one_service_passes_by_its_own_name_to_that_service_only() -> None:
    passed = given(["--speculative-config", SPECULATIVE, "--kv-tokens", "4096", "--served-model-name", "mine",
                    "--random-init", "--max-batch", "8"])
    assert passed["model"] == ["--random-init", "--kv-tokens", "4096", "--speculative-config", SPECULATIVE]
    assert passed["gateway"] == ["--served-model-name", "mine"]
    assert passed["tokenizer"] == ["--max-batch", "8"]


def test_a_shared_flag_goes_to_every_service_and_its_prefixed_form_to_one_which_it_overrides() -> None:
    passed = given(["--model-grace-seconds", "30", "--otlp-endpoint", "http://jaeger:4317", "--grace-seconds", "5",
                    "--gateway-log-level", "debug"])
    for service in ("tokenizer", "model", "gateway"):
        assert passed[service][:4] == ["--grace-seconds", "5", "--otlp-endpoint", "http://jaeger:4317"], passed
    assert passed["model"][4:] == ["--grace-seconds", "30"]  # after the plain form: argparse keeps the last
    assert passed["gateway"][4:] == ["--log-level", "debug"]  # after the launcher's --log-level (start() order)
    assert passed["tokenizer"][4:] == []


def test_a_service_flag_named_like_a_launcher_flag_is_reached_by_its_prefixed_form() -> None:
    args = parse_args(["--max-tokens", "5", "--tokenizer-max-tokens", "4096", "--model-startup-timeout", "99"])
    assert args.max_tokens == 5  # the sample's length, the launcher's own
    assert service_args(args, args.passes, "tokenizer") == ["--max-tokens", "4096"]
    assert service_args(args, args.passes, "model") == ["--startup-timeout", "99"]


def test_every_flag_of_every_service_is_accepted_unless_the_launcher_sets_it() -> None:
    args = parse_args([])
    for service in ("tokenizer", "model", "gateway"):
        options = service_actions(service)
        assert options, service
        reachable = {p.flag for p in args.passes if service in p.services}
        expected = {o for o in options if o not in MANAGED[service] or o in PREFIXED_EVEN_IF_MANAGED}
        assert reachable == expected, (service, expected ^ reachable)
        assert MANAGED[service] <= set(options), f"{service}: MANAGED names a flag the service no longer has"


def test_a_flag_added_to_a_service_comes_through_without_a_change_to_the_launcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def model_with_knob() -> argparse.ArgumentParser:
        from model_service.__main__ import parser

        p = parser()
        p.add_argument("--new-knob", default=None, help="a flag the launcher has never heard of")
        return p

    monkeypatch.setitem(stack_flags.BUILDERS, "model", model_with_knob)
    assert given(["--new-knob", "7"])["model"] == ["--new-knob", "7"]


def test_a_bad_value_is_refused_with_the_service_s_own_message_before_anything_starts() -> None:
    done = subprocess.run([sys.executable, "scripts/run_stack.py", "--kv-tokens", "-3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--kv-tokens" in done.stderr and "-3 is not a positive integer" in done.stderr
    assert "run_stack: started" not in done.stdout
    done = subprocess.run([sys.executable, "scripts/run_stack.py", "--prefix-caching", "maybe"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'maybe'" in done.stderr


def test_help_lists_the_services_flags_and_the_prefixed_form() -> None:
    done = subprocess.run([sys.executable, "scripts/run_stack.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    for text in ("--speculative-config", "--otlp-endpoint", "--served-model-name", "--tokenizer-max-tokens",
                 "--SERVICE-FLAG", "[tokenizer, model, gateway]"):
        assert text in done.stdout, text


def test_the_sample_sends_a_key_from_a_passed_api_key_file(tmp_path: pathlib.Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-file\n")
    assert client_key(parse_args(["--api-key-file", str(keys)]), {}) == "sk-file"
    assert given(["--api-key-file", str(keys)])["gateway"] == ["--api-key-file", str(keys)]


def test_docs_running_md_make_run_examples_parse_as_written(tmp_path: pathlib.Path) -> None:
    """Each `make run ARGS=...` line of docs/running.md, expanded by make and the shell as written, is accepted."""
    text = (ROOT / "docs" / "running.md").read_text(encoding="utf-8")
    examples = [line for line in text.splitlines() if line.startswith("make run ARGS=")]
    assert len(examples) >= 2
    for example in examples:
        command = example.replace("make run", f"make --no-print-directory -n run VENV={tmp_path}/venv", 1)
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        launched = done.stdout.splitlines()[-1]
        argv = shlex.split(launched.split("scripts/run_stack.py", 1)[1])
        args = parse_args(argv)
        if args.uds_dir:  # the launcher's own: every listener on a socket file there
            assert listener(args, "gateway").args == ("--uds", f"{args.uds_dir}/gateway.sock"), example
            continue
        assert any(service_args(args, args.passes, s) for s in ("tokenizer", "model", "gateway")), example
        if "--speculative-config" in argv:
            spec = service_args(args, args.passes, "model")
            assert json.loads(spec[spec.index("--speculative-config") + 1])["method"] == "ngram"


def test_a_socket_flag_several_services_take_has_only_per_service_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    """One path for two services' listening sockets would collide: a socket flag the tokenizer and the model both
    take is `--tokenizer-FLAG` / `--model-FLAG` only; one only the gateway takes keeps its plain name. (`--uds` and
    `--http-uds` themselves are the launcher's: tests/test_stack_endpoints.py.)"""
    def with_flag(build: object, flag: str) -> object:
        def parser() -> argparse.ArgumentParser:
            p = build()  # type: ignore[operator]
            p.add_argument(flag, default=None, help="listen on this unix socket too")
            return p
        return parser

    for service, flag in (("tokenizer", "--admin-socket"), ("model", "--admin-socket"),
                          ("gateway", "--debug-socket")):
        monkeypatch.setitem(stack_flags.BUILDERS, service, with_flag(stack_flags.BUILDERS[service], flag))
    passed = given(["--tokenizer-admin-socket", "/tmp/t.sock", "--model-admin-socket", "/tmp/m.sock",
                    "--debug-socket", "/tmp/d.sock"])
    assert passed == {"tokenizer": ["--admin-socket", "/tmp/t.sock"], "model": ["--admin-socket", "/tmp/m.sock"],
                      "gateway": ["--debug-socket", "/tmp/d.sock"]}
    with pytest.raises(SystemExit):
        parse_args(["--admin-socket", "/tmp/both.sock"])
