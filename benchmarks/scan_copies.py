"""What a compiled step program materialises: the arrays each of its non-fused instructions writes (issue 61).

A scanned layer that copied its slice of the stacked weights, or a KV pool carried through the layers' loop and
copied instead of updated in place, shows here as an instruction whose output is a weight's or a pool's size:
fused computations write nothing to memory of their own, so only the instructions of the other computations
(the entry, loop bodies, conditional branches) are counted. Run on CPU or on the chip (XLA:TPU fuses otherwise):

    python -m benchmarks.scan_copies --config ../shared/bench/grok1-width-1layer.json --dtype bfloat16 \
        [--layers 1,2] [--rows 16] [--moe auto] [--dump DIR]

builds the engine as the model service does (random int8 weights), compiles its step program for `--rows` rows
with the layers scanned and unrolled, and prints one JSON line per program: its memory analysis, the bytes of
one layer's weights, and every materialised array of at least --min-mb MB (int8 arrays first: a weight copied).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, NamedTuple

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\](?:\{[^}]*\})? ([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_WHILE = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? while\(", re.MULTILINE)
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
# What writes into its operand's buffer (a pool's key or value rows), not a new array of the pool's size
IN_PLACE = frozenset({"scatter", "dynamic-update-slice", "fusion:scatter", "fusion:dynamic-update-slice"})
_PASS_THROUGH = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all"}


class Written(NamedTuple):
    """One array a program's instruction writes to memory."""

    computation: str
    opcode: str  # a fusion's opcode is its root's: "fusion:copy", "fusion:scatter", ...
    dtype: str
    shape: tuple[int, ...]
    bytes: int


def materialised(hlo: str) -> list[Written]:
    """The arrays the non-fused instructions of an optimized HLO module (Compiled.as_text()) write, largest first;
    parameters, tuples, bitcasts and constants write nothing."""
    body: dict[str, list[tuple[str, str, str, str, str]]] = {}
    roots: dict[str, str] = {}
    fused: set[str] = set()
    current = ""
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            found = _COMPUTATION.match(line)
            current = found[1] if found else ""
            body[current] = []
            continue
        m = _INSTRUCTION.match(line)
        if m is None or not current:
            continue
        name, dtype, dims, opcode, rest = m.groups()
        if opcode == "fusion":
            called = _CALLS.search(rest)
            if called:
                fused.add(called[1])
                opcode = f"fusion:{called[1]}"
        if line.lstrip().startswith("ROOT"):
            roots[current] = opcode
        body[current].append((name, dtype, dims, opcode, rest))
    out = []
    for computation, instructions in body.items():
        if computation in fused:
            continue
        for _, dtype, dims, opcode, _ in instructions:
            if opcode in _PASS_THROUGH or dtype not in BYTES:
                continue
            if opcode.startswith("fusion:"):
                opcode = "fusion:" + roots.get(opcode[len("fusion:"):], "?")
            shape = tuple(int(d) for d in dims.split(",") if d)
            size = BYTES[dtype]
            for d in shape:
                size *= d
            out.append(Written(computation, opcode, dtype, shape, size))
    return sorted(out, key=lambda w: -w.bytes)


def while_loops(hlo: str) -> int:
    """How many while loops an optimized HLO module holds (XLA removes a loop that runs once: a scan over one
    layer compiles to the unrolled layer)."""
    return len(_WHILE.findall(hlo))


def layer_weight_bytes(params: Any, stacked_prefix: str) -> tuple[int, int]:
    """(one layer's weight bytes, its smallest int8 matrix's bytes) of a scanned tree (leaves under
    `stacked_prefix`, each [layers, ...])."""
    import jax
    import numpy as np

    total, smallest = 0, None
    for module, leaves in params.items():
        if not module.startswith(stacked_prefix):
            continue
        for leaf in jax.tree.leaves(leaves):
            one = leaf.nbytes // leaf.shape[0]
            total += one
            if np.dtype(leaf.dtype) == np.int8:
                per_matrix = one // (leaf.shape[1] if leaf.ndim == 4 else 1)  # stacked experts: one expert's
                smallest = per_matrix if smallest is None else min(smallest, per_matrix)
    return total, smallest or 0


def step_program(engine: Any, rows: int) -> Any:
    """The engine's one-program step compiled for `rows` rows (one of its buckets)."""
    from model_service.step_batch import empty_batch
    import numpy as np

    tables = np.full((engine.slots, engine.table_len), engine.num_blocks, np.int32)
    batch = dataclasses.replace(empty_batch(engine.max_rows, engine.max_samples, tables), rows=rows)
    packed, draws = engine.run_args(batch)
    return engine._program.lower(engine.params, engine.init_state(), *packed, *draws).compile()


def config_at_depth(config: str, depth: int, folder: str) -> str:
    """A copy of the JSON model config `config` with num_layers `depth`, written into `folder`; its path."""
    with open(config) as f:
        data = json.load(f)
    data["model"]["num_layers"] = depth
    path = os.path.join(folder, f"depth{depth}.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def measure(config: str, dtype: str, layers: str, rows: int, moe: str, min_bytes: int,
            dump: str = "") -> dict[str, Any]:
    import jax

    from model_service.loading import ServerConfig, load_engine, resolve
    from model_service.sharding import LAYER_STACK

    server = ServerConfig(config=config, checkpoint=None, random_init=True, dtype=dtype, slots=rows, random_seed=0,
                          backend="generic", moe=moe, layers=layers)
    engine = load_engine(server, resolve(server))
    compiled = step_program(engine, rows)
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    depth = engine.model_config.model.num_layers
    if dump:  # the optimized HLO, to read what the platform's compiler made of the step
        with open(os.path.join(dump, f"step-{layers}-{depth}layers-{rows}rows.hlo.txt"), "w") as f:
            f.write(text)
    written = materialised(text)
    layer, smallest = layer_weight_bytes(engine.params, LAYER_STACK) if engine.model.scan_layers else (0, 0)
    pools = sum(a.nbytes for a in jax.tree.leaves(engine.init_state().pools))
    return {"layers": layers, "depth": depth, "rows": rows, "moe": engine.model.moe,
            "platform": jax.devices()[0].platform, "temp_bytes": memory.temp_size_in_bytes,
            "alias_bytes": memory.alias_size_in_bytes, "while_loops": while_loops(text), "pool_bytes": pools, "layer_weight_bytes": layer,
            "smallest_layer_matrix_bytes": smallest,
            "int8_written": [w._asdict() for w in written if w.dtype == "s8" and w.bytes >= min_bytes],
            "largest_written": [w._asdict() for w in written if w.bytes >= min_bytes][:20]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a model config JSON (the model service's --config)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", default="1,2", help="depths (num_layers) to compile, comma-separated")
    p.add_argument("--forms", default="scan,unroll", help="the --layers forms to compile, comma-separated")
    p.add_argument("--rows", type=int, default=16, help="the bucket's rows (a decode step of up to this many)")
    p.add_argument("--moe", default="auto")
    p.add_argument("--min-mb", type=float, default=1.0)
    p.add_argument("--dump", default="", help="a folder to write each program's optimized HLO text into")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # this process measures one program
    args = p.parse_args(argv)
    if args.one:
        row = measure(args.config, args.dtype, args.forms, args.rows, args.moe, int(args.min_mb * 1e6), args.dump)
        print(json.dumps(row), flush=True)
        return 0
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        for depth in (int(d) for d in args.layers.split(",")):
            config = config_at_depth(args.config, depth, folder)
            for form in args.forms.split(","):
                # one process per program: each holds its own engine's weights (Grok-1 width: 6.5 GB a layer)
                failed |= subprocess.run([sys.executable, "-m", "benchmarks.scan_copies", "--one", "--config", config,
                                          "--dtype", args.dtype, "--forms", form, "--rows", str(args.rows),
                                          "--moe", args.moe, "--min-mb", str(args.min_mb),
                                          "--dump", args.dump]).returncode
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
