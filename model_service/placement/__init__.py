"""Where a model's bytes go on each device, computed before anything loads: weights, table, KV pool, slot state
and a step's temporaries per device, for a device kind and count and a (data, expert, model) layout.

The weights are the in-memory leaves `checkpoint.load_params` places (int8 matrices, float32 scales, the table
in the compute dtype, float32 router and norms) split as `sharding.PARAM_RULES` split them, so the prediction is
the loaded arrays' own bytes (tests/test_placement.py checks it against `addressable_shards` on CPU meshes and
benchmarks/placement_check.py against the chip). The KV pool follows `sharding.POOL_SPEC`: KV heads split over
`model`, replicated over `data` (and `expert`). Temporaries are an estimate of a step's largest live set
(temporaries.py, checked against XLA's compiled temporaries). Loading holds, beside the weights placed so far, one
piece at a time (`piece_bytes`: an expert's matrix written into its layer stack), before the pool exists: the
device must hold the weights and that piece too (`Placement.loading`; tests/test_load_peak.py measures it).

The expert axis (--mesh DATA,EXPERT,MODEL): each expert's matrices on one expert group (num_experts / expert of
them, stacked as sharding.EXPERT_SPECS splits them), split over `model` inside it; attention, table and KV over
`model` only. The service runs every layout whose model axis divides the experts' 8 row blocks
(`Placement.runs_today`, config.validate).

    python -m model_service.placement --preset grok-1 --devices v5e-32 --dtype bfloat16 --slots 8 --context 8192
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jax.sharding import PartitionSpec

from model_service.config import ROW_BLOCKS, ConfigError, ModelConfig
from model_service.model.params import EMBED, TensorSpec, layer_specs, tensor_specs
from model_service.placement.temporaries import GENERIC_STEP_TOKENS, ITEMSIZE, temporary_bytes, widened_experts
from model_service.sampling_settings import MAX_ENDS, MAX_LOGIT_BIAS
from model_service.sharding import DATA, EXPERT, MODEL, POOL_SPEC, fit_spec, spec_for_path

if TYPE_CHECKING:
    from model_service.loading import ServerConfig

GB = 10**9
# Memory of one device of each kind, decimal GB as the vendors state it (the chips' own limit is a little higher:
# a v5e reports 15.7 GiB = 16.9 GB to JAX).
DEVICE_MEMORY = {"v5e": 16 * GB, "v6e": 32 * GB, "v5p": 95 * GB, "h100": 80 * GB}
BLOCK_SIZE = 16  # model/__init__.py: positions per KV block
WEIGHT_PARTS = ("experts", "attention", "scales", "router and norms", "table")


@dataclass(frozen=True)
class Devices:
    """`count` devices of `kind` with `memory` bytes each."""

    kind: str
    count: int
    memory: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.count}"

    @classmethod
    def parse(cls, text: str, memory: int | None = None) -> "Devices":
        """"v5e-32", "h100-8", "cpu-8" (cpu: the host's memory split N ways, unless `memory` gives it)."""
        match = re.fullmatch(r"(v5e|v6e|v5p|h100|cpu)-([0-9]+)", text.strip().lower())
        if not match or int(match.group(2)) < 1:
            raise ConfigError(f"--devices must be KIND-N with KIND one of v5e, v6e, v5p, h100, cpu and N >= 1 "
                              f"(e.g. v5e-32), got {text!r}")
        kind, count = match.group(1), int(match.group(2))
        if memory is None:
            memory = DEVICE_MEMORY[kind] if kind != "cpu" else host_memory() // count
        return cls(kind, count, memory)


def host_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Layout:
    """A mesh: `data` replicas x `expert` groups x `model` shards."""

    data: int = 1
    expert: int = 1
    model: int = 1

    @property
    def size(self) -> int:
        return self.data * self.expert * self.model

    @property
    def runs_today(self) -> bool:
        """Whether the service runs this mesh (config.validate's expert-axis rule: with expert groups the model
        axis divides the experts' ROW_BLOCKS row blocks); the model's own divisibility is layout_problems'."""
        return self.expert == 1 or ROW_BLOCKS % self.model == 0

    def __str__(self) -> str:
        return f"{self.data},{self.expert},{self.model}"

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """"DATA,EXPERT,MODEL", or "DATA,MODEL" (expert 1, as the service's --mesh)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ConfigError(f"--mesh must be DATA,EXPERT,MODEL or DATA,MODEL with positive integers (e.g. 1,4,8 "
                              f"or 1,8), got {text!r}")
        values = [int(p) for p in parts]
        return cls(values[0], 1, values[1]) if len(values) == 2 else cls(*values)


@dataclass(frozen=True)
class Workload:
    """What the service is asked to hold beside the weights: slots, the KV pool and a step's rows (a sequence's
    context is the model config's sequence_len)."""

    dtype: str = "bfloat16"
    slots: int = 8
    kv_tokens: int | None = None  # KV pool size in tokens (None: every slot a full context)
    block_size: int = BLOCK_SIZE
    step_tokens: int | None = None  # token rows a step (None: the backend's default)
    draft_tokens: int = 0  # speculative drafts a slot verifies per step
    # Bytes a table value takes (None: the compute dtype's). Native CPU products keep the checkpoint's bfloat16
    # (2; held in 13 bits where the values allow it, so 2 is an upper bound).
    table_itemsize: float | None = None
    # The step is one program whose phases (layers, draws, scores) reuse each other's buffers (the generic backend:
    # accelerators, or --backend generic); None: the backend's default on the devices (generic off CPU).
    one_program: bool | None = None


@dataclass(frozen=True)
class Part:
    """One kind of bytes on every device of the layout."""

    name: str
    bytes: int
    note: str


@dataclass(frozen=True)
class Placement:
    """A layout's bytes per device and whether they fit."""

    devices: Devices
    layout: Layout
    parts: tuple[Part, ...]
    kv_per_token: int  # KV bytes per token per device (keys and values, every layer)
    context: int  # tokens a sequence may hold (the config's sequence_len)
    block_size: int  # tokens per KV block
    problems: tuple[str, ...] = ()  # why the layout cannot run at all (axes that do not divide)
    piece: int = 0  # the most loading holds beside the weights (piece_bytes), before the pool and the step

    @property
    def used(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def loading(self) -> int:
        """The most a device holds while loading: every weight and the piece being written."""
        return sum(p.bytes for p in self.parts if p.name in WEIGHT_PARTS) + self.piece

    @property
    def left(self) -> int:
        return self.devices.memory - self.used

    @property
    def fits(self) -> bool:
        return not self.problems and self.left >= 0 and self.loading <= self.devices.memory

    @property
    def runs_today(self) -> bool:
        return self.layout.runs_today

    def part(self, name: str) -> int:
        return next(p.bytes for p in self.parts if p.name == name)

    @property
    def max_sequences(self) -> int:
        """Full-context sequences a KV pool could hold in what is left beside everything else (pool included;
        the pool's scratch block counted)."""
        room = self.left + self.part("kv pool")
        block = self.block_size * self.kv_per_token
        return max(0, (room // block - 1) // -(-self.context // self.block_size)) if block else 0

    def reason(self) -> str:
        """Why it does not fit, in numbers ('' when it does)."""
        if self.problems:
            return "; ".join(self.problems)
        if self.left >= 0 and self.loading <= self.devices.memory:
            return ""
        if self.left >= 0:
            return (f"loading holds {size_text(self.loading)} a device (the weights and a {size_text(self.piece)} "
                    f"piece), over the {size_text(self.devices.memory)} of one {self.devices.kind} device")
        listed = ", ".join(f"{p.name} {size_text(p.bytes)}" for p in self.parts if p.bytes)
        return (f"{size_text(self.used)} a device ({listed}) exceeds the {size_text(self.devices.memory)} of one "
                f"{self.devices.kind} device by {size_text(-self.left)} on mesh data,expert,model = {self.layout}")

    def to_dict(self) -> dict[str, object]:
        return {"devices": self.devices.name, "device_memory": self.devices.memory, "mesh": str(self.layout),
                "mesh_axes": ["data", "expert", "model"], "runs_today": self.runs_today,
                "per_device": {p.name: p.bytes for p in self.parts}, "notes": {p.name: p.note for p in self.parts},
                "used": self.used, "left": self.left, "loading": self.loading, "piece": self.piece, "fits": self.fits,
                "problems": list(self.problems),
                "kv_per_token": self.kv_per_token, "max_sequences": self.max_sequences, "context": self.context}


def size_text(n: int) -> str:
    """Bytes in decimal GB from 0.1 GB, else MB from 0.1 MB, else kB."""
    for unit, scale in (("GB", GB), ("MB", 10**6)):
        if abs(n) >= scale // 10:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1000:.1f} kB"


class _Axes:
    """The mesh shape fit_spec reads (`mesh.shape[axis]`), without devices."""

    def __init__(self, layout: Layout) -> None:
        self.shape = {DATA: layout.data, EXPERT: layout.expert, MODEL: layout.model}


def _shard_elements(shape: tuple[int, ...], spec: PartitionSpec, layout: Layout) -> int:
    """Elements of one device's shard of an array `spec` splits, as the service's shardings split it (fit_spec:
    an axis that does not divide its dimension leaves it whole)."""
    axes = _Axes(layout)
    fitted = fit_spec(spec, shape, axes)  # type: ignore[arg-type]
    entries = list(fitted) + [None] * (len(shape) - len(fitted))
    return math.prod(dim // (axes.shape[e] if e else 1) for dim, e in zip(shape, entries))


def _leaves(spec: TensorSpec, dtype: str, table_itemsize: float | None = None, stacked: bool = False
            ) -> Iterator[tuple[str, str, tuple[int, ...], float, int]]:
    """(part, path, shape, itemsize, copies) of the in-memory arrays params.to_internal makes of a leaf: int8
    matrices column-parallel transposed [N, K], float32 scales [blocks, N], one pair per expert (`stacked`, an
    expert axis: one [E, K, N] int8 array and its [E, blocks, N] scales, split over it); the table in the compute
    dtype; everything else float32."""
    base = f"{spec.module}/{spec.name}"
    if spec.quantized and stacked and len(spec.shape) == 3:
        e, k, n = spec.shape
        yield "experts", f"{base}/weight", (e, k, n), 1, 1
        yield "scales", f"{base}/scales", (e, spec.blocks, n), 4, 1
    elif spec.quantized:
        k, n = spec.shape[-2:]
        weight = (n, k) if spec.blocks == 1 else (k, n)
        experts = len(spec.shape) == 3
        path = f"{base}/experts/0" if experts else base
        kind = "experts" if experts else "attention"
        copies = spec.shape[0] if experts else 1
        yield kind, f"{path}/weight", weight, 1, copies
        yield "scales", f"{path}/scales", (spec.blocks, n), 4, copies
    elif spec.module == EMBED:
        yield "table", base, spec.shape, table_itemsize or ITEMSIZE[dtype], 1
    else:
        yield "router and norms", base, spec.shape, 4, 1


def weight_bytes(cfg: ModelConfig, layout: Layout, dtype: str, table_itemsize: float | None = None) -> dict[str, int]:
    """Bytes per device of each weight part: experts (int8), attention (int8), scales, router and norms, table."""
    totals = {"experts": 0, "attention": 0, "scales": 0, "router and norms": 0, "table": 0}
    per_group = -(-cfg.model.num_experts // layout.expert)  # experts each expert group holds
    for spec in tensor_specs(cfg):
        for part, path, shape, itemsize, copies in _leaves(spec, dtype, table_itemsize, layout.expert > 1):
            held = per_group if copies > 1 else 1
            totals[part] += int(held * _shard_elements(shape, spec_for_path(path), layout) * itemsize)
    return totals


def piece_bytes(cfg: ModelConfig, layout: Layout, dtype: str) -> int:
    """Bytes per device of the largest array loading places at a time beside the weights: a layer's tensor, or one
    expert's matrix of an MoE tensor, placed while it is written into its layer stack (stacking.write_pieces waits
    for each write before placing the next). Counted on every layout (unstacked layers place no such piece: an
    overestimate by at most this)."""
    return max(int(_shard_elements(shape, spec_for_path(path), layout) * itemsize)
               for spec in layer_specs(cfg, 0) for _, path, shape, itemsize, _ in _leaves(spec, dtype))


def kv_per_token(cfg: ModelConfig, layout: Layout, dtype: str, block_size: int = BLOCK_SIZE) -> int:
    """KV bytes a token takes on each device: keys and values of every layer, KV heads split over `model` when
    it divides them (sharding.POOL_SPEC), replicated over data and expert."""
    t = cfg.model
    block = (1, t.num_kv_heads, block_size, t.key_size)
    per_block = _shard_elements(block, POOL_SPEC, layout) * ITEMSIZE[dtype]
    return t.num_layers * 2 * per_block // block_size


def pool_blocks(cfg: ModelConfig, work: Workload) -> int:
    """The pool's blocks (the engine's: --kv-tokens, else every slot a full context), without the scratch block."""
    if work.kv_tokens is not None:
        return -(-work.kv_tokens // work.block_size)
    return work.slots * -(-cfg.sequence_len // work.block_size)


def slot_state_bytes(cfg: ModelConfig, work: Workload) -> int:
    """engine_state.SlotState on every device (replicated): per slot a mask, prompt flags and draw counts over
    the vocabulary ([S, V] bool, bool, int32), its key, sampling settings and controls."""
    v = cfg.vocab_size
    per_slot = (v + v + 4 * v) + 8 + 4 + (4 + 4 + 1 + 4) + (5 * 4 + MAX_LOGIT_BIAS * 8 + 4 + MAX_ENDS * 4)
    return work.slots * per_slot


def layout_problems(cfg: ModelConfig, layout: Layout) -> list[str]:
    """Why `layout` cannot hold `cfg` at all (the service's validate() for model; experts per expert group)."""
    t, problems = cfg.model, []
    if t.num_kv_heads % layout.model or t.num_q_heads % layout.model:
        problems.append(f"the model axis ({layout.model}) must divide num_kv_heads ({t.num_kv_heads}) and "
                        f"num_q_heads ({t.num_q_heads})")
    if t.num_experts % layout.expert:
        problems.append(f"the expert axis ({layout.expert}) must divide num_experts ({t.num_experts})")
    return problems


def place(cfg: ModelConfig, devices: Devices, layout: Layout, work: Workload) -> Placement:
    """The bytes per device of `cfg` on `layout` over `devices` (which must hold the layout)."""
    problems = layout_problems(cfg, layout)
    if layout.size > devices.count:
        problems.append(f"mesh {layout} needs {layout.size} devices, {devices.name} has {devices.count}")
    if work.dtype not in ITEMSIZE:
        raise ConfigError(f"dtype must be one of {sorted(ITEMSIZE)}, got {work.dtype!r}")
    w = weight_bytes(cfg, layout, work.dtype, work.table_itemsize)
    per_token = kv_per_token(cfg, layout, work.dtype, work.block_size)
    pool = (pool_blocks(cfg, work) + 1) * work.block_size * per_token  # + the scratch block
    group = f"experts a group: {-(-cfg.model.num_experts // layout.expert)}"
    parts = (
        Part("experts", w["experts"], f"int8, {group}, hidden dim split over model ({layout.model})"),
        Part("attention", w["attention"], f"int8 q/k/v/o, heads split over model ({layout.model}), replicated "
                                          "over expert and data"),
        Part("scales", w["scales"], "float32 scales of the int8 matrices"),
        Part("router and norms", w["router and norms"], "float32, replicated"),
        Part("table", w["table"], f"{'bfloat16 as stored' if work.table_itemsize else work.dtype} [vocab, emb], "
                                  "emb split over model"),
        Part("kv pool", pool, f"{work.dtype}, KV heads split over model, replicated over data and expert "
                              f"(today's pool spec)"),
        Part("slot state", slot_state_bytes(cfg, work), "per-slot sampling state, replicated"),
        Part("temporaries", temporary_bytes(cfg, layout, work, devices.kind == "cpu",
                                            widened_experts(cfg, layout, devices.kind, work)),
             "estimate: a step's largest live set (one program off CPU: its largest phase; the "
                         "larger of two programs on it)"),
    )
    return Placement(devices, layout, parts, per_token, cfg.sequence_len, work.block_size, tuple(problems),
                     piece_bytes(cfg, layout, work.dtype))


def candidate_layouts(cfg: ModelConfig, count: int) -> list[Layout]:
    """Layouts over exactly `count` devices, smallest replica (expert x model) first; at equal size expert = 1
    (what runs today) first, then fewer expert groups."""
    t = cfg.model
    found = [Layout(count // (x * m), x, m) for x in range(1, t.num_experts + 1) for m in range(1, t.num_kv_heads + 1)
             if not t.num_experts % x and not t.num_kv_heads % m and not t.num_q_heads % m and not count % (x * m)]
    return sorted(found, key=lambda lay: (lay.expert * lay.model, lay.expert, lay.data))


def choose(cfg: ModelConfig, devices: Devices, work: Workload, layout: Layout | None = None) -> Placement:
    """`layout`'s placement, or the smallest layout over all the devices that fits (else the one closest to it)."""
    if layout is not None:
        return place(cfg, devices, layout, work)
    tried = [place(cfg, devices, lay, work) for lay in candidate_layouts(cfg, devices.count)]
    if not tried:
        raise ConfigError(f"no layout of {devices.count} devices divides the model's experts and heads")
    return next((p for p in tried if p.fits), max(tried, key=lambda p: p.left))


def max_layers(cfg: ModelConfig, devices: Devices, layout: Layout, work: Workload) -> int:
    """The most layers of `cfg`'s width that fit `layout` (0: not even one)."""
    best = 0
    for layers in range(1, cfg.model.num_layers + 1):
        if not place(with_layers(cfg, layers), devices, layout, work).fits:
            break
        best = layers
    return best


def with_layers(cfg: ModelConfig, layers: int) -> ModelConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))


def check_service(config: ServerConfig) -> Placement:
    """Refuse, before anything loads, a model service whose weights, pool and step do not fit its devices: raises
    ConfigError with the numbers. Device memory is what JAX reports (`bytes_limit`), on CPU the host's memory
    shared by this process's devices."""
    import jax

    from model_service.config import load_model_config
    from model_service.loading import kv_blocks

    cfg = load_model_config(config.config)
    device = jax.local_devices()[0]
    work = _service_workload(config, cfg, kv_blocks, _native_products(config, device))
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    cpu = device.platform == "cpu"
    memory = stats["bytes_limit"] if stats and "bytes_limit" in stats else host_memory() // jax.local_device_count()
    devices = Devices("cpu" if cpu else device.platform, config.mesh.size, memory)
    p = place(cfg, devices, Layout(config.mesh.data, config.mesh.expert, config.mesh.model), work)
    if p.problems or p.fits:
        return p  # a layout that cannot run at all is validate()'s to refuse, with its own message
    raise ConfigError(f"the model does not fit its devices: {p.reason()}. Use more devices (a larger model axis), "
                      f"fewer --slots or a smaller --kv-tokens (beside the rest there is room for {p.max_sequences:,} "
                      f"full {p.context:,}-token sequences), or --dtype bfloat16; "
                      f"`python -m model_service.placement` computes layouts that fit")


def _service_workload(config: ServerConfig, cfg: ModelConfig, kv_blocks: Callable[..., int | None],
                      native: bool) -> Workload:
    blocks = kv_blocks(config, cfg, ITEMSIZE.get(config.dtype, 4))
    drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    step_tokens = config.step_tokens or (GENERIC_STEP_TOKENS if config.backend == "generic" else None)
    return Workload(config.dtype, config.slots, None if blocks is None else blocks * config.block_size,
                    config.block_size, step_tokens, drafts, 2.0 if native else None,
                    True if config.backend == "generic" else None)


def _native_products(config: ServerConfig, device: Any) -> bool:
    """Whether the service will pack its weights for the native CPU kernel (backend.choose_products' choice)."""
    import numpy as np
    from jax.sharding import Mesh

    from model_service.backend import choose_products

    if device.platform != "cpu" or config.backend == "generic":
        return False
    try:
        return choose_products(config.products, Mesh(np.array([device]), ("one",)), config.dtype).native
    except ValueError:
        return False  # a choice that cannot run: the service refuses it itself, with its own message
