"""Generate the Python gRPC stubs for protos/ into the importable `grok` package.

`python scripts/gen_protos.py` writes grok/<svc>/v1/*_pb2*.py(i) next to the repo root;
`--check` regenerates into a temporary folder and exits 1 if the committed stubs differ.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTOS.glob("grok/*/v1/*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    """Run protoc for every .proto under protos/ into out_dir (package folders get __init__.py)."""
    grpc_include = pathlib.Path(protoc.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTOS)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{grpc_include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for pkg in {out_dir / "grok"} | {p.parent for p in (out_dir / "grok").rglob("*.py")}:
        while pkg != out_dir:
            (pkg / "__init__.py").touch()
            pkg = pkg.parent


def generated_files(base: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p.relative_to(base) for p in (base / "grok").rglob("*_pb2*.py*"))


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = pathlib.Path(tmp)
        generate(fresh)
        want, have = generated_files(fresh), generated_files(ROOT)
        stale = [str(p) for p in want if p not in have or not filecmp.cmp(fresh / p, ROOT / p, shallow=False)]
        extra = [str(p) for p in have if p not in want]
        if stale or extra:
            print("generated stubs are stale; run `make protos`:", *stale, *extra, sep="\n  ")
            return 1
    print("generated stubs are up to date")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only verify the committed stubs")
    args = parser.parse_args()
    if args.check:
        return check()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = pathlib.Path(tmp)
        generate(fresh)
        for rel in generated_files(fresh):
            (ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh / rel, ROOT / rel)
        for init in (fresh / "grok").rglob("__init__.py"):
            (ROOT / init.relative_to(fresh)).touch()
    print("generated", len(generated_files(ROOT)), "files under grok/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
