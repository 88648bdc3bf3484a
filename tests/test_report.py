"""`phalanx report`: plots and Markdown from finished, torn and several runs, without torch."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, lm_args, phalanx

PLOTS = ("loss", "throughput", "memory", "step_time_split", "rank_step_time")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir):
    run = tmp_path_factory.mktemp("finished")
    phalanx(*lm_args(run, cache_dir, "train.max_steps=8", "train.log_every=2", "train.eval_every=4",
                     "log.straggler_margin=0.8"),  # tiny steps on a shared 2-core box are noisy (as test_monitor)
            "--nproc-per-node", 2, check=True, timeout=180)
    return run


@pytest.fixture
def torn(finished, tmp_path):
    """A copy of the run as a killed job leaves it: no summary, a half-written last line."""
    run = tmp_path / "torn"
    run.mkdir()
    shutil.copy(finished / "config.yaml", run / "config.yaml")
    text = (finished / "metrics.jsonl").read_text()
    lines = text.splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][: len(lines[4]) // 2])
    return run


def assert_pngs(folder, names=PLOTS):
    for name in names:
        data = (folder / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_report_on_finished_run(finished):
    proc = phalanx("report", finished, check=True)
    assert str(finished / "report.md") in proc.stdout
    assert_pngs(finished / "report")
    md = (finished / "report.md").read_text()
    for text in ("| status | finished |", "| world size | 2 |", "| global batch | 16 = micro 4 x world 2 x accum 2 |",
                 "| steps | 8 of 8 |", "| tokens seen | 4,096 |", "| stragglers | none |", "final eval/loss",
                 "config digest", "wall time", "training tokens/s", "MB host", "![loss](report/loss.png)"):
        assert text in md, text


def test_the_status_comes_from_the_launchers_outcome(finished, tmp_path):
    outcome = json.loads((finished / "outcome.json").read_text())
    assert (outcome["status"], outcome["exit_code"], outcome["step"], outcome["line"]) == ("ok", 0, 8,
                                                                                          "finished at step 8")
    run = tmp_path / "failed"
    shutil.copytree(finished, run, ignore=shutil.ignore_patterns("report*"))
    (run / "summary.json").unlink()
    (run / "outcome.json").write_text(json.dumps({
        "status": "failed", "exit_code": 1, "line": "training failed: rank 1 (pid 5) killed by SIGKILL", "step": 6,
        "time": 0, "rank": 1, "pid": 5, "consequences": "rank 0 lost a peer (RuntimeError)"}))
    phalanx("report", run, check=True)
    assert "| status | failed: rank 1 (pid 5) killed by SIGKILL |" in (run / "report.md").read_text()
    (run / "outcome.json").unlink()  # an older run, or one whose launcher was killed: the markers decide
    phalanx("report", run, check=True)
    md = (run / "report.md").read_text()
    assert "running (no summary yet)" in md or "stopped without a summary" in md


def test_report_on_truncated_metrics(torn):
    phalanx("report", torn, check=True)
    assert_pngs(torn / "report")
    md = (torn / "report.md").read_text()
    assert "running (no summary yet)" in md or "stopped without a summary" in md
    assert "| unreadable metric lines skipped | 1 |" in md
    kept = [json.loads(line) for line in (torn / "metrics.jsonl").read_text().splitlines()[:4]]
    tokens = [m["tokens_seen"] for m in kept if "tokens_seen" in m][-1]
    assert "| world size | 2 |" in md and f"| tokens seen | {tokens:,} |" in md


def test_report_overlays_several_runs(finished, torn, tmp_path):
    out = tmp_path / "cmp"
    phalanx("report", finished, torn, "--out", out, check=True)
    assert_pngs(out, ("loss", "throughput", "memory"))
    md = (out / "report.md").read_text()
    assert f"| {finished.name} | finished |" in md and "| torn |" in md


def test_report_needs_no_torch(finished):
    code = ("import sys, argparse; import phalanx.tools.report as r; p = argparse.ArgumentParser(); "
            "r.add_arguments(p); assert r.run(p.parse_args([sys.argv[1]])) == 0; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code, str(finished)], cwd=REPO, check=True, capture_output=True)
