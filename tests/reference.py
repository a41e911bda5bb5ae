"""The reference fixtures the parity tests read, kept outside the repository in ../shared (README.md, "Tests"):
golden/ and golden_wide/ (outputs recorded by running xai-org/grok-1's own code on small random checkpoints;
each folder's README.md says how) and grok1-tokenizer/ (Grok-1's released SentencePiece model).

Without them such a test would fail deep inside a service ("config '../shared/golden/config.json' is neither a
preset ... nor a JSON file"); tests/conftest.py fails it first with `missing_reference`'s message instead.
"""

from __future__ import annotations

import pathlib
import sys
from types import ModuleType

import pytest

SHARED = pathlib.Path(__file__).resolve().parent.parent.parent / "shared"
FIXTURES = ("golden", "golden_wide", "grok1-tokenizer")


def _reads_shared(module: ModuleType | None, shared: pathlib.Path) -> bool:
    """Whether the module holds a path into `shared` (GOLDEN, WIDE, GROK1_TOKENIZER ... from tests/procs.py)."""
    return module is not None and any(isinstance(value, pathlib.PurePath) and value.is_relative_to(shared)
                                      for value in vars(module).values())


def _modules(item: pytest.Item) -> list[ModuleType | None]:
    """The test's module and those of every fixture it uses."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = [d for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
    return [getattr(item, "module", None), *(sys.modules.get(d.func.__module__) for d in definitions)]


def missing_reference(item: pytest.Item, shared: pathlib.Path = SHARED) -> str | None:
    """Why `item` cannot run (None: it can): it reads a reference fixture that is not there."""
    # Only a fixture the test's modules point into counts: the TPU host gets golden/ without golden_wide/ (its
    # transfer limit), and the tests that read golden/ alone still run there.
    missing = [name for name in FIXTURES if not (shared / name).exists()
               and any(_reads_shared(module, shared / name) for module in _modules(item))]
    if not missing:
        return None
    return (f"this test reads the reference fixtures in {shared} ({', '.join(f'{n}/' for n in FIXTURES)}), "
            f"which are not in this repository; missing: {', '.join(missing)}. Put them there, a folder beside "
            f"the clone (README.md, 'Tests')")
