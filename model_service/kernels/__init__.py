"""Native CPU kernels called from JAX through XLA's FFI: float32 rows times packed int8 (or float32, or bfloat16)
weights, and the sampler's nucleus threshold (`nucleus_threshold`) and list of kept entries (`values_above`).

The C++ lives in native/ and is built by `pip install` as the optional extension `_native`. Weights are
packed [N/16, K, 16] (16 output columns per contiguous stream); each output element is one chain of fused
multiply-adds over k in order, then its scales, so a row's result never depends on the other rows, the
thread count or the instruction set (batch invariance by construction). The AVX-512, AVX2 and scalar paths
are compiled separately and chosen at run time; GROK_KERNEL_ISA=scalar|avx2|avx512 forces one and
GROK_KERNEL_ISA=off disables the kernels (the model then uses XLA's products).

Each vector path has two forms with the same bits: "rows" (each weight is converted once per tile of 4 rows,
6 on AVX2) and "panel" (a cache-resident panel of the weight is converted once for every row). "auto" picks by
weight type and the number of marked rows (what measured fastest, see native/ffi.cc: the panel form for float32
weights from 8 rows, the rows form otherwise); GROK_KERNEL_FORM=rows|panel forces one (to measure another CPU).
A bfloat16 table is held in 13 bits a value (the same bits, fewer bytes); GROK_KERNEL_TABLE_BITS=16 keeps it in
bfloat16 (table_in_13_bits).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

ISA_ENV = "GROK_KERNEL_ISA"
FORM_ENV = "GROK_KERNEL_FORM"
TABLE_BITS_ENV = "GROK_KERNEL_TABLE_BITS"
ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}
LANES = 16  # columns per packed block
GROUP_13_BYTES, DICTIONARY_13 = 104, 32  # a bfloat16 weight in 13 bits a value: bytes per 4 x 16 values, high bytes
FORMS = {"auto": 0, "rows": 1, "panel": 2}
ACTIVATIONS = {"float32": 0, "int8": 1}  # int8: the rows rounded to int8 per 32 values first (an opt-in)
_PLAIN_TARGETS = {jnp.dtype(jnp.float32): "grok_f32_matmul", jnp.dtype(jnp.bfloat16): "grok_bf16_matmul"}


@functools.cache
def _load() -> tuple[str, ...]:
    """Import the extension and register its FFI targets once; () when unavailable (logged once)."""
    choice = os.environ.get(ISA_ENV, "auto")
    if choice == "off":
        log.info("native kernels disabled (%s=off): products use XLA", ISA_ENV)
        return ()
    try:
        from model_service.kernels import _native  # type: ignore[attr-defined]
    except ImportError as e:
        log.warning("native kernels not available (%s): products use XLA; rebuild with `pip install -e .`", e)
        return ()
    for name, capsule in _native.handlers().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return tuple(_native.supported_isas())


def available() -> bool:
    """True when the extension loaded (and is not disabled by GROK_KERNEL_ISA=off)."""
    return bool(_load())


def supported_isas() -> tuple[str, ...]:
    """The instruction-set paths this CPU can run ('scalar', 'avx2', 'avx512'), slowest first."""
    return _load()


def int8_accelerated() -> bool:
    """Whether this CPU runs int8 rows on the AVX-512 VNNI path (the extension's own check); elsewhere the int8
    path multiplies int16 pairs, no faster than the float32 one. False without the extension."""
    if not _load():
        return False
    from model_service.kernels import _native  # type: ignore[attr-defined]

    return bool(_native.int8_accelerated())


def default_isa() -> str:
    """GROK_KERNEL_ISA when it names a path this CPU supports, else 'auto' (the fastest)."""
    choice = os.environ.get(ISA_ENV, "auto")
    if choice in ISAS and (choice == "auto" or choice in supported_isas()):
        return choice
    if choice != "off":
        log.warning("%s=%s is not a path this CPU supports %s: using the fastest", ISA_ENV, choice, supported_isas())
    return "auto"


def default_form() -> str:
    """GROK_KERNEL_FORM when it names a form (FORMS), else 'auto'."""
    choice = os.environ.get(FORM_ENV, "auto")
    if choice in FORMS:
        return choice
    log.warning("%s=%s is not one of %s: using auto", FORM_ENV, choice, tuple(FORMS))
    return "auto"


def table_in_13_bits() -> bool:
    """GROK_KERNEL_TABLE_BITS: 13 (default) holds a bfloat16 table in 13 bits a value (faster for one or two rows
    a step, slower from about four), 16 keeps it bfloat16; anything else is warned about and taken as 13."""
    choice = os.environ.get(TABLE_BITS_ENV, "13")
    if choice not in ("13", "16"):
        log.warning("%s=%s is not 13 or 16: using 13", TABLE_BITS_ENV, choice)
    return choice != "16"


def matmul(x: jax.Array, w: jax.Array, scales: jax.Array | None, n_out: int, isa: str | None = None,
           threads: int = 0, rows: jax.Array | None = None, form: str | None = None,
           activations: str = "float32", fill_unused: bool = True, multiplier: float = 1.0,
           dictionary: jax.Array | None = None) -> jax.Array:
    """x float32 [M, K] times a packed weight w [NB, K, 16] (int8 with scales [B, NB*16], or float32 or bfloat16
    without) -> float32 [M, n_out], n_out <= NB*16. One device; `threads` 0 uses XLA's intra-op pool.

    `rows` bool [M] (default: all) names the rows to compute; the others come out zero and cost nothing (with
    `fill_unused` False they are not even written: their values are undefined, for a caller that never reads
    them). A computed row's bits are the same whichever other rows are computed, whatever `form` (FORMS)
    computes it.

    `activations` "int8" (int8 weights only) rounds each row to int8 first, per 32 values of K inside each scale
    block with one step max|x| / 127 (llama.cpp's Q8_0 activations), and multiplies in integers (AVX-512 VNNI
    where the CPU has it): about 4x the multiply-adds per instruction, at the cost of that rounding. Still one
    fixed order per element: the bits are the same on every instruction set and for any other rows.

    `multiplier` (unscaled weights only) multiplies each computed element once after its sum: the bits of
    `matmul(...) * float32(multiplier)`, without a pass over the rows not computed.

    `dictionary` uint8 [32] with w uint8 [NB, K / 4, 104]: a bfloat16 weight held in 13 bits a value
    (model.packed.pack_bf16_in_13); the bits of the bfloat16 weight's product."""
    if not available():
        raise RuntimeError("native kernels are not available (see the log)")
    if multiplier != 1.0 and scales is not None:
        raise ValueError("matmul: a multiplier is for unscaled (float32 or bfloat16) weights")
    isa, form = isa or default_isa(), form or default_form()
    out = jax.ShapeDtypeStruct((x.shape[0], n_out), jnp.float32)
    attrs = {"isa": np.int64(ISAS[isa]), "threads": np.int64(threads), "form": np.int64(FORMS[form]),
             "fill": np.int64(1 if fill_unused else 0)}
    rows = jnp.ones((x.shape[0],), jnp.bool_) if rows is None else rows.astype(jnp.bool_)
    # Under vmap each batch element is its own call: a batched call would have to be one product anyway.
    if dictionary is not None:
        if scales is not None or w.dtype != jnp.uint8 or w.ndim != 3 or w.shape[2] != GROUP_13_BYTES:
            raise TypeError(f"a weight in 13 bits is uint8 [NB, K / 4, {GROUP_13_BYTES}] without scales, got {w.dtype} "
                            f"{w.shape}")
        if dictionary.shape != (DICTIONARY_13,):
            raise TypeError(f"a weight in 13 bits has a dictionary of {DICTIONARY_13} high bytes, got {dictionary.shape}")
        return jax.ffi.ffi_call("grok_bf16_in_13_matmul", out, vmap_method="sequential")(
            x, w, dictionary.astype(jnp.uint8), rows, multiplier=np.float32(multiplier), **attrs)
    if scales is None:
        target = _PLAIN_TARGETS.get(jnp.dtype(w.dtype))
        if target is None:
            raise TypeError(f"an unscaled packed weight is float32 or bfloat16, got {w.dtype}")
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w, rows, multiplier=np.float32(multiplier),
                                                                      **attrs)
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {tuple(ACTIVATIONS)}, got {activations!r}")
    return jax.ffi.ffi_call("grok_int8_matmul", out, vmap_method="sequential")(
        x, w, scales, rows, activations=np.int64(ACTIVATIONS[activations]), **attrs)


def grouped_matmul(x: jax.Array, which: jax.Array, weights: Sequence[jax.Array], scales: Sequence[jax.Array],
                   n_out: int, isa: str | None = None, threads: int = 0, rows: jax.Array | None = None,
                   form: str | None = None, activations: str = "float32") -> jax.Array:
    """Row r of x float32 [M, K] times int8 packed weight which[r] -> float32 [M, n_out], in one call: an MoE layer's
    (token, expert) pairs, whose experts' column blocks the threads share out together. Each of `weights` is one
    matrix [NB, K, 16] with scales [B, NB*16], or a stack of them [E, NB, K, 16] with scales [E, B, NB*16]; the
    matrices are numbered through the list in order, and all are of one shape. A row's bits are those of `matmul`
    with its weight (and the same `rows`, `form` and `activations`), whatever the other rows and weights."""
    if not available():
        raise RuntimeError("native kernels are not available (see the log)")
    if len(weights) != len(scales) or not weights:
        raise ValueError(f"grouped_matmul: want one scales per weight, got {len(weights)} and {len(scales)}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {tuple(ACTIVATIONS)}, got {activations!r}")
    isa, form = isa or default_isa(), form or default_form()
    out = jax.ShapeDtypeStruct((x.shape[0], n_out), jnp.float32)
    rows = jnp.ones((x.shape[0],), jnp.bool_) if rows is None else rows.astype(jnp.bool_)
    return jax.ffi.ffi_call("grok_grouped_int8_matmul", out, vmap_method="sequential")(
        x, which.astype(jnp.int32), rows, *weights, *scales, isa=np.int64(ISAS[isa]), threads=np.int64(threads),
        form=np.int64(FORMS[form]), activations=np.int64(ACTIVATIONS[activations]))


def nucleus_threshold(logits: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per row, the smallest logit v with sum(probs[logits <= v]) >= 1 - top_p: the nucleus filter's threshold.

    logits and probs float32 [..., V] (probs = the rows' softmax), top_p float32 broadcastable to [...] ->
    float32 [...]. One native call finds each row's threshold by a radix select over the order-preserving
    uint32 image of the logits with float64 sums (sampling.py's XLA search takes 32 masked sums instead); the
    two agree except where a float32 sum lands within rounding of 1 - top_p. A row's result depends only on
    that row. Under vmap the batch axis is one more leading row axis ("broadcast_all"): still one call.
    """
    if not available():
        raise RuntimeError("native kernels are not available (see the log)")
    if logits.ndim < 1 or probs.shape != logits.shape:
        raise ValueError(f"nucleus_threshold: want logits and probs of one shape [..., V], got {logits.shape} "
                         f"and {probs.shape}")
    rows = logits.shape[:-1]
    out = jax.ShapeDtypeStruct(rows, jnp.float32)
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), rows)
    return jax.ffi.ffi_call("grok_nucleus_threshold", out, vmap_method="broadcast_all")(
        logits.astype(jnp.float32), probs.astype(jnp.float32), top_p)


def values_above(values: jax.Array, floor: float, cap: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row of values float32 [..., V]: (indices int32 [..., cap], count int32 [...], top float32 [...]).

    `indices` lists, ascending, the positions of the values > floor (the first `cap` of them; entries past `count`
    are unspecified), `count` how many there are in all (more than `cap` means the list is cut), `top` the row's
    largest value (NaN if the row holds a NaN). One pass per row; a row's results depend only on that row.
    """
    if not available():
        raise RuntimeError("native kernels are not available (see the log)")
    if values.ndim < 1 or cap < 1:
        raise ValueError(f"values_above: want values [..., V] and cap >= 1, got {values.shape} and {cap}")
    rows = values.shape[:-1]
    out = (jax.ShapeDtypeStruct(rows + (cap,), jnp.int32), jax.ShapeDtypeStruct(rows, jnp.int32),
           jax.ShapeDtypeStruct(rows, jnp.float32))
    return jax.ffi.ffi_call("grok_values_above", out, vmap_method="broadcast_all")(
        values.astype(jnp.float32), floor=np.float32(floor))
