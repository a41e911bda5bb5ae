"""benchmarks.load's processes on the golden checkpoint: each reports its reads, its time, its peak memory and what
it keeps, and two processes of a group each read less than one process alone (the timing run itself is not a test:
it measures)."""

from __future__ import annotations

from benchmarks.load import run_group
from tests.benchmarks.recorded import recorded
from tests.procs import GOLDEN


def test_each_loading_process_reports_its_reads_and_memory_and_a_group_splits_the_experts() -> None:
    config, checkpoint = GOLDEN / "config.json", GOLDEN / "checkpoint"
    (alone,) = run_group(config, checkpoint, "1,2,4", 1)
    pair = run_group(config, checkpoint, "1,2,4", 2)
    assert [r["process_id"] for r in pair] == [0, 1] and [r["local_devices"] for r in pair] == [4, 4]
    for report in (alone, *pair):
        assert recorded(report["seconds"])
        assert 0 < report["read_calls"] <= report["syscr"] and 0 < report["bytes_read"] <= report["rchar"]
        assert 0 < report["kept_distinct"] <= report["kept"] and report["peak_over_baseline"] > 0
    assert alone["rchar"] >= 0.9 * sum(f.stat().st_size for f in (checkpoint / "ckpt-0").iterdir())  # every tensor
    for report in pair:
        assert report["bytes_read"] < 0.75 * alone["bytes_read"]
