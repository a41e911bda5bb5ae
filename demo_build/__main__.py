"""`python -m demo_build --preset tpu --out demo`: train the embedded demo model from the demo corpus.

Writes into OUT: tokenizer.model (the demo SentencePiece model, trained on the same corpus), config.json (the
model config), checkpoint/ (the trained network, int8 where the released model is int8, in the released
ckpt-0/tensorNNNNN_000 format) and training.json (the settings, the loss curve, float and int8 losses on
training and held-out text, samples, the device and its speed). A preset (demo_build/presets.py) names the
model config, the corpus folders and the TrainConfig: `cpu` (the default) the small model CI trains steps of,
`tpu` the larger embedded default for one accelerator chip. Every TrainConfig field is also a flag (and a
GROK_TRAIN_<FLAG> variable) that overrides the preset's.

  --stop-after N       train N steps of the same schedule, print the loss log as JSON, write nothing
  --compare-with FILE  after training, fail unless the losses match FILE's (a training.json) within --tolerance
  --tar DIR            also write OUT's items as one tar (members demo/...) cut into DIR/demo.tar.000, .001, ...
                       of at most 15 MiB: `cat DIR/demo.tar.* | tar -x` at the repository root unpacks it
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Sequence

from serving_common.flags import EnvArgumentParser, positive_int

DEFAULT_PRESET = "cpu"


def parser(preset_name: str = DEFAULT_PRESET) -> EnvArgumentParser:
    """The flags, with the named preset's values as their defaults."""
    from demo_build.loop import TrainConfig
    from demo_build.presets import PRESETS

    preset = PRESETS[preset_name]
    p = EnvArgumentParser(env_prefix="GROK_TRAIN", prog="python -m demo_build",
                          description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog=__doc__.split("\n", 2)[2])
    p.add_env_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                       help="model config, corpus and training settings (demo_build/presets.py)")
    p.add_env_argument("--out", type=pathlib.Path, default=None, help="folder to write (required unless --stop-after)")
    p.add_env_argument("--config", default=preset.config, help="model config JSON (default: the preset's)")
    p.add_env_argument("--corpus", type=pathlib.Path, nargs="+", default=None,
                       help="folders of *.txt and *.jsonl, read in order (default: the preset's)")
    for field in dataclasses.fields(TrainConfig):
        p.add_env_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                           default=getattr(preset.train, field.name), help=f"TrainConfig.{field.name}")
    p.add_env_argument("--stop-after", type=positive_int, default=None, help="train only this many steps")
    p.add_env_argument("--compare-with", type=pathlib.Path, default=None, help="training.json to reproduce")
    p.add_env_argument("--tolerance", type=float, default=0.05, help="nats allowed by --compare-with")
    p.add_env_argument("--tar", type=pathlib.Path, default=None, help="also write the built folder as DIR/demo.tar.NNN")
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse once for --preset (or GROK_TRAIN_PRESET), then again with that preset's defaults."""
    known, _ = parser().parse_known_args(argv)
    return parser(known.preset).parse_args(argv)


def compare(recorded: dict, produced: dict, tolerance: float) -> list[str]:
    """The losses that differ by more than `tolerance` nats, as messages."""
    problems = []
    for name, want in recorded["losses"].items():
        got = produced["losses"].get(name)
        if got is None or abs(got - want) > tolerance:
            problems.append(f"{name}: recorded {want:.4f}, reproduced {got}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    from model_service.config import ConfigError, load_model_config
    from demo_build import record
    from demo_build.loop import TrainConfig
    from demo_build.presets import PRESETS, corpus_dirs

    train_cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    corpus = tuple(args.corpus) if args.corpus else corpus_dirs(PRESETS[args.preset].corpus)
    try:
        model_cfg = load_model_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.stop_after:
        log = record.train_prefix(model_cfg, train_cfg, corpus, args.stop_after)
        print(json.dumps({"log": [entry._asdict() for entry in log]}))
        return 0
    if args.out is None:
        print("error: --out is required (the folder to write the tokenizer, checkpoint and training.json)",
              file=sys.stderr)
        return 2
    command = " ".join(["python -m demo_build", *(sys.argv[1:] if argv is None else argv)])
    produced = record.build(model_cfg, train_cfg, corpus, args.out, args.config, command)
    tar = [str(part) for part in record.write_tar(args.out, args.tar)] if args.tar else None
    print(json.dumps({"out": str(args.out), "tar": tar, "losses": produced["losses"], "seconds": produced["seconds"]}))
    if args.compare_with:
        problems = compare(json.loads(args.compare_with.read_text()), produced, args.tolerance)
        for problem in problems:
            print(f"not reproduced: {problem}", file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
