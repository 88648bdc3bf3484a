"""`ruff check` over the code, with the rule set pinned in pyproject.toml, so `make test` fails on a finding."""
from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO


def ruff(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_ruff_is_the_pinned_version():
    pin = re.search(r'"ruff==([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert ruff("--version").stdout.split() == ["ruff", pin], "install the test extra: pip install -e '.[test]'"


def test_ruff_check_passes():
    proc = ruff("check", "--no-cache", "phalanx", "tests", "bench", "scripts")
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"


def test_ruff_check_uses_the_projects_rule_set(tmp_path):
    """Negative control: the same configuration reports an unused import, a too-long line and a
    loop variable captured late, so a passing check means the rules ran."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nx = '" + "a" * 130 + "'\nfs = []\nfor i in range(3):\n"
                   "    fs.append(lambda: i)\n")
    proc = ruff("check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert proc.returncode == 1
    assert {"F401", "E501", "B023"} <= set(re.findall(r"\b([A-Z]+\d+)\b", proc.stdout)), proc.stdout
