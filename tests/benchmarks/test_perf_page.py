"""docs/performance.md holds exactly what benchmarks.render_docs writes from benchmarks/measured/, and each row's
make command runs its benchmarks module with the settings its JSON was measured with."""

from __future__ import annotations

import json
import pathlib
import shlex
import shutil
import subprocess
from typing import Any

import pytest

from benchmarks import render_docs
from benchmarks.perf_rows import CHANGES, CPU, ERRORS, TPU, Change, Row
from tests.procs import ROOT

ITEMS = [*CPU, *TPU, *CHANGES, ERRORS]
SOURCES = sorted({item.source for item in ITEMS})
MARKED = "\n".join(["# A page", "prose stays", *(f"{render_docs.begin(n)}\nold\n{render_docs.end(n)}\ntext {n}"
                                                 for n in ("CPU", "TPU", "CHANGES", "ERRORS", "SOURCES"))])


def test_the_page_holds_what_the_measured_json_renders() -> None:
    assert render_docs.stale(render_docs.PAGE, render_docs.MEASURED) == [], \
        "run `python -m benchmarks.render_docs` (make bench-page) after changing benchmarks/measured or perf_rows.py"


def test_a_number_changed_in_the_json_fails_the_check(tmp_path: pathlib.Path) -> None:
    for name in SOURCES:
        if (render_docs.MEASURED / name).exists():
            shutil.copy(render_docs.MEASURED / name, tmp_path / name)
    report = json.loads((tmp_path / "as-user-medium-session-end-23.json").read_text())
    report["points"]["streams1"]["now"]["aggregate_tok_s"] += 1.0
    (tmp_path / "as-user-medium-session-end-23.json").write_text(json.dumps(report))
    assert render_docs.main(["--check", "--measured", str(tmp_path)]) == 1
    assert render_docs.stale(render_docs.PAGE, tmp_path) == ["CPU"]


def test_a_row_without_its_json_says_not_measured_yet(tmp_path: pathlib.Path) -> None:
    lines = render_docs.table(TPU, render_docs.loader(tmp_path), llamacpp=False)
    assert len(lines) == 2 + len(TPU)
    for line in lines[2:]:
        ours = line.split(" | ")[1]
        assert ours == render_docs.NOT_MEASURED
    assert all(render_docs.NOT_MEASURED in line for line in render_docs.sources(TPU, (), render_docs.loader(tmp_path)))


def device_report(**point: float) -> dict[str, Any]:
    """benchmarks.device's report as the page reads it (tests/benchmarks/test_device_benchmark.py runs the tool)."""
    return {"table": {row.ours[0].path[1]: point for row in TPU}}


def test_a_measured_tpu_row_shows_the_device_tools_numbers(tmp_path: pathlib.Path) -> None:
    point = {"ms": 4.115, "pipelined_ms": 2.018, "tokens_per_s": 243.0, "bound_ms": 0.2552, "over_bound": 16.12}
    (tmp_path / "device-tpu-v5e.json").write_text(json.dumps(device_report(**point)))
    lines = render_docs.table(TPU, render_docs.loader(tmp_path), llamacpp=False)
    assert lines[2].startswith("| medium, 1 stream | 4.12 ms a step / 2.02 ms overlapped / 243 tok/s | 0.26 ms: ")
    assert "step / bound 16.12x" in lines[2]
    assert "| medium, 8 x 32-token prompts in one step | 4.1 ms / 243 tok/s | " in lines[5]


def test_rendering_rewrites_only_the_marked_blocks_and_twice_changes_nothing(tmp_path: pathlib.Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(MARKED)
    assert render_docs.main(["--page", str(page)]) == 0
    once = page.read_text()
    assert "prose stays" in once and "text SOURCES" in once and "\nold\n" not in once
    assert "| medium, 1 sampled stream (speed.py, default flags) | 95.5 tok/s | 134.6 tok/s | 0.71x |" in once
    assert render_docs.main(["--page", str(page)]) == 0 and page.read_text() == once
    assert render_docs.main(["--check", "--page", str(page)]) == 0


def test_a_page_without_a_block_is_refused_by_name(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    page = tmp_path / "page.md"
    page.write_text(MARKED.replace(render_docs.end("TPU"), ""))
    assert render_docs.main(["--page", str(page)]) == 2
    assert "the page has no <!-- BEGIN TPU" in capsys.readouterr().err


def test_a_json_without_a_rows_number_is_named(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "device-tpu-v5e.json").write_text(json.dumps(device_report(ms=4.1, pipelined_ms=2.0)))
    page = tmp_path / "page.md"
    page.write_text(MARKED)
    assert render_docs.main(["--page", str(page), "--measured", str(tmp_path)]) == 2
    assert "device-tpu-v5e.json has no table.medium_bfloat16_decode_1.tokens_per_s" in capsys.readouterr().err


def make_command(item: Row | Change) -> list[str]:
    """The benchmark command line `make -n` prints for the item's make command (its JSON's line for bench-tpu)."""
    target, *variables = shlex.split(item.make)[1:]
    run = subprocess.run(["make", "-n", "--no-print-directory", target, "PY=python", "BEFORE=", "LLAMACPP=",
                          "BENCH_ARGS=", "CGROUP=", *variables], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = [line for line in run.stdout.replace("\\\n", " ").splitlines() if f"-m benchmarks.{item.module} " in line]
    if len(lines) > 1:
        lines = [line for line in lines if line.rstrip().endswith(item.source)]
    assert len(lines) == 1, (item.make, run.stdout)
    words = shlex.split(lines[0].split(">")[0])
    return words[words.index(f"benchmarks.{item.module}") + 1:]


def flags(words: list[str]) -> dict[str, str]:
    """--flag value pairs (the last one wins, as argparse takes them); a flag with no value maps to ""."""
    out: dict[str, str] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            following = words[i + 1] if i + 1 < len(words) else "--"
            out[word] = "" if following.startswith("--") else following
    return out


def check_engine(f: dict[str, str], report: dict[str, Any]) -> None:
    wide = "--grok1-width" in f
    settings = report["settings"]
    assert int(f["--runs"]) == settings["runs"]
    assert int(f.get("--tokens", 128)) == settings["tokens"]
    modes = f.get("--modes", "greedy" if wide else "sampled,greedy")
    assert modes.split(",") == settings["modes"]
    points = f.get("--points", "slots1_stream1,slots8_streams8" if wide else
                   "slots1_stream1,slots8_streams8,slots16_stream1")
    assert points.split(",") == list(report["points"])
    assert settings["config"].endswith("grok1-width-1layer.json" if wide else "medium.json")
    assert any("llamacpp" in p for p in report["points"].values()) == ("--llamacpp" in f)


def check_as_user(f: dict[str, str], report: dict[str, Any]) -> None:
    assert [f"streams{s}" for s in f.get("--streams", "1,8").split(",")] == list(report["points"])
    assert {len(p["now"]["runs"]) for p in report["points"].values()} == {int(f["--runs"])}
    assert int(f.get("--tokens", 128)) == report["tokens"] and report["flags"] == ""
    assert (report.get("cgroup") is not None) == ("--cgroup" in f)
    assert all("llamacpp" in p for p in report["points"].values()) == ("--llamacpp" in f)


def check_long_prompt(f: dict[str, str], report: dict[str, Any]) -> None:
    assert int(f.get("--context", 8192)) == report["context"] and int(f.get("--streams", 7)) == report["streams"]
    assert int(f.get("--prompt", 6000)) == report["now"]["long_prompt_tokens"]
    assert ("llamacpp" in report) == ("--llamacpp" in f)


def check_speculative(f: dict[str, str], report: dict[str, Any]) -> None:
    assert json.loads(f["--spec"]) == report["spec"]
    assert f["--workloads"].split(",") == [k for k in report if k != "spec"]


def check_device(f: dict[str, str], report: dict[str, Any]) -> None:
    measured = {p["config"] for p in report["points"]} | ({"parity"} if report["parity"] else set())
    assert measured == set(f["--points"].split(",")) and report["device"]["platform"] == "tpu"
    assert {c["set"] for c in report["parity"]} == set(f["--sets"].split(","))
    assert {p["dtype"] for p in report["points"]} == {"bfloat16"}  # the tool's default --dtype


def check_activation_error(f: dict[str, str], report: dict[str, Any]) -> None:
    assert f.get("--sets", "golden,golden_wide").split(",") == [r["set"] for r in report["results"]]


CHECKS = {"engine": check_engine, "as_user": check_as_user, "long_prompt": check_long_prompt,
          "speculative": check_speculative, "device": check_device, "activation_error": check_activation_error}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("item", ITEMS, ids=[f"{i.make.split()[1]}:{i.point}" for i in ITEMS])
def test_each_rows_make_command_runs_its_module_as_its_json_was_measured(item: Row | Change) -> None:
    words = make_command(item)
    path = render_docs.MEASURED / item.source
    if not path.exists():
        pytest.skip(f"{item.source} is not measured yet")
    CHECKS[item.module](flags(words), json.loads(path.read_text()))
