"""Per-op time of one engine decode step (model + sampling) from a jax.profiler trace; prints JSON.

    python -m benchmarks.profile_step --config ../shared/bench/medium.json --batch 8 [--active 8] [--greedy]
        [--repo DIR]   # profile another checkout's engine (e.g. the code before a change)
        [--top N]      # also the N costliest ops, each as "category | op name"

The step is the Engine's own two compiled programs (its rows, then its draws) running a decode batch (every active
slot holding a request with a 32-token prompt, temperature 0.7, top_p 0.9 unless --greedy). Each XLA thunk's self time (its duration less
its nested thunks') is summed per category, named from the HLO instruction's op_name metadata
(the JAX source path), and averaged over --runs steps.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import pathlib
import re
import sys
import tempfile
from typing import Any

_REPO = sys.argv[sys.argv.index("--repo") + 1] if "--repo" in sys.argv else str(pathlib.Path(__file__).resolve().parent.parent)
sys.path.insert(0, _REPO)  # before the imports below, so --repo profiles that checkout's model_service

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model_service.checkpoint import random_params  # noqa: E402
from model_service.config import MeshConfig, load_model_config  # noqa: E402
from model_service.engine import Engine  # noqa: E402
from model_service.model import GrokModel, Products  # noqa: E402
from model_service.sampling_settings import SamplingSettings  # noqa: E402
from model_service.sharding import make_mesh  # noqa: E402
from model_service.step_batch import SlotStart  # noqa: E402
from benchmarks.stack import use_model_xla_flags

try:
    from model_service.host_memory import huge_pages  # noqa: E402
except ImportError:  # a --repo checkout from before the service backed its weights with huge pages
    def huge_pages(tree: Any) -> dict[str, Any]:
        return {}

# First match wins: (category, regex over an HLO instruction's op_name metadata, or "<opcode> <shape>" when it
# has none). Patterns cover this code's named scopes and the unscoped names of the code before them.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention: q/k/v and output projections", r"qkv_projections|output_projection"),
    ("attention: kv write, scores, softmax, values", r"multi_head_attention"),
    ("sampling: nucleus threshold", r"/nucleus/|while/body/.*while/body|_search|/sort"),
    ("sampling: gumbel noise + draw", r"/draw/|gumbel|_uniform|threefry|random_bits|categorical"),
    ("unembedding (logits)", r"unembed|d,vd->|^dot f32\[\d+,131072\]"),
    ("moe experts", r"/moe/"),
    ("router", r"/router"),
    ("KV memory copies", r"^copy f32\[\d+,\d+,\d+,\d+\]"),
    ("norms, residuals, embedding", r"transformer|rms_norm|embed"),
    ("sampling: softmax, top-k, keys, rest", r"/probabilities/|while/body|sample|split|cond"),
)


def instructions(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata, or "<opcode> <shape>" when it has none."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\(([^\n]*)$", hlo_text, re.M):
        meta = re.search(r'op_name="([^"]*)"', m.group(4))
        out[m.group(1)] = meta.group(1) if meta else f"{m.group(3)} {m.group(2)}"
    return out


def categorise(name: str, names: dict[str, str]) -> str:
    op = names[name.removesuffix(".clone")]
    for category, pattern in CATEGORIES:
        if re.search(pattern, op):
            return category
    return "other (glue, copies, small ops)"


def self_times(events: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(name, self microseconds) of every thunk event, nesting resolved per thread by time containment."""
    by_thread: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_thread[e["tid"]].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict[str, Any]] = []
        child: dict[int, float] = collections.defaultdict(float)
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                child[id(stack[-1])] += e["dur"]
            stack.append(e)
        out += [(e["name"], e["dur"] - child[id(e)]) for e in evs]
    return out


def build(args: argparse.Namespace) -> tuple[Engine, Any, Any]:
    """The engine with every active slot's prompt computed, and the decode step's batch."""
    from benchmarks.step import batch  # the same batch layout the step benchmark times

    cfg = load_model_config(args.config)
    mesh = make_mesh(MeshConfig.parse(args.mesh))
    model = GrokModel(cfg, mesh, jnp.float32)
    # Packed as the model service packs them: with native products the table stays bfloat16, as drawn.
    params = random_params(cfg, mesh, jnp.float32, 0, pack=model.products.native,
                           int8_table=model.products.int8, stacked=model.backend.stacked_experts)
    engine = Engine(model, params, cfg, mesh, args.batch)
    state = engine.init_state()
    rng = np.random.default_rng(0)
    sampling = SamplingSettings() if args.greedy else SamplingSettings(temperature=0.7, top_p=0.9)
    active = args.active or args.batch
    for slot in range(active):
        prompt = rng.integers(3, cfg.vocab_size, args.prompt_len).tolist()
        for start in range(0, args.prompt_len, engine.max_rows):
            part = range(start, min(start + engine.max_rows, args.prompt_len))
            rows = [(slot, p, prompt[p]) for p in part]
            draws = [(len(rows) - 1, slot)] if part[-1] == args.prompt_len - 1 else []
            starts = (SlotStart(slot, slot, sampling, tuple(prompt)),) if start == 0 else ()
            state, pending = engine.step(state, batch(engine, rows, draws, starts))
            pending.get()
    huge_pages(engine.params)  # as the model service does once compiled (--huge-pages on)
    decode = batch(engine, [(slot, args.prompt_len, None) for slot in range(active)],
                   [(slot, slot) for slot in range(active)])
    return engine, state, decode


def _traced(program: Any, call: Any, runs: int) -> tuple[dict[str, str], list[tuple[str, float]], list[float]]:
    """One compiled program's instruction names, its thunks' self times and its wall times over `runs` calls."""
    names = instructions(program.as_text())
    for _ in range(3):
        call()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(runs):
                call()
        trace = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]))
    events = trace["traceEvents"]
    thunks = [(n, t) for n, t in self_times(events) if n.removesuffix(".clone") in names]
    wall = [e["dur"] for e in events if e.get("ph") == "X" and e["name"] == "ThunkExecutor::Execute (wait for completion)"]
    return names, thunks, wall


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """Profiles the same decode batch again and again (each step writes the same positions: the cost is the
    same as the step that first wrote them), each of the step's two programs (rows, then draws) traced alone."""
    engine, state, decode = build(args)
    rows_args, draws_args = engine.run_args(decode)
    pools, slots = state
    rows = engine._rows.lower(engine.params, pools, slots.last, *rows_args).compile()
    h, pools = rows(engine.params, pools, slots.last, *rows_args)
    draws = engine._draws.lower(engine.head_params, slots, h, *draws_args).compile()

    def run_rows() -> None:
        nonlocal h, pools
        h, pools = jax.block_until_ready(rows(engine.params, pools, slots.last, *rows_args))

    def run_draws() -> None:
        nonlocal slots
        slots = jax.block_until_ready(draws(engine.head_params, slots, h, *draws_args)[0])

    totals: collections.Counter[str] = collections.Counter()
    by_op: collections.Counter[str] = collections.Counter()
    wall_ms = 0.0
    for program, call in ((rows, run_rows), (draws, run_draws)):
        names, thunks, wall = _traced(program, call, args.runs)
        wall_ms += float(np.median(wall)) / 1e3 if wall else float("nan")
        for name, us in thunks:
            totals[categorise(name, names)] += us
            by_op[f"{categorise(name, names)[:12]} | {names[name.removesuffix('.clone')][-100:]} | {name}"] += us
    per_step = {k: round(v / args.runs / 1e3, 3) for k, v in totals.most_common()}
    top = {k: round(v / args.runs / 1e3, 3) for k, v in by_op.most_common(args.top)}
    return {"repo": args.repo, "config": args.config, "batch": args.batch, "active": args.active or args.batch,
            "sampled": not args.greedy, "runs": args.runs, "step_wall_ms_median": round(wall_ms, 3),
            "thunk_ms_per_step": per_step, "thunk_ms_total": round(sum(per_step.values()), 3),
            **({"top_ops_ms_per_step": top} if args.top else {})}


def main(argv: list[str] | None = None) -> int:
    use_model_xla_flags()  # the model service's process settings, before JAX computes
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, default=1, help="decode slots")
    p.add_argument("--active", type=int, default=None, help="slots holding a request (default: all)")
    p.add_argument("--mesh", default="1,1")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="temperature 0 instead of 0.7 / top_p 0.9")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--top", type=int, default=0, help="also list the N costliest ops (category | op name)")
    p.add_argument("--repo", default=_REPO, help="checkout whose engine to profile (default: this one)")
    print(json.dumps(profile(p.parse_args(argv)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
