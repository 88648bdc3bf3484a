"""Real multi-process runs (Gloo on CPU, through the same launcher users use)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_same_losses, final_params, lm_args, metrics, phalanx, runs_at, train_losses


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory, cache_dir):
    """The same config (dropout on, to show per-micro-batch seeding) at 1 and at 2 processes."""
    return runs_at(tmp_path_factory, "equiv", lambda run: lm_args(run, cache_dir, "train.max_steps=12",
                                                                   "model.dropout=0.1"))


def test_one_and_two_processes_give_the_same_trajectory(one_and_two):
    l1 = assert_same_losses(one_and_two[2], one_and_two[1], 12)
    assert l1[12] < l1[1]  # and it learns
    p1, p2 = final_params(one_and_two[1]), final_params(one_and_two[2])
    assert p1.keys() == p2.keys()
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], rtol=1e-5, atol=1e-5, msg=name)


def test_batch_plan_is_printed_and_recorded(one_and_two):
    summary = json.loads((one_and_two[2] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["grad_accum"] == 2 and summary["global_batch_size"] == 16
    assert summary["tokens_seen"] == 12 * 16 * 32
    lines = metrics(one_and_two[2])
    train = [m for m in lines if "loss" in m and "event" not in m]
    assert all({"step", "loss", "lr", "tokens_per_s", "step_time_s"} <= m.keys() for m in train)
    assert all(m["tokens_per_s"] > 0 and m["step_time_s"] > 0 for m in train)
    evals = [m for m in lines if any(k.startswith("eval/") for k in m)]
    assert evals and evals[-1]["step"] == 12 and evals[-1]["eval/samples"] == 64


def test_eval_is_exact_across_world_sizes(one_and_two):
    e1 = [m for m in metrics(one_and_two[1]) if "eval/loss" in m][-1]
    e2 = [m for m in metrics(one_and_two[2]) if "eval/loss" in m][-1]
    assert e1["eval/tokens"] == e2["eval/tokens"] == 64 * 32
    assert e2["eval/loss"] == pytest.approx(e1["eval/loss"], rel=1e-5)


def test_export_loads_with_transformers_and_generates(one_and_two):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = one_and_two[2] / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    ids = tok("ROMEO:", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] == ids.shape[1] + 8
    proc = phalanx("generate", one_and_two[2], "--prompt", "ROMEO:", "--max-new-tokens", "10", check=True)
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) > len("ROMEO:")


@pytest.mark.slow  # ~35 s: loading model.pretrained folders is also what every chat, classify and preference test does
def test_continue_from_a_local_pretrained_folder(one_and_two, tmp_path, cache_dir):
    """model.pretrained = a local Hugging Face folder: its weights and tokenizer are used."""
    run = tmp_path / "ft"
    phalanx(*lm_args(run, cache_dir, "train.max_steps=2", f"model.pretrained={one_and_two[1] / 'final'}"),
            check=True, timeout=120)
    scratch_first = train_losses(one_and_two[1])[1]
    trained_last = train_losses(one_and_two[1])[12]
    first = train_losses(run)[1]
    assert first < scratch_first and abs(first - trained_last) < 0.5 * (scratch_first - trained_last)
