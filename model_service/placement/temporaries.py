"""A step's temporaries per device: what XLA holds beside the weights, the pools and the slot state while a step runs.

The accelerators' step (and the CPU's `--backend generic`) is one program (engine.py `_program_impl`): the layers
run one after another in a loop, then the draws, then the prompt scores a tile at a time (`jax.lax.map`), so XLA
reuses one phase's buffers for the next and the program's peak is its largest phase, not the sum of them. That
estimate is `one_program_bytes`: the rows' activations (carried through every phase) plus the largest of
  attention  one key chunk's gathered keys and values and three float32 score buffers
             (segments.attend_segments: single-row lanes and row blocks);
  experts    the grouped form of the backend (backend.choose_moe): the Pallas kernel (one TPU) widens int8 in its
             tiles, so only the expert-sorted pair rows live ([pairs aligned to row tiles, ffn] three times: both
             branches and their gated product); XLA's ragged_dot (other single devices) widens every expert's
             three matrices and writes [pairs, experts * ffn]; a mesh's per-expert conditionals one expert's three
             matrices;
  head       the draws' float32 [draws, vocab] buffers and two float32 [score tile, vocab] buffers (the tile's
             logits and their log-softmax; the generic backend's tile is the step's rows).
Checked against XLA's own compiled temporaries (`memory_analysis().temp_size_in_bytes` of the step program,
benchmarks/placement_check.py --temporaries; 8 slots, 1,024 rows, tests/test_temporaries.py):
  XLA:TPU (v5e, JAX 0.10.2) Grok-1 width, 1 layer, bfloat16, 8,192 KV tokens: 0.830 GB, estimate 1.19 GB (0.70;
  the head's phase; its experts' phase counts 0.82 GB: which phase the chip's peak is in was not measured);
  XLA:CPU golden 0.73 (bfloat16) and 0.93 (float32), medium 0.95, Grok-1 width 1 layer bfloat16 (ragged_dot:
  20.0 GB) 0.90; golden on a 2,4 mesh (float32, per device) 0.66.
XLA:CPU computes bfloat16 elementwise work in float32, so on the cpu kind those buffers count 4 bytes an element.

The CPU backend's step is two programs (rows, then draws and scores) run one after the other: `two_program_bytes`,
the larger of the two (XLA-CPU's compiled temporaries were 0.94-0.98 of it on one device; an upper bound on a mesh).
"""

from __future__ import annotations

from typing import Protocol

from model_service.config import ModelConfig
from model_service.model.segments import BLOCK_ROWS, capacities


class Layout(Protocol):
    """What the estimate reads of placement.Layout (imported from there would make an import cycle)."""

    @property
    def data(self) -> int: ...
    @property
    def model(self) -> int: ...
    @property
    def size(self) -> int: ...


class Workload(Protocol):
    """What the estimate reads of placement.Workload."""

    @property
    def dtype(self) -> str: ...
    @property
    def slots(self) -> int: ...
    @property
    def step_tokens(self) -> int | None: ...
    @property
    def draft_tokens(self) -> int: ...
    @property
    def one_program(self) -> bool | None: ...

ITEMSIZE = {"bfloat16": 2, "float32": 4}
GENERIC_STEP_TOKENS, CPU_STEP_TOKENS = 1024, 64  # backend.py's token rows a step (generic / cpu; a test keeps them equal)
KEY_CHUNK = 128  # model/__init__.py: key positions per attention chunk
TPU_KINDS = ("v5e", "v6e", "v5p", "tpu")  # "tpu": what jax calls the platform (the service's startup check)
KERNEL_ROW_TILE = 128  # grouped.TILING.rows: the Pallas kernel's row tile (each expert's pairs start a tile)
DRAW_BUFFERS = 12  # float32 [draws, vocab] buffers of the sampler live at once (at most 12 seen on XLA:CPU)
SCORE_BUFFERS = 2  # float32 [score tile, vocab]: the logits and their log-softmax (XLA:CPU medium holds both)


def widened_experts(cfg: ModelConfig, layout: Layout, kind: str, work: Workload) -> int:
    """Experts whose matrices a step widens to the compute dtype at once (backend.choose_moe): none with the Pallas
    kernel (one TPU in bfloat16: it widens tiles), all of them with XLA's ragged_dot (other single devices, generic
    step), one at a time with a conditional per expert (meshes, the CPU backend, float32 on a TPU: the faithful
    mode keeps them)."""
    if layout.size > 1 or not (kind != "cpu" or work.one_program):
        return 1
    if kind in TPU_KINDS:
        return 1 if work.dtype == "float32" else 0
    return cfg.model.num_experts


class _Shapes:
    """The per-device sizes both estimates read."""

    def __init__(self, cfg: ModelConfig, layout: Layout, work: Workload, cpu: bool) -> None:
        t = cfg.model
        self.size = ITEMSIZE[work.dtype]
        self.rows = max(work.step_tokens or (CPU_STEP_TOKENS if cpu else GENERIC_STEP_TOKENS), work.slots)
        m = layout.model if t.num_kv_heads % layout.model == 0 else 1
        self.q_heads, self.kv_heads, self.f = t.num_q_heads // m, t.num_kv_heads // m, t.ffn_size // m
        self.chunk = min(KEY_CHUNK, cfg.sequence_len)
        self.shard = -(-self.rows // layout.data)  # the rows split over data (sharding.constrain)
        self.draws = work.slots * (1 + work.draft_tokens)

    def activations(self, cfg: ModelConfig, size: int) -> int:
        t = cfg.model
        return self.shard * (4 * t.emb_size + (self.q_heads + 2 * self.kv_heads) * t.key_size) * size

    def attention(self, cfg: ModelConfig, readers: int, queries: int, size: int) -> int:
        return self.chunk * (readers * 2 * self.kv_heads * cfg.model.key_size * size + queries * 3 * self.q_heads * 4)


def two_program_bytes(cfg: ModelConfig, layout: Layout, work: Workload, cpu: bool, widened: int) -> int:
    """The CPU backend's step: the larger of its rows program (activations, every row's attention chunk, one
    expert's hidden rows and `widened` experts' three matrices widened) and its draws program (three float32
    [draws, vocab] buffers of the draws and four float32 [rows, vocab] of the scored rows)."""
    s, t = _Shapes(cfg, layout, work, cpu), cfg.model
    rows_program = s.activations(cfg, s.size) + s.attention(cfg, s.shard, s.shard, s.size)
    rows_program += s.shard * 3 * s.f * s.size + widened * 3 * s.f * t.emb_size * s.size
    if widened != 1:  # the grouped forms: every (row, expert) pair's input, output and gated output at once
        rows_program += 3 * s.shard * t.num_selected_experts * t.emb_size * s.size
    draws_program = 3 * s.draws * cfg.vocab_size * 4 + 4 * s.rows * cfg.vocab_size * 4
    return max(rows_program, draws_program)


def kernel_rows(pairs: int, experts: int) -> int:
    """Rows of the Pallas kernel's aligned pair layout (grouped.aligned_rows): every expert's pairs from a tile."""
    tile = min(KERNEL_ROW_TILE, -(-pairs // 16) * 16)
    return -(-(pairs + experts * (tile - 1)) // tile) * tile


def expert_bytes(cfg: ModelConfig, s: _Shapes, widened: int, size: int) -> int:
    """The experts' largest live set in one layer (see the module docstring), `size` bytes an element."""
    t = cfg.model
    d, f, pairs = t.emb_size, s.f, s.shard * t.num_selected_experts
    if widened == 0:  # Pallas: aligned pair rows in and out, both branches and their gated product; the pairs
        aligned = kernel_rows(pairs, t.num_experts)  # gathered in sorted order, put back, and gated
        return aligned * (3 * f + 2 * d) * size + 3 * pairs * d * size
    if widened == 1:  # a conditional per expert: its rows' hidden values and its three matrices widened
        return s.shard * 3 * f * size + 3 * f * d * size
    # ragged_dot: every expert's three matrices widened, its [pairs, experts * ffn] product, the branches
    return 3 * widened * f * d * size + pairs * widened * f * size + 2 * pairs * f * size + 2 * pairs * d * size


def one_program_bytes(cfg: ModelConfig, layout: Layout, work: Workload, cpu: bool, widened: int) -> int:
    """The one-program step's largest live set: activations plus the largest of attention, experts and head."""
    s = _Shapes(cfg, layout, work, cpu)
    size = 4 if cpu else s.size  # XLA:CPU widens bfloat16 elementwise work to float32
    lanes, blocks = capacities(s.rows, work.slots)
    # not split over data: on golden's 2,4 mesh XLA:CPU held more than the data axis's share of them
    readers, queries = lanes + blocks, lanes + blocks * BLOCK_ROWS
    head = DRAW_BUFFERS * s.draws * cfg.vocab_size * 4 + SCORE_BUFFERS * s.rows * cfg.vocab_size * 4
    phases = (s.attention(cfg, readers, queries, size), expert_bytes(cfg, s, widened, size), head)
    return s.activations(cfg, size) + max(phases)


def temporary_bytes(cfg: ModelConfig, layout: Layout, work: Workload, cpu: bool = False, widened: int = 1) -> int:
    """An estimate of a step's largest live buffers per device: one program's largest phase off CPU (or with
    `work.one_program`), else the larger of the CPU backend's two programs (module docstring)."""
    one_program = (not cpu) if work.one_program is None else work.one_program
    if one_program:
        return one_program_bytes(cfg, layout, work, cpu, widened)
    return two_program_bytes(cfg, layout, work, cpu, widened)
