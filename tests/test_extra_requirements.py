"""`make setup` installs the test tools from scripts/extra_requirements.py's list, after the serving install, so
the project (and its native kernels) is built once: the list must be the test extra with the project's own
extras it names expanded, and nothing of the project itself."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.procs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from extra_requirements import requirements  # noqa: E402


def test_the_test_extra_is_listed_with_the_extras_it_names_expanded() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    listed = requirements("test")
    own = [r for r in extras["test"] if r.startswith("grok-serve[")]
    assert own, "the test extra names the project's own extras"
    assert not [r for r in listed if r.startswith("grok-serve")]
    expected = set(extras["demo"]) | set(extras["client"]) | {r for r in extras["test"] if r not in own}
    assert set(listed) == expected and len(listed) == len(expected)


def test_an_unknown_extra_is_refused_naming_the_known_ones() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "extra_requirements.py"), "nope"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "no extra named 'nope'" in run.stderr and "'test'" in run.stderr


def test_make_setup_installs_the_test_tools_without_building_the_project_again() -> None:
    makefile = (ROOT / "Makefile").read_text()
    rule = makefile[makefile.index("$(VENV)/.installed:"):].split("\n\n")[0]
    assert "scripts/extra_requirements.py test" in rule and "-e " not in rule
