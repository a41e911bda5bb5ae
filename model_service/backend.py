"""The hardware seam: every choice that depends on the machine, made once, in one value.

The model code and the engine run one program for every step; what differs between a 2-core CPU and an
accelerator is how that program computes, and it is all here:

  products    how token rows meet the weights (layers.Products: the native int8 kernel on CPU, XLA's dots
              elsewhere);
  attention   per-row attention ("native": the native kernel, on one device; "rows": XLA, each row its own
              program over its own keys: either way a row's bits never depend on the others, and idle rows
              cost nothing) or one batched computation ("batched"; "pallas": batched, its decode rows through
              the Pallas kernel, which reads each row's own blocks only: auto's choice on one TPU device in
              bfloat16, choose_attention);
  tile_rows   rows per pass over the weights (a tile streams each weight once for its rows);
  step_tokens token rows per step (prompt and decode rows together);
  native_sampling  the sampler's nucleus threshold and its list of kept entries (the draw's noise for those only)
              from the native kernels (one device, native products);
  vectorised_sampling  the sampler over a step's draws at once, stage by stage (accelerators) rather than one draw
              after another (CPU: a draw's unused branches then cost nothing);
  row_buckets the row counts a step program is compiled for (accelerators: a step runs the least bucket holding
              its rows, every bucket compiled before serving; CPU: none, its few-rows program is the engine's);
  one_program a step is one program (rows, draws and scores together; accelerators) rather than two (CPU);
  exact_f32   float32 products carried to float32 accuracy on a platform whose matrix units multiply float32 in
              one bfloat16 pass by default (TPU): the faithful mode (layers.Products.EXACT).
  moe         how the experts run (model/moe.py, model/grouped.py): "cond" (CPU: the native grouped product, or a
              conditional per expert; experts one buffer each), "pallas" (one TPU device: the Pallas grouped
              product over expert-sorted rows, int8 widened in its tiles) or "ragged" (other single devices: XLA's
              ragged_dot over the same stacked experts) or "expert" (a mesh with an expert axis: each expert group
              runs the conditionals over its own stacked experts, one reduction a layer). The stacked forms load
              the experts stacked (weights.GroupedWeight); other meshes of several devices keep "cond".
  scan_layers the decoder layers as one loop over parameters and KV pools stacked along a leading layer axis
              (generic, by default: a program, and its compile time, the same at any depth) rather than unrolled,
              one copy of a layer per layer (CPU: its native kernels take each layer's own buffers).

`choose_backend("cpu" | "generic" | "auto", ...)`: "cpu" is what a CPU runs best (native products where the
kernels built, per-row attention, tiles of CPU_TILE rows); "generic" is what an accelerator runs (XLA's
dot_general products, batched attention, the whole step one tile). "auto" takes "cpu" on a CPU platform and
"generic" elsewhere. CI runs the golden parity tests on both, the generic one on CPU with XLA's own products.
No other module asks what the platform is, and the model never asks which backend it runs on: ops.for_backend
derives from this value the operations the model calls (model_service/ops/: ops/native.py the CPU's native
kernels, ops/xla.py XLA's forms, ops/grouped.py the stacked experts' grouped forms), in one place.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from model_service import kernels
from model_service.config import (ATTENTION_CHOICES, BACKENDS, CPU_STEP_TOKENS, GENERIC_STEP_TOKENS, LAYERS_CHOICES,
                                  MOE_CHOICES, PRODUCT_CHOICES, ModelConfig)
from model_service.model.layers import Products
from model_service.model.packed import native_ok

log = logging.getLogger(__name__)

CPU_TILE = 64  # rows per tile on CPU: fewer would stream the weights more often; idle rows cost next to nothing
# Row counts the accelerator's step is compiled for (below the step's rows, which is always one): decode of up to
# 16 / 64 streams, a few short prompts, and 256 / 512 for batches of prompts (on a v5e, 8 x 32 prompt rows at
# Grok-1 width ran their experts over all 1,024 rows' padding without them). Each is a program compiled before
# serving, side by side (engine.compile_threads); rows are nearly free on a matrix unit until ~128.
GENERIC_ROW_BUCKETS = (16, 64, 128, 256, 512)


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu" or "generic"
    products: Products
    attention: str  # "native", "rows" or "batched" (ops.for_backend)
    tile_rows: int
    step_tokens: int
    native_sampling: bool
    vectorised_sampling: bool = False
    row_buckets: tuple[int, ...] = ()
    one_program: bool = False
    exact_f32: bool = False
    moe: str = "cond"
    scan_layers: bool = False

    @property
    def stacked_experts(self) -> bool:
        """Whether the experts load stacked, one int8 buffer per matrix (weights.GroupedWeight)."""
        return self.moe != "cond"


def platform(mesh: Mesh) -> str:
    return mesh.devices.flat[0].platform


def choose_products(choice: str, mesh: Mesh, dtype: Any) -> Products:
    """--products on the CPU backend (the generic backend takes "int8": rows rounded to int8 meet the int8 weights
    on the matrix unit, Products.DOT_INT8, an opt-in that changes results; else its own): "xla" (XLA's fused
    multiply-reduce forms), "native" (the native CPU kernel;
    an error where it cannot run), "native-int8" (native with the rows rounded to int8 before they meet an int8
    weight: faster prompts and batches on CPUs with AVX-512 VNNI, slower elsewhere, where it logs a warning;
    changes results; an opt-in, an error where native cannot run) or "auto" (native in float32 where the kernel
    loaded and the replica is one process; XLA's forms elsewhere)."""
    import jax

    if choice not in PRODUCT_CHOICES:
        raise ValueError(f"products must be one of {', '.join(PRODUCT_CHOICES)}, got {choice!r}")
    if choice == "int8":
        raise ValueError("--products int8 (int8 rows on a matrix unit) runs on the generic backend (--backend "
                         "generic); the cpu backend's int8 rows are --products native-int8")
    cpu = platform(mesh) == "cpu"
    if choice == "xla":
        return Products.FUSED_REDUCE if cpu else accelerator_products(mesh, dtype)
    # A replica spanning processes keeps XLA's forms under auto: packing reads each whole matrix in every
    # process, where XLA's layouts let each process read only the shards its devices hold.
    if cpu and native_ok(dtype) and (choice.startswith("native") or jax.process_count() == 1):
        if choice == "native-int8" and not kernels.int8_accelerated():
            log.warning("--products native-int8 on a CPU without AVX-512 VNNI: its int8 rows multiply int16 pairs "
                        "there, no faster than float32 (half native's decode rate at Grok-1 width on AVX2), and "
                        "change results: use --products native")
        return Products.NATIVE_INT8 if choice == "native-int8" else Products.NATIVE
    if choice.startswith("native"):
        raise ValueError(f"--products {choice} needs the CPU platform, --dtype float32 and the native kernels built "
                         "(pip install -e . compiles them; the log says why they did not load): use --products xla")
    return Products.FUSED_REDUCE if cpu else accelerator_products(mesh, dtype)


def accelerator_products(mesh: Mesh, dtype: Any) -> Products:
    """XLA's dots; in float32 on a TPU, whose matrix unit rounds float32 operands to bfloat16 by default, carried
    to float32 accuracy (Products.EXACT: the faithful mode)."""
    return Products.EXACT if jnp.dtype(dtype) == jnp.float32 and platform(mesh) == "tpu" else Products.DOT


def row_buckets(step_rows: int, buckets: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The row counts a step program is compiled for: the `buckets` (default GENERIC_ROW_BUCKETS) below
    `step_rows`, then `step_rows` itself."""
    chosen = GENERIC_ROW_BUCKETS if buckets is None else buckets
    if any(b < 1 for b in chosen):
        raise ValueError(f"row buckets are positive row counts, got {list(chosen)}")
    return tuple(sorted({b for b in chosen if b < step_rows})) + (step_rows,)


def choose_backend(choice: str, mesh: Mesh, dtype: Any, products: str = "auto", slots: int = 1,
                   step_tokens: int | None = None, tile_rows: int | None = None,
                   buckets: tuple[int, ...] | None = None, moe: str = "auto", layers: str = "auto",
                   attention: str = "auto", block_size: int | None = None,
                   heads: tuple[int, int] | None = None) -> Backend:
    """The backend for `mesh` (see the module docstring); `step_tokens` / `tile_rows` override its shape (a step
    holds at least one row per slot and whole tiles), `buckets` the accelerator's row buckets, `moe` how the
    generic backend runs the experts (choose_moe), `layers` (--layers) whether it scans its layers ("scan") or
    unrolls them ("unroll"; the cpu backend always does), `attention` (--attention) the generic backend's attention
    (choose_attention, which reads the KV `block_size` and the attention's `heads`). "auto" scans the generic
    backend's layers (on a TPU v5e medium's scanned program compiled in 59 s against 82 s unrolled and stepped as
    fast or faster: benchmarks/measured/device-tpu-v5e.json), except on an accelerator mesh with an expert axis, whose per-layer
    experts a scanned step would slice out (a copy) every step."""
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if layers not in LAYERS_CHOICES:
        raise ValueError(f"--layers must be one of {', '.join(LAYERS_CHOICES)}, got {layers!r}")
    name = choice if choice != "auto" else ("cpu" if platform(mesh) == "cpu" else "generic")
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got {attention!r}")
    if name == "cpu" and attention != "auto":
        raise ValueError(f"--attention {attention} is the generic backend's choice (the cpu backend attends row by "
                         "row): use --backend generic, or --attention auto")
    if name == "cpu" and layers == "scan":
        raise ValueError("--layers scan runs on the generic backend (the cpu backend's kernels take each layer's own "
                         "buffers): use --backend generic, or --layers auto")
    if name == "cpu":
        chosen = choose_products(products, mesh, jnp.dtype(dtype))
        rows = max(step_tokens or CPU_STEP_TOKENS, slots)
        tile = min(tile_rows or CPU_TILE, rows)
        # The native kernel keeps the softmax weights in float32; in bfloat16 the reference rounds them to
        # bfloat16 first, which XLA's per-row form does.
        native_attention = kernels.available() and mesh.size == 1 and jnp.dtype(dtype) == jnp.float32
        attention = "native" if native_attention else "rows"
    else:
        if products.startswith("native"):
            raise ValueError(f"--products {products} runs on the cpu backend only (--backend cpu)")
        if products not in PRODUCT_CHOICES:
            raise ValueError(f"products must be one of {', '.join(PRODUCT_CHOICES)}, got {products!r}")
        chosen = Products.DOT_INT8 if products == "int8" else accelerator_products(mesh, jnp.dtype(dtype))
        rows = max(step_tokens or GENERIC_STEP_TOKENS, slots)
        tile = min(tile_rows or rows, rows)
        attention = choose_attention(attention, mesh, dtype, block_size, heads)
    if tile < 1:
        raise ValueError(f"a tile holds at least one row, got {tile}")
    rows = -(-rows // tile) * tile
    native = native_sampling(chosen, mesh)
    if name == "cpu":
        return Backend(name, chosen, attention, tile, rows, native, moe=choose_moe(name, mesh, moe))
    # A bucket runs in tiles of min(tile, bucket) rows: one at least a tile long is rounded up to whole tiles.
    fitted = row_buckets(rows, tuple(b if b < tile else -(-b // tile) * tile
                                     for b in (GENERIC_ROW_BUCKETS if buckets is None else buckets)))
    moe_choice = choose_moe(name, mesh, moe, faithful=chosen is Products.EXACT)
    return Backend(name, chosen, attention, tile, rows, native, vectorised_sampling=True, row_buckets=fitted,
                   one_program=True, exact_f32=chosen is Products.EXACT, moe=moe_choice,
                   scan_layers=scan_layers(layers, mesh, moe_choice))


def choose_attention(choice: str, mesh: Mesh, dtype: Any = jnp.float32, block_size: int | None = None,
                     heads: tuple[int, int] | None = None) -> str:
    """Backend.attention on the generic backend for --attention `choice`: "batched" (XLA) or "pallas" (one TPU
    device: decode rows read their own blocks through the kernel; prompt chunks attend as batched). "auto" is
    pallas on one TPU device in bfloat16 where the KV blocks fill the kernel's tiles (`block_size` a multiple of
    its least) and the heads fill its tiles as those compiled on the chip do (`heads`, (query heads, KV heads x
    head size): paged_attention.fills_tiles; the demo's 8 query heads and the golden test models' 64-wide keys keep
    batched): medium's
    decode at a 2,048-token context took 0.43-0.56x of batched's step on a v5e,
    benchmarks/measured/device-tpu-v5e-attention-kernel.json), batched elsewhere: float32, the faithful mode, keeps
    XLA's accurate transcendentals (the kernel's tanh and exp are the chip's own)."""
    if choice == "auto":
        if platform(mesh) != "tpu" or mesh.size > 1 or jnp.dtype(dtype) != jnp.bfloat16:
            return "batched"
        from model_service.kernels.tpu.paged_attention import fills_tiles, min_block_size  # Pallas' TPU module

        blocks_fit = block_size is None or block_size % min_block_size(dtype) == 0
        return "pallas" if blocks_fit and (heads is None or fills_tiles(*heads, dtype)) else "batched"
    if choice != "pallas":
        return "batched"
    if platform(mesh) != "tpu":
        raise ValueError("--attention pallas runs on a TPU (its kernel compiles for one): use --attention batched")
    if mesh.size > 1:
        raise ValueError(f"--attention pallas runs on one device; a mesh of {mesh.size} devices takes --attention "
                         "batched")
    return "pallas"


def attention_heads(cfg: ModelConfig) -> tuple[int, int]:
    """(query heads, a position's key width: KV heads x head size) of `cfg`, as choose_attention reads them."""
    return cfg.model.num_q_heads, cfg.model.num_kv_heads * cfg.model.key_size


def native_sampling(products: Products, mesh: Mesh) -> bool:
    """Backend.native_sampling: the native kernels find the nucleus where products are native on one device (under
    a mesh the logits are sharded, and XLA's search runs)."""
    return products.native and mesh.size == 1


def with_choices(backend: Backend, mesh: Mesh, products: Products | None = None,
                 attention: str | None = None) -> Backend:
    """`backend` with explicit products / attention (tests, tools) in place of its own, and what follows from the
    products derived again."""
    chosen = products or backend.products
    return dataclasses.replace(backend, products=chosen, attention=attention or backend.attention,
                               native_sampling=native_sampling(chosen, mesh))


def scan_layers(layers: str, mesh: Mesh, moe: str) -> bool:
    """Whether the generic backend scans its layers for --layers `layers` (see choose_backend)."""
    if layers != "auto":
        return layers == "scan"
    return platform(mesh) == "cpu" or moe != "expert"


def choose_moe(name: str, mesh: Mesh, choice: str = "auto", faithful: bool = False) -> str:
    """Backend.moe for backend `name` on `mesh`: the Pallas kernel where it runs (one TPU device), XLA's grouped
    form on other single devices; per-expert conditionals on CPU and on generic meshes of several devices (the
    kernel runs on one device's experts). `choice` (--moe) other than auto asks for one on the generic backend.
    `faithful` (float32 on a TPU, Products.EXACT) keeps the conditionals under auto: on the v5e (JAX 0.10.2) the
    kernel's float32 golden parity failed on the longest prompt (64 tokens: prefill logits 0.146 off, one greedy
    id changed; it passes in interpret mode on CPU), where the conditionals held 1.7e-4."""
    if choice not in MOE_CHOICES:
        raise ValueError(f"--moe must be one of {', '.join(MOE_CHOICES)}, got {choice!r}")
    if dict(mesh.shape).get("expert", 1) > 1:  # expert_parallel.MOE: each expert group its own experts
        if choice != "auto":
            raise ValueError(f"--moe {choice}: a mesh with an expert axis runs each group's own experts (expert "
                             "parallel); leave --moe auto")
        return "expert"
    if name == "cpu":
        return "cond"
    if choice != "auto":
        if choice != "cond" and mesh.size > 1:
            raise ValueError(f"--moe {choice} runs on one device; a mesh of {mesh.size} devices takes --moe cond")
        if choice == "pallas" and platform(mesh) != "tpu":
            raise ValueError("--moe pallas runs on a TPU (its kernel compiles for one); use --moe ragged here")
        return choice
    if mesh.size > 1:
        return "cond"
    if platform(mesh) == "tpu":
        return "cond" if faithful else "pallas"
    return "ragged"
