"""`phalanx bench` (scaling study through the real launcher) and `phalanx doctor` (pre-flight)."""
from __future__ import annotations

import json

import pytest

from conftest import SHAKESPEARE, TINY_LM, phalanx

from phalanx.core.host import cores


@pytest.mark.slow  # ~17 s
def test_bench_writes_table_and_plot(tmp_path, cache_dir):
    out = tmp_path / "bench"
    proc = phalanx("bench", f"data.train={SHAKESPEARE}", f"data.cache_dir={cache_dir}", *TINY_LM,
                   "--nproc", "1,2", "--steps", "4", "--warmup", "1", "--out", out, check=True, timeout=240)
    table = (out / "bench.md").read_text()
    assert "| processes | threads/process |" in proc.stdout and "scaling.png" in proc.stdout
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2 and rows[0].startswith("| 1 |") and rows[1].startswith("| 2 |")
    assert "1.00x | 100%" in rows[0] and "threads/process" in table
    results = json.loads((out / "bench.json").read_text())["results"]
    assert [r["processes"] for r in results] == [1, 2]
    assert all(r["tokens_per_s"] > 0 and r["steps"] == 3 for r in results)
    assert all(r["threads"] * r["processes"] <= max(cores(), r["processes"]) for r in results)  # no oversubscription
    assert len(results[1]["host_peak_mb"]) == 2 and results[1]["comm_wait_share"] > 0
    png = (out / "scaling.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 5000


def test_doctor_passes_here(tmp_path):
    proc = phalanx("doctor", "--nproc-per-node", 2, "--run-dir", tmp_path / "runs", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("ok") and "all-reduce" in line and "sum correct" in line for line in lines)
    assert any(line.startswith("ok") and "backend gloo" in line for line in lines)
    assert any(line.startswith("ok") and "run folder" in line and "writable" in line for line in lines)
    assert lines[-1].startswith("verdict: ok")
    assert not (tmp_path / "runs").exists()  # the check leaves nothing behind


def test_doctor_fails_on_unwritable_run_folder(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    proc = phalanx("doctor", "--run-dir", blocker / "run")
    assert proc.returncode == 1
    assert any(line.startswith("problem") and "run folder" in line and "cannot write" in line
               for line in proc.stdout.splitlines()), proc.stdout


def test_doctor_fails_when_the_model_does_not_fit(tmp_path):
    proc = phalanx("doctor", "--run-dir", tmp_path, f"data.train={SHAKESPEARE}", "model.n_layer=48",
                   "model.n_embd=8192", "model.n_head=64")
    assert proc.returncode == 1
    line = next(line for line in proc.stdout.splitlines() if "memory plan" in line)
    assert line.startswith("problem") and "does not fit" in line and "M parameters" in line
