"""The programs each backend traces, as fingerprints: a refactoring guard for the backend seam (model_service/ops/).

For each backend configuration below it lowers the model's programs (GrokModel.rows, head, score, forward on the
golden config with random parameters, and the one-draw-at-a-time sampler over a 131,072-entry vocabulary) and
prints a hash of each one's StableHLO text; for a few it also runs rows, head and forward and hashes the outputs'
bytes. Two checkouts that print the same fingerprints trace the same programs (the same compiled code, the same
bits). Configurations the platform cannot build (a mesh of 8 on one chip) are recorded with their error.

    python -m benchmarks.programs --out before.json     # at one commit
    python -m benchmarks.programs --out after.json      # at another
    python -m benchmarks.programs --compare before.json after.json

On CPU (XLA_FLAGS=--xla_force_host_platform_device_count=8) the ops seam's commits kept all 14 configurations'
fingerprints (rows, head, score, forward, sampler) and the outputs of 5. The sampler call takes the pre-seam
`native=` flag where sample_tokens still has it, so older commits can be fingerprinted too.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import os
import sys
from typing import Any, NamedTuple

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                               " --xla_allow_excess_precision=false").strip()

import jax  # noqa: E402 - after the flags
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model_service.backend import choose_backend  # noqa: E402
from model_service.checkpoint import random_params  # noqa: E402
from model_service.config import MeshConfig, load_model_config  # noqa: E402
from model_service.model import GrokModel, Products, TokenRows  # noqa: E402
from model_service.sampling import SamplingParams, sample_tokens  # noqa: E402
from model_service.sharding import make_mesh  # noqa: E402
from tests.procs import GOLDEN  # noqa: E402

class Case(NamedTuple):
    mesh: str
    dtype: str
    choices: dict[str, str]  # choose_backend's arguments ("choice": the backend)
    products: Products | None = None  # GrokModel's explicit products
    attention: str | None = None  # GrokModel's explicit attention
    moe: str | None = None  # the backend's MoE form, set after choose_backend (pallas_interpret: tests' form)


CASES: dict[str, Case] = {
    "cpu_f32": Case("1,1", "float32", {"choice": "cpu"}),
    "cpu_xla_f32": Case("1,1", "float32", {"choice": "cpu", "products": "xla"}),
    "cpu_rows_f32": Case("1,1", "float32", {"choice": "cpu"}, Products.FUSED_REDUCE, "rows"),
    "cpu_int8": Case("1,1", "float32", {"choice": "cpu", "products": "native-int8"}),
    "cpu_bf16": Case("1,1", "bfloat16", {"choice": "cpu"}),
    "cpu_mesh8_f32": Case("1,8", "float32", {"choice": "cpu"}),
    "cpu_expert": Case("1,4,2", "float32", {"choice": "cpu"}),
    "gen_f32": Case("1,1", "float32", {"choice": "generic"}),
    "gen_bf16": Case("1,1", "bfloat16", {"choice": "generic"}),
    "gen_bf16_cond": Case("1,1", "bfloat16", {"choice": "generic", "moe": "cond", "layers": "unroll"}),
    "gen_f32_interpret": Case("1,1", "float32", {"choice": "generic"}, moe="pallas_interpret"),
    "gen_exact": Case("1,1", "float32", {"choice": "generic", "moe": "cond"}, Products.EXACT),
    "gen_mesh8": Case("1,8", "float32", {"choice": "generic"}),
    "gen_expert": Case("1,4,2", "float32", {"choice": "generic"}),
}
RUN = ("cpu_f32", "cpu_bf16", "gen_f32", "gen_bf16_cond", "gen_exact")  # outputs hashed too
VOCAB = 131072  # the sampler's: large enough for its search (and the native kernels') forms


def fingerprint(data: str | bytes) -> str:
    return hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()[:16]


def model_for(name: str, config: str) -> GrokModel:
    case = CASES[name]
    mesh, choices = make_mesh(MeshConfig.parse(case.mesh)), dict(case.choices)
    backend = choose_backend(choices.pop("choice"), mesh, jnp.dtype(case.dtype), **choices)
    if case.moe is not None:
        backend = dataclasses.replace(backend, moe=case.moe)
    cfg = load_model_config(config)
    return GrokModel(cfg, mesh, jnp.dtype(case.dtype), case.products, attention=case.attention, backend=backend)


def sampler_options(model: GrokModel) -> dict[str, Any]:
    if "nucleus" in inspect.signature(sample_tokens).parameters:
        return {"nucleus": model.ops.sampling}
    return {"native": model.backend.native_sampling}  # before the ops seam


def programs(name: str, config: str = str(GOLDEN / "config.json")) -> dict[str, Any]:
    """Fingerprints of one configuration's programs (and outputs, for RUN) for the model `config`."""
    model = model_for(name, config)
    cfg, dtype, tile, slots = model.cfg, model.dtype, 8, 4
    params = model.pack_params(random_params(cfg, model.mesh, dtype, 3, pack=model.products.native,
                                             int8_table=model.products.int8, stacked=model.backend.stacked_experts,
                                             stack_layers=model.scan_layers))
    pools = model.init_pools(slots * model.blocks_per_sequence)
    n = jnp.arange(16, dtype=jnp.int32)
    rows = TokenRows(n % 50, n % 5, n // 5 % slots, n < 13, jnp.asarray(model.dense_tables(slots)))
    hidden, used = jnp.ones((4, cfg.model.emb_size), dtype), jnp.array([True, False, True, True])
    tokens = jnp.arange(14, dtype=jnp.int32).reshape(2, 7) + 3
    step = jax.jit(lambda p, pools, r: model.rows(p, pools, r, tile))
    head, forward = jax.jit(model.head), jax.jit(model.forward)
    score = jax.jit(lambda p, h, t, u: model.score(p, h, t, u, 3))
    draws = SamplingParams(jnp.ones(3), jnp.full(3, 0.9), jnp.ones((3, VOCAB), bool), jnp.ones(3, bool),
                           jnp.ones(3, jnp.int32))
    options = sampler_options(model)
    sampler = jax.jit(lambda k, logits, p: sample_tokens(k, logits, p, **options))
    out = {"products": model.products.value, "attention": model.attention, "moe": model.moe,
           "rows": fingerprint(step.lower(params, pools, rows).as_text()),
           "head": fingerprint(head.lower(params, hidden, used).as_text()),
           "score": fingerprint(score.lower(params, hidden, jnp.zeros(4, jnp.int32), used).as_text()),
           "forward": fingerprint(forward.lower(params, tokens).as_text()),
           "sampler": fingerprint(sampler.lower(jnp.zeros((3, 2), jnp.uint32), jnp.zeros((3, VOCAB)),
                                                draws).as_text())}
    if name in RUN:
        h, _ = step(params, pools, rows)
        logits = head(params, h[:4].astype(dtype), used)
        out["outputs"] = fingerprint(np.asarray(h).tobytes() + np.asarray(logits)[np.asarray(used)].tobytes()
                                     + np.asarray(forward(params, tokens)).tobytes())
    return out


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The fingerprints that differ between two runs (a configuration missing from one counts)."""
    return [f"{name}.{key}: {value} -> {after.get(name, {}).get(key)}" for name, fields in before.items()
            for key, value in fields.items() if after.get(name, {}).get(key) != value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the fingerprints here (JSON)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated configurations")
    parser.add_argument("--config", default=str(GOLDEN / "config.json"),
                        help="the model config (default: golden's; its parameters are random)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two runs' files")
    args = parser.parse_args(argv)
    if args.compare:
        with open(args.compare[0]) as a, open(args.compare[1]) as b:
            differ = compare(json.load(a), json.load(b))
        print("\n".join(differ) or "the same programs")
        return 1 if differ else 0
    found: dict[str, Any] = {"_platform": {"jax": jax.__version__, "platform": jax.devices()[0].platform}}
    for name in args.cases.split(","):
        try:
            found[name] = programs(name, args.config)
        except Exception as error:  # a configuration this platform cannot build is recorded, not fatal
            found[name] = {"error": repr(error)}
        print(name, json.dumps(found[name]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
