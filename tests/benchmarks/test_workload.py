"""Workloads: prompts cut from the project's corpus to exact token counts, length draws, arrivals."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.workload import PromptCutter, WorkloadSpec, arrival_offsets, build, grid, lengths
from tests.procs import GOLDEN, GROK1_TOKENIZER


@pytest.fixture(scope="module")
def grok1_cutter() -> PromptCutter:
    return PromptCutter(GROK1_TOKENIZER)


@pytest.mark.parametrize("n", [1, 7, 32, 128])
def test_a_cut_prompt_encodes_to_exactly_the_asked_tokens_with_the_grok1_tokenizer(grok1_cutter: PromptCutter,
                                                                                    n: int) -> None:
    text, ids = grok1_cutter.cut(n, np.random.default_rng(n))
    assert len(ids) == n
    assert grok1_cutter.encode(text) == list(ids)


def test_fixed_workload_is_deterministic_for_a_seed_and_differs_between_seeds() -> None:
    cutter = PromptCutter(GOLDEN / "tokenizer.model")
    spec = WorkloadSpec("fixed", 16, 8, 5, seed=3)
    first, again = build(spec, cutter), build(spec, cutter)
    assert first == again
    assert all(r.prompt_len == 16 and r.output_len == 8 for r in first)
    other = build(WorkloadSpec("fixed", 16, 8, 5, seed=4), cutter)
    assert [r.prompt for r in other] != [r.prompt for r in first]


def test_random_lengths_stay_within_the_range_ratio_and_vary() -> None:
    spec = WorkloadSpec("random", 100, 40, 200, range_ratio=0.5, seed=0)
    drawn = lengths(spec, np.random.default_rng(0))
    ins, outs = [i for i, _ in drawn], [o for _, o in drawn]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 20
    assert min(outs) >= 20 and max(outs) <= 60


def test_a_workload_that_does_not_fit_the_context_is_refused_with_the_flags_to_change() -> None:
    cutter = PromptCutter(GOLDEN / "tokenizer.model")
    with pytest.raises(ValueError, match="--input-len/--output-len"):
        build(WorkloadSpec("fixed", 100, 64, 1), cutter, context=128)


def test_grid_makes_every_length_combination() -> None:
    specs = grid("fixed", [32, 64], [8, 16], 4, 0.5, 0)
    assert [(s.input_len, s.output_len) for s in specs] == [(32, 8), (32, 16), (64, 8), (64, 16)]
    assert all(s.range_ratio == 0.0 for s in specs)


def test_poisson_arrivals_end_at_n_over_rate_and_burstiness_changes_the_spread() -> None:
    poisson = arrival_offsets(400, rate=4.0, burstiness=1.0, seed=1)
    assert poisson[-1] == pytest.approx(100.0)
    assert poisson == sorted(poisson)
    gaps = np.diff([0.0, *poisson])
    assert np.mean(gaps) == pytest.approx(0.25)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.15)  # exponential: CV 1
    bursty = np.diff([0.0, *arrival_offsets(400, 4.0, burstiness=0.25, seed=1)])
    regular = np.diff([0.0, *arrival_offsets(400, 4.0, burstiness=16.0, seed=1)])
    assert np.std(bursty) / np.mean(bursty) > 1.5 > 0.5 > np.std(regular) / np.mean(regular)
    assert arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
