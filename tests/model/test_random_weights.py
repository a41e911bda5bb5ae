"""Random weights (--random-init, benchmarks) drawn a block of rows at a time on a pool of threads
(model/params.draw_rows): the values depend on the seed and the shape only."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from model_service.model import params


@pytest.mark.parametrize("threads", [1, 3])
def test_a_drawn_array_is_the_same_whatever_the_threads(monkeypatch, threads: int) -> None:
    monkeypatch.setattr(params, "_DRAW_ROWS", 8)
    monkeypatch.setattr(params, "_THREADED_BYTES", 64)  # threads from 64 bytes on (the array is 222)

    def drawn() -> np.ndarray:
        return params.draw_rows(np.random.default_rng(5), (37, 6), np.int8, params._int8)

    one = drawn()
    monkeypatch.setattr(params, "_threads", lambda: threads)
    again = drawn()
    np.testing.assert_array_equal(one, again)
    assert one.dtype == np.int8 and one.min() >= -127 and len(np.unique(one)) > 100
    # Each block is its own generator's: no two blocks repeat each other.
    assert not any(np.array_equal(one[i:i + 4], one[j:j + 4]) for i in range(0, 32, 8) for j in range(i + 8, 33, 8))


def test_the_table_is_normal_in_bfloat16_with_its_std() -> None:
    table = params._random_table((1500, 64), np.random.default_rng(1))
    assert table.dtype == ml_dtypes.bfloat16
    values = table.astype(np.float32)
    assert abs(values.std() / params.EMB_STD - 1) < 0.02 and abs(values.mean()) < 1e-4
