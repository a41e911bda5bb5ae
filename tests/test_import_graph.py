"""No import circle between the project's modules, counting every import statement (lazy ones inside
functions and TYPE_CHECKING ones included): a circle hidden behind a lazy import still means two modules
that cannot be understood, or loaded, one without the other.

And the layering between packages: the services never reach the offline tools (demo_build/, the only
user of optax), and the gateway detokenizes through serving_common without loading the tokenizer
service or SentencePiece."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ("model_service", "gateway", "tokenizer_service", "serving_common")
PACKAGES = (*SERVICES, "demo_build")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def import_targets(path: pathlib.Path, name: str) -> set[str]:
    """Every module name `path` imports anywhere in its body (relative imports resolved; for `from a import b`
    both `a` and `a.b`, since b may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets.update([base] + [f"{base}.{alias.name}" for alias in node.names])
    return targets


def imports_of(path: pathlib.Path, name: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules `path` imports anywhere in its body."""
    found: set[str] = set()
    for target in import_targets(path, name):
        while target and target not in modules:  # `import a.b.c` where only a.b is a module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_lazy_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_module_imports_itself_back_through_others() -> None:
    modules = project_modules()
    graph = {name: imports_of(path, name, modules) for name, path in modules.items()}
    assert graph["model_service.server"] >= {"model_service.loading"}  # the scan sees real edges
    assert cycles(graph) == []


@pytest.mark.parametrize("module", ["model_service.loading", "model_service.distributed.group", "model_service.server"])
def test_each_serving_module_imports_alone(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def top_level_imports(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Per module of `packages`: the top-level names it imports anywhere (third-party ones included)."""
    return {name: {target.partition(".")[0] for target in import_targets(path, name) if target}
            for name, path in project_modules().items() if name.partition(".")[0] in packages}


def test_no_service_module_imports_the_demo_tools_or_optax() -> None:
    imports = top_level_imports(SERVICES)
    assert "sentencepiece" in imports["tokenizer_service.tokenizer"]  # the scan sees third-party imports
    assert "optax" in top_level_imports(("demo_build",))["demo_build.loop"]
    offenders = {name: sorted(found & {"demo_build", "optax"}) for name, found in imports.items()
                 if found & {"demo_build", "optax"}}
    assert offenders == {}


def modules_loaded_by(package: str) -> set[str]:
    """Top-level names in sys.modules after a fresh interpreter imports every module of `package`."""
    probe = (f"import importlib, json, pkgutil, sys, {package}\n"
             f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
             "    importlib.import_module(m.name)\n"
             "print(json.dumps(sorted({name.partition('.')[0] for name in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_probe_sees_sentencepiece_in_the_tokenizer_service() -> None:
    assert {"tokenizer_service", "sentencepiece"} <= modules_loaded_by("tokenizer_service")


def test_the_gateway_loads_neither_the_tokenizer_service_nor_sentencepiece() -> None:
    loaded = modules_loaded_by("gateway")
    assert "serving_common" in loaded  # its detokenizer comes from there
    assert loaded & {"tokenizer_service", "sentencepiece", "model_service", "demo_build", "optax"} == set()
