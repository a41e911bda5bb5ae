"""Named training runs: which model config, which corpus folders and which TrainConfig make each demo model.

`cpu` is the small model CI trains a few steps of (configs/demo.json, the hand-written corpus, float32 on two
cores); `tpu` is the larger embedded default, sized for one accelerator chip (configs/demo-large.json, the
hand-written corpus plus corpus/large/: the Debian FAQ, this repository's docs, short answers and JSON
answers). Flags still override any field (`python -m demo_build --preset tpu --steps 50`).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from demo_build.loop import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Preset:
    config: str  # model config JSON, relative to the repository root
    corpus: tuple[str, ...]  # corpus folders, relative to the repository root, read in this order
    train: TrainConfig


PRESETS = {
    "cpu": Preset("configs/demo.json", ("demo_build/corpus",), TrainConfig()),
    # Chip budget (docs/demo.md): the trainer computes all 8 experts densely, so a step costs
    # 6 * 28.9M params * 32 * 512 tokens = 2.8 TFLOP (+ 7 % attention); 1500 steps are 4.3 PFLOP, 73 s at 30 % of
    # a v5e's 197 TFLOP/s, and still under 4 minutes at 10 %.
    "tpu": Preset("configs/demo-large.json", ("demo_build/corpus", "demo_build/corpus/large"),
                  TrainConfig(steps=1500, batch_size=32, seq_len=512, learning_rate=2e-3, warmup_steps=100,
                              log_every=50, eval_windows=16)),
}


def corpus_dirs(folders: tuple[str, ...]) -> tuple[pathlib.Path, ...]:
    return tuple(ROOT / folder for folder in folders)
