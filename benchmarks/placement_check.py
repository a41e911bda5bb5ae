"""The placement tool's prediction against what JAX holds after loading: random int8 weights loaded as the model
service loads them (`loading.load_engine`, the generic backend: the accelerators' layout), the engine's state
made, and per device the bytes predicted (model_service.placement) beside the bytes reported: the arrays' own
shards (`addressable_shards`, every platform) and, where the device reports it, `memory_stats()`'s bytes in use and
loading's peak (before the pool is made) beside the predicted `loading` (the weights and one piece). Prints JSON.

    python -m benchmarks.placement_check --config grok-1 --layers auto --dtype bfloat16 --slots 8 [--compile]

`--layers auto`: as many layers of the config's width as the placement tool says fit the mesh. `--temporaries`
compiles the step (the generic backend's one program) and reports XLA's temporaries beside the tool's estimate
(model_service/placement/temporaries.py); `--compile` also runs
the engine's programs once (a real step) and reports the peak bytes beside the predicted total.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from typing import Any

import jax
import numpy as np

from model_service.config import MeshConfig, ModelConfig, load_model_config
from model_service.loading import ServerConfig, load_engine
from model_service.placement import (GENERIC_STEP_TOKENS, WEIGHT_PARTS, Devices, Layout, Placement, Workload,
                                     host_memory, max_layers, place)
from model_service.step_batch import empty_batch

__all__ = ["WEIGHT_PARTS", "check", "shard_bytes"]


def shard_bytes(tree: Any) -> dict[int, int]:
    """Bytes each device holds of a pytree's arrays (device id -> bytes), from the arrays' own shards."""
    held: Counter[int] = Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return dict(held)


def device_memory() -> tuple[int, str]:
    """One device's memory as JAX reports it (`bytes_limit`), on CPU the host's split over its devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), device.platform
    return host_memory() // jax.local_device_count(), device.platform


def in_use() -> dict[str, int] | None:
    stats = jax.local_devices()[0].memory_stats()
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats} if stats else None


def predict(cfg: ModelConfig, mesh: MeshConfig, work: Workload) -> Placement:
    memory, platform = device_memory()
    devices = Devices("cpu" if platform == "cpu" else platform, mesh.size, memory)
    return place(cfg, devices, Layout(mesh.data, mesh.expert, mesh.model), work)


def compiled_temporaries(engine: Any, state: Any) -> dict[str, int]:
    """XLA's own temporaries of a full step's programs (two on CPU, one on accelerators) on this platform (compiled, not run:
    `memory_analysis().temp_size_in_bytes`)."""
    tables = np.full((engine.slots, engine.table_len), engine.num_blocks, np.int32)
    batch = dataclasses.replace(empty_batch(engine.max_rows, engine.max_samples, tables), rows=engine.max_rows)
    rows, draws = engine.run_args(batch)
    if engine.one_program:  # accelerators: one program a step (its largest bucket is the step's rows)
        step = engine._program.lower(engine.params, state, *rows, *draws)
        return {"step": int(step.compile().memory_analysis().temp_size_in_bytes)}
    h = jax.ShapeDtypeStruct((engine.max_rows, engine.model_config.model.emb_size), engine.model.dtype)
    programs = {"rows": engine._rows.lower(engine.params, state.pools, state.slots.last, *rows),
                "draws": engine._draws.lower(engine.head_params, state.slots, h, *draws)}
    return {name: int(lowered.compile().memory_analysis().temp_size_in_bytes) for name, lowered in programs.items()}


def check(cfg: ModelConfig, mesh: MeshConfig, dtype: str, slots: int, kv_tokens: int | None = None,
          compile_step: bool = False, temporaries: bool = False) -> dict[str, Any]:
    """Load `cfg` with random weights on `mesh`, make the engine's state, and compare per device."""
    work = Workload(dtype, slots, kv_tokens, step_tokens=GENERIC_STEP_TOKENS, one_program=True)  # the generic step
    predicted = predict(cfg, mesh, work)
    before = in_use()
    server = ServerConfig(config="", checkpoint=None, random_init=True, dtype=dtype, mesh=mesh, slots=slots,
                          kv_tokens=kv_tokens, backend="generic")
    engine = load_engine(server, cfg)
    loaded = in_use()  # before the pool: loading's own peak (the weights and the piece being written)
    state = jax.block_until_ready(engine.init_state())
    after = in_use()
    weights, pool, slot_state = shard_bytes(engine.params), shard_bytes(state.pools), shard_bytes(state.slots)
    expected = {"weights": sum(predicted.part(p) for p in WEIGHT_PARTS), "kv pool": predicted.part("kv pool"),
                "slot state": predicted.part("slot state")}
    held = expected["weights"] + expected["kv pool"] + expected["slot state"]
    report: dict[str, Any] = {
        "platform": jax.devices()[0].platform, "layers": cfg.model.num_layers, "mesh": str(mesh),
        "dtype": dtype, "slots": slots, "predicted": {**expected, "held": held, "used": predicted.used,
                                                       "loading": predicted.loading,
                                                       "device_memory": predicted.devices.memory},
        "reported_shards": {"weights": weights, "kv pool": pool, "slot state": slot_state}}
    if before is not None and after is not None:
        grown = after["bytes_in_use"] - before["bytes_in_use"]
        report["reported_memory_stats"] = {"bytes_in_use_grown": grown, **after, "held_over_predicted": grown / held}
    if before is not None and loaded is not None:
        peak = loaded["peak_bytes_in_use"] - before["bytes_in_use"]
        report["loading"] = {"predicted": predicted.loading, "piece": predicted.piece, "peak_grown": peak,
                             "peak_over_predicted": peak / predicted.loading}
    if temporaries:
        compiled = compiled_temporaries(engine, state)
        report["temporaries"] = {"predicted": predicted.part("temporaries"), "compiled": compiled,
                                 "compiled_over_predicted": max(compiled.values()) / predicted.part("temporaries")}
    if compile_step:
        del state  # engine.compile makes its own state, as the service holds one: not two pools at the step's peak
        report["after_step"] = step_peak(engine, predicted, after["peak_bytes_in_use"] if after else None)
    return report


def step_peak(engine: Any, predicted: Placement, loaded_peak: int | None = None) -> dict[str, Any]:
    """Run the engine's programs once (a full step included) and report the peak beside the predicted total; a
    step that does not fit the device is reported, not raised, so the loading numbers still come out. The peak
    counts from the process's start: where it is still loading's (`loaded_peak`), the step stayed below it."""
    try:
        engine.compile()
    except Exception as e:  # noqa: BLE001 - XLA's out-of-memory is a plain runtime error
        return {"error": f"{type(e).__name__}: {str(e)[:800]}", "predicted_used": predicted.used}
    peak = in_use()
    if peak is None:
        return {"note": "this platform reports no memory_stats"}
    return {**peak, "predicted_used": predicted.used,
            "peak_over_predicted_used": peak["peak_bytes_in_use"] / predicted.used,
            "peak_is_loadings": loaded_peak is not None and peak.get("peak_bytes_in_use") == loaded_peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.placement_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="grok-1", help="preset or JSON config")
    p.add_argument("--layers", default="auto", help="layers to load: a number, or auto (as many as fit the mesh)")
    p.add_argument("--mesh", type=MeshConfig.parse, default=MeshConfig(1, 1), help="DATA,MODEL")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--kv-tokens", type=int, default=None)
    p.add_argument("--temporaries", action="store_true",
                   help="also compile the step and report XLA's temporaries beside the estimate")
    p.add_argument("--compile", action="store_true", help="also run one step and report the peak")
    args = p.parse_args(argv)
    cfg = load_model_config(args.config)
    work = Workload(args.dtype, args.slots, args.kv_tokens, step_tokens=GENERIC_STEP_TOKENS, one_program=True)
    if args.layers == "auto":
        layers = max_layers(cfg, predict(cfg, args.mesh, work).devices, Layout(args.mesh.data, args.mesh.expert, args.mesh.model),
                            work)
        if layers < 1:
            prediction = predict(cfg, args.mesh, work).to_dict()
            print(json.dumps({"error": "not even one layer fits", "prediction": prediction}))
            return 1
    else:
        layers = int(args.layers)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))
    report = check(cfg, args.mesh, args.dtype, args.slots, args.kv_tokens, args.compile, args.temporaries)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
