"""Parity with the reference's recorded outputs (../shared/golden) on meshes (1,1) and (1,8)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.model.conftest import RowRunner

PAD_TO = 64
PROMPTS = range(4)
MESHES = ["1,1", "1,8"]
STEPS = 24


# This project's own bounds, not the reference's (golden/README.md gives 0.3 for bfloat16 prefill logits and no
# figure for decode steps): the mean absolute error of a teacher-forced bfloat16 step's logits, median over the
# steps and the level 90 % of steps stay under. Tighter than 0.3 so that a drift in the decode path shows.
BF16_STEP_MEDIAN = 0.05
BF16_STEP_MOST = 0.1
# float32 logits against the reference's (recorded on a CPU): 1e-4 on CPU. On a TPU the faithful mode
# (Products.EXACT) carries every product to float32 accuracy and asks for the accurate transcendentals
# (model/transcendental.py): measured on a v5e (JAX 0.10.2, golden dense pass and paged prefill, c2b02d7) within
# 1.3e-5 of the reference over every prompt position (before them: ~1e-3, and the 64-token prompt's router flipped
# at position 33). The teacher-forced decode steps have not been measured against 1e-4 on the chip: the bound
# there stays 2e-3 until they are. Greedy ids must be identical on every platform.
F32_ATOL = 1e-4 if jax.default_backend() == "cpu" else 2e-3


def _padded(prompt: np.ndarray) -> np.ndarray:
    toks = np.zeros((1, PAD_TO), np.int32)
    toks[0, : len(prompt)] = prompt
    return toks


def _prefill_all(loaded, gold):
    """Every prompt's rows in one step (prompt p is sequence p): each prompt's last logits."""
    runner = RowRunner(loaded, len(PROMPTS))
    rows = [(p, i, int(t)) for p in PROMPTS for i, t in enumerate(gold[f"p{p}_prompt"])]
    logits = runner.run(rows)
    ends = np.cumsum([len(gold[f"p{p}_prompt"]) for p in PROMPTS]) - 1
    return runner, {p: logits[ends[p]] for p in PROMPTS}


def _decode_batch(loaded, gold, runner, first_tokens, forced=None):
    """Decode the four prompts side by side (one row each per step, different positions). forced: [4, STEPS]
    tokens to feed instead of the argmax (teacher forcing). Returns (tokens [4, STEPS], logits [4, STEPS, V])."""
    lengths = [len(gold[f"p{p}_prompt"]) for p in PROMPTS]
    tokens, logits = [np.asarray(first_tokens)], []
    current = np.asarray(first_tokens if forced is None else forced[:, 0])
    for step in range(1, STEPS):
        step_logits = runner.run([(p, lengths[p] + step - 1, int(current[p])) for p in PROMPTS])
        logits.append(step_logits)
        chosen = step_logits.argmax(-1)
        tokens.append(chosen)
        current = chosen if forced is None else forced[:, step]
    return np.stack(tokens, 1), np.stack(logits, 1)


@pytest.mark.parametrize("mesh", MESHES)
def test_float32_prefill_full_logits_and_greedy_match_reference(golden_model, golden_npz, mesh):
    loaded, gold = golden_model(mesh, "float32"), golden_npz["fp32"]
    runner, prefilled = _prefill_all(loaded, gold)
    full = np.asarray(loaded.forward(loaded.params, jnp.asarray(np.concatenate(
        [_padded(gold[f"p{p}_prompt"]) for p in PROMPTS]))))
    first = []
    for p in PROMPTS:
        n = len(gold[f"p{p}_prompt"])
        last = prefilled[p]
        np.testing.assert_allclose(last, gold[f"p{p}_prefill_last_logits"], atol=F32_ATOL, rtol=0)
        np.testing.assert_allclose(full[p, :n], gold[f"p{p}_full_logits"], atol=F32_ATOL, rtol=0)
        first.append(last.argmax())
    tokens, logits = _decode_batch(loaded, gold, runner, np.array(first))
    for p in PROMPTS:
        np.testing.assert_array_equal(tokens[p], gold[f"p{p}_greedy_tokens"], err_msg=f"prompt {p}")
        np.testing.assert_allclose(logits[p], gold[f"p{p}_step_logits"][1:], atol=F32_ATOL, rtol=0)


@pytest.mark.parametrize("mesh", MESHES)
def test_bfloat16_prefill_logits_and_confident_greedy_steps_match_reference(golden_model, golden_npz, mesh):
    loaded, gold = golden_model(mesh, "bfloat16"), golden_npz["bf16"]
    runner, prefilled = _prefill_all(loaded, gold)
    first = []
    for p in PROMPTS:
        last = prefilled[p]
        assert np.abs(last - gold[f"p{p}_prefill_last_logits"]).max() < 0.3, f"prompt {p}"
        first.append(last.argmax())
    tokens, _ = _decode_batch(loaded, gold, runner, np.array(first))
    # Teacher-forced with the recorded tokens, every decode step is comparable with the recorded logits.
    forced = np.stack([gold[f"p{p}_greedy_tokens"] for p in PROMPTS])
    runner, _ = _prefill_all(loaded, gold)
    _, forced_logits = _decode_batch(loaded, gold, runner, forced[:, 0], forced=forced)
    for p in PROMPTS:
        margins = gold[f"p{p}_top2_margin"]
        confident = np.cumprod(margins >= 0.3).astype(bool)  # up to the first low-margin step
        np.testing.assert_array_equal(tokens[p][confident], gold[f"p{p}_greedy_tokens"][confident])
        sure = margins[1:] >= 0.3
        np.testing.assert_array_equal(forced_logits[p].argmax(-1)[sure], forced[p, 1:][sure], err_msg=f"prompt {p}")
        # bfloat16 paths drift between equivalent programs and an occasional low-margin routing flip moves one
        # step (golden/README.md); typical steps stay close to the recorded logits.
        step_err = np.abs(forced_logits[p] - gold[f"p{p}_step_logits"][1:]).mean(-1)
        assert np.median(step_err) < BF16_STEP_MEDIAN and np.mean(step_err < BF16_STEP_MOST) >= 0.9, \
            f"prompt {p}: {step_err}"
