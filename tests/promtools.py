"""Finding Prometheus' binaries for the tests that need them (Debian's `prometheus` package).

Locally a missing binary skips the test with the command that installs it; under CI (CI set to
1 or true, as .ci/run does) it fails, so that a CI run never passes by skipping them silently.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_HINT = "apt-get install -y prometheus (Debian's package provides prometheus and promtool)"


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        message = "%s not found: %s" % (binary, INSTALL_HINT)
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message + "; CI must install it (.ci/run does)")
        pytest.skip(message)
    return path


def families(exposition: str) -> Dict[str, str]:
    """Metric family name -> type, from the `# TYPE` lines of a text exposition."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M))


def documented_families() -> Dict[str, str]:
    """Metric name -> type from the tables of docs/metrics.md (rows whose first cell is a memd_,
    process_ or python_ name)."""
    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        return dict(re.findall(r"^\| `((?:memd|process|python)_[a-z0-9_]+)` \| (gauge|counter|histogram) \|",
                               f.read(), re.M))
