"""The tree type-checks and lints clean: mypy as pyproject.toml's [tool.mypy] sets it up (strict on
memd.policy and the client, default elsewhere) and ruff as its [tool.ruff] does, each run the way
a developer runs it by hand, from the repository root.

Locally a tool that is not installed skips with the command that installs it; under CI (CI set to
1 or true, as .ci/run does) it fails, so that a CI run never passes by skipping them silently.
mypy starts from an empty cache in a temporary directory (about 4 s; no cache left in the tree,
none carried from an earlier run over other stubs); ruff keeps no cache (a tenth of a second).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from typing import List, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_HINT = "pip install './client' '.[test]' (the test extra pins mypy, ruff and types-psutil)"


def require_module(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        message = "%s is not installed: %s" % (name, INSTALL_HINT)
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message + "; CI must install it (the README's test command does)")
        pytest.skip(message)


def run_module(args: List[str], timeout: float) -> Tuple[int, str]:
    out = subprocess.run([sys.executable, "-m"] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def test_mypy_finds_no_type_errors(tmp_path):
    require_module("mypy")
    code, output = run_module(["mypy", "--cache-dir", str(tmp_path / "mypy-cache")], timeout=300)
    assert code == 0, "mypy (pyproject.toml's [tool.mypy]) found errors:\n" + output


def test_ruff_finds_nothing():
    require_module("ruff")
    code, output = run_module(["ruff", "check", "--no-cache"], timeout=120)
    assert code == 0, "ruff (pyproject.toml's [tool.ruff]) found problems:\n" + output
