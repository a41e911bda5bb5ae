"""What rounding the rows to int8 (--products native-int8) costs in fidelity, on the recorded reference outputs;
print JSON.

    python -m benchmarks.activation_error [--sets golden,golden_wide] [--shared ../shared]

For each golden set (../shared/golden, ../shared/golden_wide: checkpoints in the released format with the
reference's logits recorded at every greedy step of two prompts), the model runs teacher-forced over each prompt
and the reference's greedy continuation with the default products (native, float32 rows) and with native-int8,
and each step's logits are compared with the reference's: how many greedy tokens agree, the largest logit error
(absolute, and over the reference logits' standard deviation), the mean and largest KL divergence of the
softmax (reference || ours, nats), and the smallest top-2 margin of the reference (a flip is expected only where
the margin is below the logit error).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model_service.checkpoint import load_params
from model_service.config import MeshConfig, load_model_config
from model_service.model import GrokModel, Products
from model_service.sharding import make_mesh

PRODUCTS = {"native": Products.NATIVE, "native-int8": Products.NATIVE_INT8}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(ours: np.ndarray, ref: np.ndarray, greedy: np.ndarray) -> dict[str, Any]:
    """ours, ref [S, V] logits at the S recorded steps; greedy [S] the reference's tokens."""
    lp, lq = _log_softmax(ref), _log_softmax(ours)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    error = np.abs(ours.astype(np.float64) - ref)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    return {"steps": int(len(greedy)), "greedy_agree": int((ours.argmax(-1) == greedy).sum()),
            "max_logit_error": float(error.max()),
            "max_logit_error_over_std": float((error.max(-1) / ref.std(-1)).max()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "min_reference_top2_margin": float((top2[:, 1] - top2[:, 0]).min())}


def measure(golden: pathlib.Path) -> dict[str, Any]:
    cfg = load_model_config(str(golden / "config.json"))
    mesh = make_mesh(MeshConfig(1, 1))
    recorded = np.load(golden / "model_fp32.npz")
    out: dict[str, Any] = {"set": golden.name}
    for name, products in PRODUCTS.items():
        model = GrokModel(cfg, mesh, jnp.float32, products)
        params = load_params(str(golden / "checkpoint"), cfg, mesh, jnp.float32, pack=True, int8_table=products.int8)
        forward = jax.jit(model.forward)
        rows = {}
        for p in ("p0", "p1"):
            prompt, greedy = recorded[f"{p}_prompt"], recorded[f"{p}_greedy_tokens"]
            tokens = np.concatenate([prompt, greedy[:-1]]).astype(np.int32)[None]
            logits = np.asarray(forward(params, jnp.asarray(tokens)))[0, len(prompt) - 1:]
            rows[p] = compare(logits, recorded[f"{p}_step_logits"], greedy)
        out[name] = rows
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="golden,golden_wide")
    p.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[1].parent / "shared"))
    args = p.parse_args(argv)
    results = [measure(pathlib.Path(args.shared) / name) for name in args.sets.split(",")]
    print(json.dumps({"benchmark": "activation_error", "results": results}, indent=1))


if __name__ == "__main__":
    main()
