"""Write a random-weight checkpoint of any config in the released format (for tests and benchmarks).

    python -m demo_build.random_checkpoint --config configs/demo.json --out /tmp/random-demo [--seed 0]

Weights are int8-quantized like the real checkpoint and scaled so outputs vary (logit std ~2);
DIR/RANDOM_WEIGHTS.txt records that they are random. The embedded default the stack serves is not this: it
is the trained demo model committed in demo/ (`python -m demo_build`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from model_service.checkpoint import random_leaves, write_checkpoint
from model_service.config import ConfigError, load_model_config, model_config_to_dict, validate, MeshConfig


def write_random_checkpoint(config: str, out: pathlib.Path, seed: int) -> int:
    """Write the checkpoint; returns the number of tensors written."""
    cfg = load_model_config(config)
    validate(cfg, MeshConfig())
    count = 0

    def progress(done: int, total: int) -> None:
        nonlocal count
        count = done

    write_checkpoint(out, cfg, random_leaves(cfg, seed), progress)
    (out / "RANDOM_WEIGHTS.txt").write_text(
        "These weights are RANDOM (numpy PCG64 seed {seed}), not a trained model: generated text is meaningless.\n"
        "Written by `python -m demo_build.random_checkpoint --config {config} --out {out} --seed {seed}`.\n"
        "Config: {cfg}\n".format(seed=seed, config=config, out=out, cfg=model_config_to_dict(cfg)))
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="preset name or JSON config path")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="checkpoint directory to create")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        n = write_random_checkpoint(args.config, args.out, args.seed)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} tensors to {args.out / 'ckpt-0'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
