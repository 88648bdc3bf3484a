"""`ruff check` over the code, with the rule set pinned in pyproject.toml, so `make test` fails on a finding."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


# ---- the declared Python floor holds (no 3.10 interpreter is installable here: checked statically) ----------
def vermin(*paths: str) -> subprocess.CompletedProcess:
    floor = re.search(r'requires-python = ">=(\d+\.\d+)"', (REPO / "pyproject.toml").read_text()).group(1)
    command = [str(Path(sys.executable).parent / "vermin"), f"--target={floor}-", "--violations", "--no-tips",
               "--eval-annotations", *paths]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_code_runs_on_the_declared_python_floor():
    proc = vermin("phalanx", "tests", "bench", "scripts")
    assert proc.returncode == 0, f"code needs a newer Python than requires-python says:\n{proc.stdout}{proc.stderr}"


def test_the_floor_check_finds_a_newer_feature(tmp_path):
    """Negative control: enum.StrEnum (3.11+, once imported by run/watchdog.py) is reported under a 3.10 floor."""
    bad = tmp_path / "bad.py"
    bad.write_text("from enum import StrEnum\n\n\nclass Phase(StrEnum):\n    A = 'a'\n")
    proc = vermin(str(bad))
    assert proc.returncode != 0 and "StrEnum" in proc.stdout, proc.stdout
