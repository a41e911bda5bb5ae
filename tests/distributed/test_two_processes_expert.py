"""One replica as 2 processes with an expert axis across them (mesh DATA,EXPERT,MODEL = 1,2,1, one CPU device per
process): each process holds and reads half of every layer's experts, and the seeded and greedy golden requests
reproduce the reference."""

from __future__ import annotations

import concurrent.futures
import pathlib
from collections.abc import Iterator

import numpy as np
import pytest

from grok.model.v1 import model_pb2
from tests.distributed.test_two_processes import Group, generate
from tests.engine.conftest import golden_message, golden_requests
from tests.procs import GOLDEN


@pytest.fixture(scope="module")
def expert_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    g = Group(tmp_path_factory.mktemp("expert_group"), mesh="1,2,1")
    try:
        yield g.wait_serving()
    finally:
        g.close()


def test_golden_requests_reproduce_the_reference_with_experts_split_over_two_processes(expert_group: Group) -> None:
    gold = np.load(GOLDEN / "model_fp32.npz")
    seeded = [golden_message(c) for c in golden_requests()]
    greedy = [model_pb2.GenerateRequest(token_ids=gold[f"p{p}_prompt"].tolist(), temperature=0.0, max_tokens=24,
                                        ignore_eos=True) for p in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(seeded) + len(greedy)) as pool:
        outputs = list(pool.map(lambda r: generate(expert_group.stub, r), seeded + greedy))
    assert outputs[:len(seeded)] == [c["output_ids"] for c in golden_requests()]
    assert outputs[len(seeded):] == [gold[f"p{p}_greedy_tokens"].tolist() for p in range(4)]


def test_each_process_reads_its_own_experts_and_the_shared_rest(expert_group: Group) -> None:
    ckpt: pathlib.Path = GOLDEN / "checkpoint" / "ckpt-0"
    total = sum(f.stat().st_size for f in ckpt.iterdir())
    reads = {}
    for service in (expert_group.leader, expert_group.follower):
        ready = next(r for r in service.log_records() if r.get("msg") == "weights ready")
        reads[ready["process_id"]] = ready["bytes_read"]
    assert set(reads) == {0, 1}
    # the experts (most of golden's bytes) are split in half; attention, table, router and norms are read whole
    for read in reads.values():
        assert 0.5 * total < read < 0.75 * total, (reads, total)
