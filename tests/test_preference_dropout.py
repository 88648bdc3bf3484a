"""task: preference without dropout (preference.disable_dropout, TRL's DPOConfig.disable_dropout) and the
precomputed reference pass that the hang watchdog must not take for a hang.

Dropout: full fine-tuning (LoRA's B is zero at step 1, so LoRA dropout cannot change that step) from a base
that keeps GPT-2's default dropout of 0.1, sigmoid DPO against precomputed references: the first step's loss
is log 2 (the policy is the reference) with the key on, and not with it off. The rule zeroes peft's LoRA
dropout and a reference=model copy's too, and the float attention_dropout the Llama family reads at forward
time, which TRL's rule (every nn.Dropout's p) misses.

The pass: a real `phalanx train` with a start-up timeout shorter than its (slowed) reference pass finishes
(exit 0, not 3), with the pass's progress line, the start line's dropout clause and a first-step loss of log 2.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import phalanx, small_gpt2_base, train_losses
from test_preference_reference import attached, config, write_pairs

from phalanx.run.train import micro_seed
from phalanx.run.watchdog import Phase, Watchdog, summarize
from phalanx.tasks.preference import disable_dropout


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small pretrained GPT-2 that keeps GPT-2's default dropout (0.1: resid, embd, attn)."""
    folder = small_gpt2_base(tmp_path_factory.mktemp("base"), 100_000, 400, positions=64, width=32)
    assert {json.loads((folder / "config.json").read_text())[k] for k in ("resid_pdrop", "embd_pdrop",
                                                                          "attn_pdrop")} == {0.1}
    return folder


def first_step_loss(task) -> float:
    """The loss of a global batch of 8 pairs as two micro-batches, as the loop's first step computes it (the
    trainer's forward in training mode, the micro-batches' dropout seeds)."""
    tr = task.trainee
    assert tr.model.training
    batches = [task.collate(task.train_set, list(range(i, i + 4))) for i in (0, 4)]
    totals = [sum(c) for c in zip(*(task.step_counts(b) for b in batches))]
    loss = 0.0
    for mid, batch in enumerate(batches):
        torch.manual_seed(micro_seed(task.cfg.train.seed, 0, mid))
        with torch.no_grad(), tr.autocast():
            loss += float(task.step_loss(tr.forward, batch, totals)[0])
    return loss


@pytest.mark.parametrize("disable", [True, False])
def test_the_first_sigmoid_step_is_log_2_only_without_dropout(pg, base, tmp_path, disable):
    data = write_pairs(tmp_path / "pairs.jsonl", 24)
    task = attached(config(base, data, tmp_path / "c", "preference.reference=precomputed", "preference.loss=sigmoid",
                           f"preference.disable_dropout={str(disable).lower()}"), pg)
    dropouts = [m.p for m in task.trainee.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and set(dropouts) == ({0.0} if disable else {0.1})
    loss = first_step_loss(task)
    if disable:
        assert abs(loss - math.log(2)) < 1e-6
    else:  # the negative control: with GPT-2's dropout on, the policy is not its (eval-mode) reference
        assert abs(loss - math.log(2)) > 1e-3


def test_lora_dropout_and_the_reference_copy_are_zeroed_too(pg, base, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", 24)
    task = attached(config(base, data, tmp_path / "c", "model.lora.r=4", "model.lora.dropout=0.05",
                           "preference.reference=model"), pg)
    policy, reference = task.trainee.model, task.reference.model
    lora = [m for name, m in policy.named_modules() if "lora_dropout" in name and isinstance(m, torch.nn.Dropout)]
    assert lora, "peft's LoRA dropout modules were expected (model.lora.dropout > 0)"
    for model in (policy, reference):
        assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_rule_also_zeroes_the_attention_dropout_that_llama_reads_as_a_float(arch):
    """Llama's attention hands `self.attention_dropout` (a float, from the config) to the kernel in training
    mode: TRL's rule leaves it, so training-mode outputs still differ from eval mode; phalanx's rule gives
    the eval-mode outputs. GPT-2's attention reads its nn.Dropout's p: both rules suffice."""
    import transformers as T

    config = (T.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.3)
              if arch == "llama" else T.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2))
    ids = (torch.arange(24).reshape(2, 12) * 7) % 96

    def train_minus_eval(model) -> float:
        with torch.no_grad():
            want = model.eval()(input_ids=ids).logits
            torch.manual_seed(1)
            return float((model.train()(input_ids=ids).logits - want).abs().max())

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config)
    for module in model.modules():  # trl.trainer.utils.disable_dropout_in_model (TRL 1.16), verbatim
        if isinstance(module, torch.nn.Dropout):
            module.p = 0
    assert (train_minus_eval(model) > 1e-3) == (arch == "llama")
    disable_dropout(model)
    assert train_minus_eval(model) == 0.0


def test_a_reference_pass_longer_than_the_startup_timeout_is_not_a_hang(base, tmp_path):
    """24 pairs in 3 micro-batches of 8, each slowed by 8 s (debug.fault slow_reference): 24 s of pass
    against a 20 s start-up timeout (which each stage of the worker's start-up must stay under, on a busy
    machine too: a CI run's took over 10 s).
    Beating the watchdog per micro-batch, the run finishes; a micro-batch longer than the timeout is still a
    hang (stage reference: tried by hand, not here)."""
    data = write_pairs(tmp_path / "pairs.jsonl", 24)
    run = tmp_path / "run"
    proc = phalanx("train", "task=preference", f"model.pretrained={base}", f"data.train={data}",
                   f"data.cache_dir={tmp_path / 'c'}", "model.block_size=64", "train.micro_batch_size=8",
                   "train.global_batch_size=8", "data.val_fraction=0.1", "train.max_steps=1", "train.log_every=1",
                   "train.eval_max_samples=4", "log.progress=lines", "dist.threads_per_worker=1",
                   "dist.startup_timeout_s=20", "debug.fault=slow_reference:seconds=8",
                   "preference.reference=precomputed", "--run-dir", run, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (run / "hang").exists()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("reference pass")]
    assert lines and "24/24 pairs" in lines[-1] and "pairs/s" in lines[-1] and "tok/s" in lines[-1]
    assert "dropout off (preference.disable_dropout)" in proc.stdout
    assert abs(train_losses(run)[1] - math.log(2)) < 1e-6  # the real loop's first step, GPT-2's dropout zeroed


@pytest.mark.parametrize("behind,ahead", [
    ((-1, Phase.START, 0), (-1, Phase.REFERENCE, 0)),      # still starting up: behind a rank in the pass
    ((-1, Phase.REFERENCE, 2), (-1, Phase.REFERENCE, 3)),  # the pass's micro-batches in order
    ((-1, Phase.REFERENCE, 9), (0, Phase.START, 0)),       # the pass is before step 0
])
def test_the_hang_summary_orders_the_reference_pass_after_start_up_and_before_step_0(tmp_path, behind, ahead):
    for order in ((behind, ahead), (ahead, behind)):
        folder = tmp_path / str(order)
        for rank, (step, phase, micro) in enumerate(order):
            dog = Watchdog(folder, rank, 2, 5.0)
            dog.beat(step, phase, micro)
            dog._dump(6.0)
        assert f"rank(s) {order.index(behind)} did not reach the collective at step {behind[0]} (last stage: " \
               f"{behind[1]})" in summarize(folder)
