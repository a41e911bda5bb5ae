"""`python -m model_service.placement`: a model's bytes per device on a device kind and count, and whether
they fit (exit 0), or the numbers that say why not (exit 1); 2 for bad arguments."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from model_service.config import PRESETS, ConfigError, load_model_config
from model_service.placement import (BLOCK_SIZE, GB, ITEMSIZE, Devices, Layout, Placement, Workload, choose,
                                     max_layers)
from serving_common.flags import positive_int


def render(name: str, p: Placement) -> str:
    """The placement as text, one line a part."""
    today = "runs today" if p.runs_today else "the service refuses it: with an expert axis the model axis divides 8"
    lines = [f"{name} on {p.devices.name} ({p.devices.memory / GB:.2f} GB a device), mesh data,expert,model = "
             f"{p.layout} ({today})", "per device:"]
    lines += [f"  {part.name:<17}{part.bytes / GB:>9.3f} GB  {part.note}" for part in p.parts]
    lines += [f"  {'used':<17}{p.used / GB:>9.3f} GB", f"  {'left':<17}{p.left / GB:>9.3f} GB",
              f"  {'loading':<17}{p.loading / GB:>9.3f} GB  the weights and one {p.piece / GB:.3f} GB piece placed "
              "while it is written into its layer stack, before the pool",
              f"KV per token: {p.kv_per_token / 1024:.1f} KiB a device; {p.max_sequences} full {p.context:,}-token "
              f"sequences fit beside the rest"]
    lines.append("fits" if p.fits else f"does not fit: {p.reason()}")
    return "\n".join(lines)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _size(raw: str) -> int:
    """'16GB', '15.7GiB', '1000000' -> bytes."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)", raw.strip().lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a size (e.g. 16GB, 15.7GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _parser() -> argparse.ArgumentParser:
    def layout(raw: str) -> Layout:
        try:
            return Layout.parse(raw)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    about = __doc__.split("\n\n")[0].removeprefix("`python -m model_service.placement`: ")
    p = argparse.ArgumentParser(prog="python -m model_service.placement", description=about)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="a model preset (grok-1)")
    source.add_argument("--config", help="a model config JSON file (golden/config.json's layout)")
    p.add_argument("--devices", required=True, help="KIND-N: v5e-N, v6e-N, v5p-N, h100-N or cpu-N")
    p.add_argument("--memory", type=_size, default=None,
                   help="memory of one device (e.g. 16GB; cpu default: this host's memory split N ways)")
    p.add_argument("--dtype", choices=sorted(ITEMSIZE), default="bfloat16", help="compute dtype")
    p.add_argument("--slots", type=positive_int, default=8, help="sequences decoded at once")
    p.add_argument("--context", type=positive_int, default=None, help="tokens a sequence may hold (default: the "
                                                                       "config's sequence_len)")
    p.add_argument("--kv-tokens", type=positive_int, default=None, help="KV pool size in tokens (default: --slots "
                                                                         "full contexts)")
    p.add_argument("--block-size", type=positive_int, default=BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--step-tokens", type=positive_int, default=None, help="token rows a step (default: 256, cpu 64)")
    p.add_argument("--mesh", type=layout, default=None,
                   help="DATA,EXPERT,MODEL (or DATA,MODEL: expert 1); default: the smallest layout that fits")
    p.add_argument("--max-layers", action="store_true", help="also say how many layers of this width fit the mesh")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when the model fits, 1 when it does not (with the numbers), 2 for bad arguments."""
    args = _parser().parse_args(argv)
    try:
        if args.preset is not None and args.preset not in PRESETS:
            raise ConfigError(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
        cfg = load_model_config(args.preset or args.config)
        if args.context is not None:
            cfg = dataclasses.replace(cfg, sequence_len=args.context)
        devices = Devices.parse(args.devices, args.memory)
        work = Workload(args.dtype, args.slots, args.kv_tokens, args.block_size, args.step_tokens)
        p = choose(cfg, devices, work, args.mesh)
    except ConfigError as e:
        print(f"placement: {e}", file=sys.stderr)
        return 2
    layers = max_layers(cfg, devices, p.layout, work) if args.max_layers else None
    if args.json:
        print(json.dumps({**p.to_dict(), **({"max_layers": layers} if layers is not None else {})}, indent=1))
    else:
        print(render(args.preset or args.config, p))
        if layers is not None:
            print(f"layers of this width that fit mesh {p.layout}: {layers} of {cfg.model.num_layers}")
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
