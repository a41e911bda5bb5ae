"""float32 fidelity on this backend, printed as JSON: its transcendental functions against float64 (jax's own
forms and XLA's accurate ones, `accuracy=HIGHEST`), and the golden checkpoint's float32 logits against the
reference's per configuration (the dense pass and the paged prefill; the first prompt position past 2e-3).

    python -m benchmarks.fidelity [--configs exact-scan,exact-unroll,dot-scan] [--out FILE]

On a TPU v5e (JAX 0.10.2) it found the chip's own tanh 1,287 ulps off (log 2,552, exp 71), the golden float32
logits ~1e-3 from the reference's and a router near-tie flipped at the 64-token prompt's position 33; with the
accurate forms the faithful mode (Products.EXACT) came within 1.3e-5 (benchmarks/measured/fidelity-tpu-v5e-float32.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results

HIGHEST = jax.lax.AccuracyMode.HIGHEST
SAMPLES = 1 << 16
CONFIGS = {  # name -> (products, --layers)
    "exact-scan": ("EXACT", "scan"),
    "exact-unroll": ("EXACT", "unroll"),
    "dot-scan": ("DOT", "scan"),
}


def error_of(got: Any, want: np.ndarray) -> dict[str, float]:
    """The largest error relative to the largest value, and in float32 ulps of the float64 value (max, mean)."""
    got = np.asarray(got, np.float64)
    diff = np.abs(got - want)
    ulps = diff / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return {"abs_over_scale": float(diff.max() / np.abs(want).max()), "max_ulp": float(ulps.max()),
            "mean_ulp": float(ulps.mean())}


def functions() -> dict[str, tuple[Callable[[Any], Any], Callable[[np.ndarray], np.ndarray], tuple[float, float]]]:
    """name -> (this backend's float32 form, float64 reference, input range)."""
    out: dict[str, Any] = {}
    for name, op, ref, span in [("tanh", jax.lax.tanh, np.tanh, (-5.0, 5.0)), ("exp", jax.lax.exp, np.exp, (-30.0, 5.0)),
                                ("log", jax.lax.log, np.log, (1e-3, 1e3))]:
        out[name] = (op, ref, span)
        out[f"{name}_accurate"] = (lambda x, op=op: op(x, accuracy=HIGHEST), ref, span)
    out["sin"] = (jnp.sin, np.sin, (0.0, 8192.0))  # RoPE's phases
    out["rsqrt"] = (jax.lax.rsqrt, lambda x: 1 / np.sqrt(x), (1e-3, 1e3))  # the norms
    return out


def transcendentals() -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    report = {}
    for name, (op, ref, (low, high)) in functions().items():
        x = rng.uniform(low, high, SAMPLES).astype(np.float32)
        report[name] = error_of(jax.jit(op)(jnp.asarray(x)), ref(x.astype(np.float64)))
    return report


def golden(name: str) -> dict[str, Any]:
    """One configuration's float32 golden logits against the reference's: dense pass and paged prefill."""
    from model_service.backend import choose_backend
    from model_service.checkpoint import load_params
    from model_service.config import MeshConfig, load_model_config
    from model_service.model import GrokModel, Products
    from model_service.sharding import make_mesh
    from tests.model.conftest import Loaded, RowRunner
    from tests.model.test_parity import PROMPTS, _padded
    from tests.procs import GOLDEN

    products, layers = CONFIGS[name]
    cfg = load_model_config(str(GOLDEN / "config.json"))
    gold = dict(np.load(GOLDEN / "model_fp32.npz"))
    mesh = make_mesh(MeshConfig(1, 1))
    model = GrokModel(cfg, mesh, jnp.float32, Products[products],
                      backend=choose_backend("generic", mesh, jnp.float32, layers=layers))
    params = load_params(str(GOLDEN / "checkpoint"), cfg, mesh, jnp.float32, pack=model.products.native,
                         stacked=model.backend.stacked_experts, stack_layers=model.scan_layers)
    start = time.perf_counter()
    tokens = jnp.asarray(np.concatenate([_padded(gold[f"p{p}_prompt"]) for p in PROMPTS]))
    full = np.asarray(jax.jit(model.forward)(params, tokens))
    out: dict[str, Any] = {"moe": model.moe, "scan": model.scan_layers}
    for p in PROMPTS:
        n = len(gold[f"p{p}_prompt"])
        err = np.abs(full[p, :n] - gold[f"p{p}_full_logits"]).max(-1)
        bad = np.nonzero(err > 2e-3)[0]
        out[f"dense_p{p}"] = {"positions": n, "max": float(err.max()), "first_past_2e-3": int(bad[0]) if len(bad)
                              else None}
    runner = RowRunner(Loaded(cfg, model, params, None), len(PROMPTS))
    logits = runner.run([(p, i, int(t)) for p in PROMPTS for i, t in enumerate(gold[f"p{p}_prompt"])])
    ends = np.cumsum([len(gold[f"p{p}_prompt"]) for p in PROMPTS]) - 1
    out["prefill_last"] = [float(np.abs(logits[ends[p]] - gold[f"p{p}_prefill_last_logits"]).max())
                           for p in PROMPTS]
    out["seconds"] = time.perf_counter() - start
    return out


def run(configs: Sequence[str]) -> dict[str, Any]:
    return {"benchmark": "fidelity", **results.provenance(), "backend": jax.default_backend(),
            "transcendentals": transcendentals(), "golden_float32": {name: golden(name) for name in configs}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"golden configurations: {', '.join(CONFIGS)}")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration {unknown[0]!r}: one of {', '.join(CONFIGS)}")
    report = run(names)
    results.emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
