"""Print the requirements of one of pyproject.toml's extras, the project's own extras it names expanded.

`make setup` installs the test tools with these after the serving install: `pip install -e '.[test]'` would
build the project, and with it the native kernels, a second time.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def requirements(extra: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, name = project["optional-dependencies"], project["name"]
    out: list[str] = []

    def add(which: str) -> None:
        if which not in extras:
            raise SystemExit(f"pyproject.toml has no extra named {which!r}: {sorted(extras)}")
        for requirement in extras[which]:
            own = re.fullmatch(rf"{re.escape(name)}\[([^\]]+)\]", requirement.replace(" ", ""))
            if own:
                for nested in own.group(1).split(","):
                    add(nested)
            elif requirement not in out:
                out.append(requirement)

    add(extra)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1] if len(sys.argv) > 1 else "test")))
