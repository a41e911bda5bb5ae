"""The backend seam's second half (model_service/ops/): each backend gets its operations from ops.for_backend, in
one place, and the model code calls them without asking which backend it runs on.

That the operations compute what the model computed before they moved here (the same programs, bit for bit) is
what the golden parity, invariance and engine tests check; these check the wiring and the seam itself."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest

from model_service import kernels
from model_service.backend import choose_backend
from model_service.config import MeshConfig, load_model_config
from model_service.model import GrokModel, Products
from model_service.ops.grouped import ParallelExperts, SortedExperts, Stacked
from model_service.ops.native import KernelNucleus, NativeAttention, NativeExperts, NativeForms, Packed
from model_service.ops.xla import (BatchedAttention, BatchedDraws, CondExperts, CpuForms, MatrixForms, RowAttention,
                                   SearchNucleus)
from model_service.ops.base import Stored
from model_service.sharding import make_mesh
from tests.procs import GOLDEN

ROOT = pathlib.Path(__file__).resolve().parents[2]
native_kernels = pytest.mark.skipif(not kernels.available(), reason="the native kernels are not built")
# choose_backend's automatic choices read the devices: on a TPU "auto" is the generic backend with the Pallas kernels
# (tests/model/test_pallas_attention.py checks those); these expect the CPU platform's.
cpu_platform = pytest.mark.skipif(jax.default_backend() != "cpu", reason="expects the CPU platform's automatic choices")


def model_on(mesh: str, dtype: str = "float32", explicit: Products | None = None, **choices: str) -> GrokModel:
    """GrokModel of the golden config on `mesh` with the backend `choices` (choose_backend's: backend, products, moe)
    and `explicit` products in place of the backend's (GrokModel's argument)."""
    cfg = load_model_config(str(GOLDEN / "config.json"))
    m = make_mesh(MeshConfig.parse(mesh))
    backend = choose_backend(choices.pop("backend", "auto"), m, jnp.dtype(dtype), **choices)
    return GrokModel(cfg, m, jnp.dtype(dtype), explicit, backend=backend)


def parts(model: GrokModel) -> tuple[type, ...]:
    ops = model.ops
    return type(ops.forms), type(ops.attention), type(ops.experts), type(ops.layout), type(ops.sampling)


@native_kernels
def test_the_cpu_backend_on_one_device_runs_the_native_kernels_each_row_alone() -> None:
    model = model_on("1,1")
    assert parts(model) == (NativeForms, NativeAttention, NativeExperts, Packed, KernelNucleus)
    assert model.ops.row_sums and model.ops.head_row_sums and model.kv_layout == "heads"
    assert model.load_options()["pack"] and not model.load_options()["int8_table"]
    int8 = model_on("1,1", products="native-int8")
    assert int8.ops.layout == Packed(int8_table=True) and int8.load_options()["int8_table"]


@cpu_platform
def test_the_cpu_backend_with_xla_products_and_in_bfloat16_takes_xla_forms() -> None:
    xla = model_on("1,1", products="xla")
    attention = NativeAttention if kernels.available() else RowAttention  # the kernel reads float32 rows alike
    assert parts(xla) == (CpuForms, attention, CondExperts, Stored, SearchNucleus) and not xla.ops.row_sums
    bf16 = model_on("1,1", "bfloat16")
    assert parts(bf16) == (CpuForms, RowAttention, CondExperts, Stored, SearchNucleus)
    assert not bf16.load_options()["pack"]


@native_kernels
def test_a_mesh_of_several_devices_keeps_xla_sums_and_sampling() -> None:
    model = model_on("1,8")
    assert parts(model) == (NativeForms, RowAttention, NativeExperts, Packed, SearchNucleus)
    assert not model.ops.row_sums and not model.ops.head_row_sums


@cpu_platform
def test_the_generic_backend_takes_matrix_unit_dots_batched_attention_and_stacked_experts() -> None:
    model = model_on("1,1", backend="generic")
    assert parts(model) == (MatrixForms, BatchedAttention, SortedExperts, Stacked, BatchedDraws)
    assert model.ops.sampling.vectorised and not SearchNucleus.vectorised and not KernelNucleus.vectorised
    assert model.ops.experts == SortedExperts("ragged") and model.kv_layout == "tokens"
    assert model.load_options() == {"pack": False, "int8_table": False, "stacked": True,
                                    "stack_layers": model.scan_layers, "moe": "ragged"}
    assert model.load_options()["stacked"] == model.backend.stacked_experts
    cond = model_on("1,1", "bfloat16", backend="generic", moe="cond")
    assert parts(cond) == (MatrixForms, BatchedAttention, CondExperts, Stored, BatchedDraws)
    expert = model_on("1,4,2", backend="generic")
    assert type(expert.ops.experts) is ParallelExperts


@native_kernels
def test_explicit_products_derive_again_what_follows_from_them() -> None:
    """GrokModel's explicit products override the backend's; the sampler's form and the row sums follow from the
    products (backend.with_choices, ops.for_backend), not from a second decision in the model."""
    one = model_on("1,1", products="xla", backend="cpu")
    assert not one.backend.native_sampling
    native = model_on("1,1", explicit=Products.NATIVE, products="xla", backend="cpu")
    assert native.backend.native_sampling and native.ops.sampling == KernelNucleus() and native.ops.row_sums
    meshed = model_on("1,8", explicit=Products.NATIVE, products="xla", backend="cpu")
    assert not meshed.backend.native_sampling and meshed.ops.sampling == SearchNucleus()
    rows = model_on("1,1", explicit=Products.FUSED_REDUCE, backend="cpu")
    assert type(rows.ops.forms) is CpuForms and rows.ops.layout == Stored() and not rows.ops.row_sums


def test_an_unknown_attention_mode_is_refused_with_the_modes() -> None:
    cfg = load_model_config(str(GOLDEN / "config.json"))
    with pytest.raises(ValueError, match="attention must be one of"):
        GrokModel(cfg, make_mesh(MeshConfig()), jnp.float32, attention="paged")


# The modules that call the operations: none of them may ask which backend, products or kernel runs.
CALLERS = ("model_service/model/__init__.py", "model_service/model/transformer.py", "model_service/model/segments.py",
           "model_service/sampling.py", "model_service/engine.py")
ASKING = {"native", "int8", "NATIVE", "NATIVE_INT8", "FUSED_REDUCE", "DOT", "EXACT", "native_sampling",
          "grouped_native", "stacked_experts", "kernels", "vectorised_sampling"}


def backend_questions(tree: ast.AST) -> list[str]:
    """Names and attributes in `tree` that ask what the backend is, and comparisons of an attention / moe / products
    value with anything."""
    found = []
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in ASKING:
            found.append(f"{name} (line {node.lineno})")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("model_service.kernels"):
            found.append(f"import {node.module} (line {node.lineno})")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [s.attr if isinstance(s, ast.Attribute) else getattr(s, "id", None) for s in sides]
            if {"attention", "moe", "products"} & set(named):
                found.append(f"comparison of {named} (line {node.lineno})")
    return found


def test_the_scan_finds_a_question() -> None:
    code = "if model.products.native and step.attention == 'batched':\n    from model_service.kernels import x\n"
    assert len(backend_questions(ast.parse(code))) == 3


@pytest.mark.parametrize("path", CALLERS)
def test_the_model_code_never_asks_which_backend_runs(path: str) -> None:
    assert backend_questions(ast.parse((ROOT / path).read_text())) == []


def test_the_moe_layer_never_asks_which_backend_runs() -> None:
    """moe.py also holds the per-expert forms the ops call; its layer calls them through Ops.moe alone, and its
    router through Ops.router_logits (a packed router is the forms' business, not the routing's)."""
    tree = ast.parse((ROOT / "model_service/model/moe.py").read_text())
    [layer] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MoELayer"]
    assert backend_questions(layer) == []
    [route] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "route"]
    body = ast.Module(route.body, [])  # the signature may name the weights' types; the body may not ask them
    assert backend_questions(route) == [] and "PackedWeight" not in ast.unparse(body)


def test_the_program_fingerprints_compare_every_field_and_configuration() -> None:
    """benchmarks/programs.py (the seam's refactoring guard: the same programs before and after) reports a changed
    fingerprint and a configuration one run lacks."""
    from benchmarks.programs import compare

    before = {"cpu_f32": {"rows": "a", "head": "b"}, "gen_f32": {"rows": "c"}}
    assert compare(before, before) == []
    assert compare(before, {"cpu_f32": {"rows": "a", "head": "x"}}) == ["cpu_f32.head: b -> x",
                                                                        "gen_f32.rows: c -> None"]


def test_the_operations_are_derived_from_the_backend_in_one_place() -> None:
    """Ops values are built by ops.for_backend (and for_shapes, for haiku's shape tracing) alone, and only GrokModel
    calls it: every other module reaches the operations through the model."""
    built, derived = [], []
    for path in sorted((ROOT / "model_service").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                where = str(path.relative_to(ROOT))
                if node.func.id == "Ops":
                    built.append(where)
                elif node.func.id == "for_backend":
                    derived.append(where)
    assert sorted(set(built)) == ["model_service/ops/__init__.py"]
    assert derived == ["model_service/model/__init__.py"]
