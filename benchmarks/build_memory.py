"""The peak memory of loading the weights and building the engine, beside what the engine keeps. Each case builds
the engine as the model service does (`loading.load_engine` with a ServerConfig: `--random-init`, or a checkpoint
written in the released format by demo_build.random_checkpoint) in a process of its own, makes its state, and
reports the bytes it holds (the params' and the KV pools' arrays), the host's peak resident memory over what the
process held before loading (/proc/self/status VmHWM - VmRSS) and, where the device reports it, `memory_stats()`'s
peak. Prints JSON, one object per case.

    python -m benchmarks.build_memory --config ../shared/bench/medium.json --backends generic,cpu \
        --sources random,checkpoint

`--layers N` overrides the config's layer count (Grok-1 width: --config grok-1 --layers 1 needs ~7 GB).

Measured on a 2-core CPU VM, Grok-1's widths, 1 layer, bfloat16 (../shared/bench/grok1-width-1layer.json; held
6.54-6.57 GB), host peak over held, before -> after each layer's tensors went into their stacks one expert at a
time: generic backend, random weights 1.72x -> 1.23x (the one MoE matrix drawn whole on the host remains),
from a checkpoint 1.28x -> 1.08x; the cpu backend (packed as it loads) 1.02x from both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any


def status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_bytes(tree: Any) -> int:
    """The bytes of every array in a pytree (each array's whole size, as one process holds it)."""
    import jax

    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(tree) if hasattr(leaf, "nbytes"))


def device_peak() -> int | None:
    import jax

    stats = jax.local_devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def one_case(config: str, checkpoint: str | None, backend: str, dtype: str, slots: int,
             kv_tokens: int | None) -> dict[str, Any]:
    """Build one engine in this process and measure (call it in a fresh process: the peak is the process's)."""
    import jax
    import jax.numpy as jnp

    from model_service.loading import ServerConfig, load_engine, resolve

    jax.block_until_ready(jnp.zeros(8))  # the runtime started before the baseline
    server = ServerConfig(config=config, checkpoint=checkpoint, random_init=checkpoint is None, dtype=dtype,
                          backend=backend, slots=slots, kv_tokens=kv_tokens, huge_pages=False)
    cfg = resolve(server)
    before = status_bytes("VmRSS")
    device_before = device_peak()
    engine = load_engine(server, cfg)
    state = jax.block_until_ready(engine.init_state())
    held = {"params": tree_bytes(engine.params), "pools": tree_bytes(state.pools)}
    total = sum(held.values())
    peak = status_bytes("VmHWM") - before
    report: dict[str, Any] = {"backend": backend, "source": "checkpoint" if checkpoint else "random", "dtype": dtype,
                              "layers": cfg.model.num_layers, "platform": jax.devices()[0].platform,
                              "held": {**held, "total": total}, "rss_before": before, "host_peak_over_before": peak,
                              "host_peak_over_held": round(peak / total, 3)}
    if device_before is not None:
        report["device_peak"] = device_peak()
        report["device_peak_over_held"] = round(report["device_peak"] / total, 3)
    return report


def config_file(config: str, layers: int | None, where: pathlib.Path) -> str:
    """`config` (a preset or a JSON file) with `layers` layers, written as a JSON file under `where`."""
    from model_service.config import load_model_config, model_config_to_dict

    cfg = load_model_config(config)
    if layers is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))
    path = where / "config.json"
    path.write_text(json.dumps(model_config_to_dict(cfg)))
    return str(path)


def run_case(config: str, checkpoint: str | None, backend: str, dtype: str = "float32", slots: int = 1,
             kv_tokens: int | None = None) -> dict[str, Any]:
    """one_case in a fresh process (its report, or {"error": ...})."""
    cmd = [sys.executable, "-m", "benchmarks.build_memory", "--one", "--config", config, "--backends", backend,
           "--dtype", dtype, "--slots", str(slots)] + ([] if kv_tokens is None else ["--kv-tokens", str(kv_tokens)])
    if checkpoint:
        cmd += ["--checkpoint", checkpoint]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        return {"backend": backend, "source": "checkpoint" if checkpoint else "random",
                "error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.build_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="../shared/bench/medium.json", help="preset or JSON config")
    p.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    p.add_argument("--backends", default="generic,cpu", help="comma-separated: generic, cpu, auto")
    p.add_argument("--sources", default="random,checkpoint", help="comma-separated: random, checkpoint")
    p.add_argument("--checkpoint", default=None, help="an existing checkpoint directory (else one is written)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool tokens (default: every slot a full context)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one case, in this process
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_case(args.config, args.checkpoint, args.backends, args.dtype, args.slots,
                                  args.kv_tokens)))
        return 0
    with tempfile.TemporaryDirectory(prefix="build-memory-") as tmp:
        where = pathlib.Path(tmp)
        config = config_file(args.config, args.layers, where)
        checkpoint = args.checkpoint
        if "checkpoint" in args.sources.split(",") and checkpoint is None:
            from demo_build.random_checkpoint import write_random_checkpoint

            checkpoint = str(where / "ckpt")
            write_random_checkpoint(config, pathlib.Path(checkpoint), seed=0)
        reports = [run_case(config, checkpoint if source == "checkpoint" else None, backend, args.dtype, args.slots,
                            args.kv_tokens)
                   for source in args.sources.split(",") for backend in args.backends.split(",")]
    print(json.dumps(reports, indent=1))
    return 0 if all("error" not in r for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
