"""End to end through the CLI on Tiny Shakespeare: the loss falls and the run folder is complete."""
from __future__ import annotations

import json

from conftest import lm_args, metrics, phalanx


def test_shakespeare_loss_falls_and_run_folder_is_complete(tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = phalanx(*lm_args(run, cache_dir, "train.max_steps=40", "train.eval_every=20", "model.n_embd=128"),
                   "--nproc-per-node", 2, check=True, timeout=240)
    assert "world size 2" in proc.stdout and "accum 2" in proc.stdout
    evals = [m["eval/loss"] for m in metrics(run) if "eval/loss" in m]
    train = [m["loss"] for m in metrics(run) if "loss" in m and "event" not in m]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 0.5
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "final/model.safetensors",
                 "final/tokenizer.json", "final/config.json"):
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["eval/loss"] == evals[-1]
