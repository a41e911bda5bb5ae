"""One golden set's parity on this process's device (started by benchmarks.device): the reference's recorded
outputs against the model's, in float32 and bfloat16; prints one JSON line.

    python benchmarks/device_parity.py --set ../shared/golden --dtypes float32,bfloat16 [--f32-atol 1e-4]

Run by path with the measured checkout first on PYTHONPATH (its model and the parity tests' RowRunner, so the
rows go through what tests/model/test_parity.py runs). For each prompt of the set, with the model as the service
builds it for the platform (default products and attention): the prefill's last logits, the full-prompt logits
where the set recorded them (`forward`), the greedy ids of a free-running decode (the prompts side by side, one
row each a step), and the logits of every decode step teacher-forced with the reference's greedy ids, each against
the recording. A case passes by the parity tests' own bounds:
  float32   every greedy id equal, every logit within --f32-atol (the tests' 1e-4);
  bfloat16  against the set's bfloat16 recording: the prefill's last logits within 0.3, greedy ids equal up to the
            first step whose recorded top-2 margin is under 0.3, teacher-forced argmax equal where the margin is
            at least 0.3, the median step's mean |error| under 0.05 and 90 % of steps under 0.1. A set without a
            bfloat16 recording (golden_wide) is measured against its float32 one and not judged (pass: null).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import numpy as np

BF16_PREFILL = 0.3
BF16_MARGIN = 0.3
BF16_STEP_MEDIAN = 0.05
BF16_STEP_MOST = 0.1


def _runs(loaded: Any, gold: dict[str, np.ndarray], prompts: range, forced: np.ndarray | None) -> tuple[Any, ...]:
    """Prefill every prompt in one call, then decode them side by side: (prefill last logits [N, V], the ids
    [N, S], the decode steps' logits [N, S-1, V]); `forced` [N, S]: feed these ids instead of the argmax."""
    from tests.model.conftest import RowRunner

    runner = RowRunner(loaded, len(prompts))
    lengths = [len(gold[f"p{p}_prompt"]) for p in prompts]
    logits = runner.run([(p, i, int(t)) for p in prompts for i, t in enumerate(gold[f"p{p}_prompt"])])
    last = logits[np.cumsum(lengths) - 1]
    steps = gold["p0_greedy_tokens"].shape[0]
    current = last.argmax(-1) if forced is None else forced[:, 0]
    tokens, step_logits = [current], []
    for step in range(1, steps):
        out = runner.run([(p, lengths[p] + step - 1, int(current[p])) for p in prompts])
        step_logits.append(out)
        tokens.append(out.argmax(-1))
        current = tokens[-1] if forced is None else forced[:, step]
    return last, np.stack(tokens, 1), np.stack(step_logits, 1)


def _full(loaded: Any, gold: dict[str, np.ndarray], prompts: range) -> np.ndarray | None:
    if "p0_full_logits" not in gold:
        return None
    import jax.numpy as jnp

    pad = int(gold["pad_to"])
    toks = np.zeros((len(prompts), pad), np.int32)
    for p in prompts:
        toks[p, :len(gold[f"p{p}_prompt"])] = gold[f"p{p}_prompt"]
    return np.asarray(loaded.forward(loaded.params, jnp.asarray(toks)))


def compare(gold: dict[str, np.ndarray], p: int, last: np.ndarray, ids: np.ndarray, forced_logits: np.ndarray,
            full: np.ndarray | None) -> dict[str, Any]:
    """One prompt's outputs against the recording (ids [S], forced_logits [S-1, V])."""
    ref_ids, margins = gold[f"p{p}_greedy_tokens"], gold[f"p{p}_top2_margin"]
    step_err = np.abs(forced_logits - gold[f"p{p}_step_logits"][1:])
    wrong = np.flatnonzero(ids != ref_ids)
    out = {"prompt": p, "prompt_len": int(len(gold[f"p{p}_prompt"])), "steps": int(len(ref_ids)),
           "greedy_ids_equal": not len(wrong), "first_wrong_step": int(wrong[0]) if len(wrong) else None,
           "greedy_ids_agree": int((ids == ref_ids).sum()),
           "prefill_max_error": float(np.abs(last - gold[f"p{p}_prefill_last_logits"]).max()),
           "steps_max_error": float(step_err.max()),
           "step_mean_error_median": float(np.median(step_err.mean(-1))),
           "steps_mean_error_under_0.1": float(np.mean(step_err.mean(-1) < BF16_STEP_MOST)),
           "min_reference_margin": float(margins.min())}
    confident = np.cumprod(margins >= BF16_MARGIN).astype(bool)
    out["confident_ids_equal"] = bool((ids[confident] == ref_ids[confident]).all())
    sure = margins[1:] >= BF16_MARGIN
    out["forced_sure_argmax_equal"] = bool((forced_logits.argmax(-1)[sure] == ref_ids[1:][sure]).all())
    if full is not None:
        n = out["prompt_len"]
        out["full_max_error"] = float(np.abs(full[p, :n] - gold[f"p{p}_full_logits"]).max())
    return out


def verdict(dtype: str, reference: str, prompts: list[dict[str, Any]], f32_atol: float) -> tuple[bool | None, str]:
    """Whether the case passes, and the bound it was judged by."""
    if dtype == "float32":
        worst = max(max(r["prefill_max_error"], r["steps_max_error"], r.get("full_max_error", 0.0)) for r in prompts)
        ok = all(r["greedy_ids_equal"] for r in prompts) and worst <= f32_atol
        return ok, f"every greedy id equal and every logit within {f32_atol:g} (largest error {worst:.3g})"
    if reference != "bfloat16":
        return None, "not judged: no bfloat16 recording; errors are against the float32 one"
    ok = all(r["prefill_max_error"] < BF16_PREFILL and r["confident_ids_equal"] and r["forced_sure_argmax_equal"]
             and r["step_mean_error_median"] < BF16_STEP_MEDIAN and r["steps_mean_error_under_0.1"] >= 0.9
             for r in prompts)
    return ok, (f"prefill logits within {BF16_PREFILL}, ids equal where the recorded margin is >= {BF16_MARGIN}, "
                f"median step error < {BF16_STEP_MEDIAN}, 90 % of steps < {BF16_STEP_MOST}")


def case(golden: pathlib.Path, dtype: str, f32_atol: float, moe: str = "auto", layers: str = "auto") -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from model_service.checkpoint import load_params
    from model_service.config import MeshConfig, load_model_config
    from model_service.model import GrokModel
    from model_service.sharding import make_mesh
    from tests.model.conftest import Loaded

    start = time.perf_counter()
    cfg = load_model_config(str(golden / "config.json"))
    mesh = make_mesh(MeshConfig(1, 1))
    from model_service.backend import choose_backend

    # --moe / --layers other than auto only: a checkout measured with --repo may predate the arguments
    chosen = {k: v for k, v in (("moe", moe), ("layers", layers)) if v != "auto"}
    backend = choose_backend("auto", mesh, jnp.dtype(dtype), **chosen) if chosen else None
    model = GrokModel(cfg, mesh, jnp.dtype(dtype), backend=backend)
    # pack_params: the layout the backend runs (a checkout measured with --repo may predate load_params' arguments)
    params = model.pack_params(load_params(str(golden / "checkpoint"), cfg, mesh, jnp.dtype(dtype),
                                           pack=model.products.native, stacked=model.backend.stacked_experts))
    loaded = Loaded(cfg, model, params, jax.jit(model.forward))
    reference = "bfloat16" if dtype == "bfloat16" and (golden / "model_bf16.npz").exists() else "float32"
    gold = dict(np.load(golden / f"model_{'bf16' if reference == 'bfloat16' else 'fp32'}.npz"))
    prompts = range(len(gold["prompt_lengths"]))
    last, ids, _ = _runs(loaded, gold, prompts, None)
    forced = np.stack([gold[f"p{p}_greedy_tokens"] for p in prompts])
    _, _, forced_logits = _runs(loaded, gold, prompts, forced)
    full = _full(loaded, gold, prompts)
    rows = [compare(gold, p, last[p], ids[p], forced_logits[p], full) for p in prompts]
    ok, criterion = verdict(dtype, reference, rows, f32_atol)
    return {"set": golden.name, "dtype": dtype, "moe": model.backend.moe, "reference": reference, "pass": ok,
            "criterion": criterion,
            "products": model.products.value, "seconds": round(time.perf_counter() - start, 2), "prompts": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", required=True, type=pathlib.Path, help="a golden directory (config, checkpoint, npz)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--f32-atol", type=float, default=1e-4, help="float32 logits' bound (the parity tests': 1e-4)")
    p.add_argument("--moe", default="auto", help="as the model service's --moe (the generic backend's experts)")
    p.add_argument("--layers", default="auto", help="as the model service's --layers (scan or unroll)")
    args = p.parse_args(argv)
    import jax

    cases = []
    for dtype in args.dtypes.split(","):
        try:
            cases.append(case(args.set, dtype, args.f32_atol, args.moe, args.layers))
        except Exception as e:  # noqa: BLE001 - one case's crash is its result; the other dtype still runs
            cases.append({"set": args.set.name, "dtype": dtype, "moe": args.moe, "pass": False,
                          "error": f"{type(e).__name__}: {e}"})
    dev = jax.devices()[0]
    print(json.dumps({"cases": cases, "device": {"platform": dev.platform, "kind": dev.device_kind}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
