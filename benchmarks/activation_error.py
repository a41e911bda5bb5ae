"""What the fast modes cost in fidelity, on the recorded reference outputs: bfloat16 compute and, on CPU,
int8 rows (--products native-int8); print JSON.

    python -m benchmarks.activation_error [--sets golden,golden_wide] [--shared ../shared]
        [--variants float32,bfloat16,native-int8]

For each golden set (../shared/golden, ../shared/golden_wide: checkpoints in the released format with the
reference's float32 logits recorded at every greedy step of its prompts), the model runs teacher-forced over each
prompt and the reference's greedy continuation in each variant, and each step's logits are compared with the
reference's: how many greedy tokens agree, the largest logit error (absolute, and over the reference logits'
standard deviation), the mean and largest KL divergence of the softmax (reference || ours, nats), and the smallest
top-2 margin of the reference (a flip is expected only where the margin is below the logit error). Variants:
"float32" and "bfloat16" (the platform's default products in that compute dtype: native on a CPU where the kernels
built, XLA's dots on an accelerator) and "native-int8" (float32 with int8 rows; CPU only: elsewhere it is left
out with a note). Runs on any platform (on the TPU host through benchmarks.device --points activation_error).
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
from model_service.backend import choose_products
from model_service.model import GrokModel
from model_service.sharding import make_mesh

VARIANTS = {"float32": ("float32", "auto"), "bfloat16": ("bfloat16", "auto"), "native-int8": ("float32", "native-int8")}


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


def measure(golden: pathlib.Path, variants: list[str]) -> dict[str, Any]:
    cfg = load_model_config(str(golden / "config.json"))
    mesh = make_mesh(MeshConfig(1, 1))
    recorded = np.load(golden / "model_fp32.npz")
    out: dict[str, Any] = {"set": golden.name}
    for name in variants:
        dtype, choice = VARIANTS[name]
        try:
            products = choose_products(choice, mesh, jnp.dtype(dtype))
        except ValueError as e:  # native-int8 where the CPU kernels cannot run (an accelerator)
            out[name] = {"skipped": str(e)}
            continue
        model = GrokModel(cfg, mesh, jnp.dtype(dtype), products)
        params = model.pack_params(load_params(str(golden / "checkpoint"), cfg, mesh, jnp.dtype(dtype),
                                               pack=products.native, int8_table=products.int8))
        forward = jax.jit(model.forward)
        rows: dict[str, Any] = {"dtype": dtype, "products": products.value}
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
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    results = [measure(pathlib.Path(args.shared) / name, variants) for name in args.sets.split(",")]
    print(json.dumps({"benchmark": "activation_error", "platform": jax.devices()[0].platform,
                      "device_kind": jax.devices()[0].device_kind, "results": results}, indent=1))


if __name__ == "__main__":
    main()
