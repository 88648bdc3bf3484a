"""The memory plan (tools/memplan.py): its arithmetic, its suggestion, the launcher's exit 2 before any
worker starts, and its figure against a measured run."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import SHAKESPEARE, metrics, phalanx
from test_prepare import tokenizer_dir

from phalanx.core.config import load_config
from phalanx.tools import memplan

GB = memplan.GB


def cfg_of(*overrides):
    return load_config(None, list(overrides))


def test_fsdp_shards_what_the_optimizer_holds_and_lora_trains_little():
    base = cfg_of("model.n_layer=8", "model.n_embd=512", "model.n_head=8")
    s = memplan.shapes(base)
    ddp = memplan.estimate(base, s, 4, "cpu", 100 * GB)
    fsdp = memplan.estimate(dataclasses.replace(base, train=dataclasses.replace(base.train, strategy="fsdp")), s, 4,
                            "cpu", 100 * GB)
    assert ddp.weights == 4 * s.parameters and ddp.optimizer == 8 * s.parameters
    assert fsdp.optimizer == pytest.approx(ddp.optimizer / 4) and fsdp.gradients == pytest.approx(ddp.gradients / 4)
    # the shard, a unit gathered twice (in the compute dtype) and, training it all, its gradients' buffers
    fsdp_cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, strategy="fsdp"))
    units = memplan._unit_transients(fsdp_cfg, s, "cpu")
    assert fsdp.weights == pytest.approx(s.parameters + units) and units >= (4 + 18) * s.largest_unit
    lora = cfg_of("task=chat", "model.n_layer=8", "model.n_embd=512", "model.n_head=8", "model.lora.r=8")
    ls = memplan.shapes(lora)
    assert ls.trainable < 0.05 * ls.parameters
    assert memplan.estimate(lora, ls, 1, "cpu", 100 * GB).optimizer < 0.05 * ddp.optimizer


def test_every_k_counts_the_blocks_the_trainer_checkpoints():
    """5 blocks, every 2nd: blocks 0, 2, 4 are checkpointed (model/checkpointing.py), so 2 keep activations."""
    cfg = cfg_of("model.n_layer=5", "train.activation_checkpointing=every_k", "train.activation_checkpointing_every=2")
    s = memplan.shapes(cfg)
    tokens = cfg.train.micro_batch_size * cfg.model.block_size
    a = memplan.ACTIVATION_BYTES["gpt2"]
    expected = (4 * 3 + a * (2 + 1)) * tokens * s.hidden
    assert memplan.estimate(cfg, s, 1, "cpu", 100 * GB).activations == pytest.approx(expected)


def test_a_pretrained_tokenizer_sizes_the_vocabulary(tmp_path):
    """Workers build the model with len(tokenizer) when data.tokenizer is set; data.vocab_size only trains one."""
    folder = tokenizer_dir(tmp_path, SHAKESPEARE.read_text()[:20000])
    s = memplan.shapes(cfg_of(f"data.tokenizer={folder}", "data.vocab_size=8192"))
    from transformers import AutoTokenizer
    assert s.vocab == len(AutoTokenizer.from_pretrained(folder)) != 8192


def test_a_plan_that_does_not_fit_names_the_smallest_change():
    cfg = cfg_of("model.block_size=512", "train.micro_batch_size=32", "train.global_batch_size=64")
    s = memplan.shapes(cfg)
    plan = memplan.estimate(cfg, s, 1, "cpu", 3 * GB)
    assert not plan.fits
    fix = memplan.suggest(cfg, s, 1, "cpu", 3 * GB)
    assert fix and fix.startswith("train.")
    key, value = fix.split()[0].split("=")
    section, name = key.split(".")
    typed = type(getattr(cfg.train, name))(value)
    fixed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{name: typed}))
    assert memplan.estimate(fixed, s, 1, "cpu", 3 * GB).fits
    assert memplan.suggest(cfg, s, 1, "cpu", 0.1 * GB) is None  # nothing small enough: no false promise


def test_launcher_refuses_before_any_worker(tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = phalanx("train", f"data.train={SHAKESPEARE}", f"data.cache_dir={cache_dir}", "--run-dir", run,
                   "model.n_layer=48", "model.n_embd=4096", "model.n_head=32")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "memory plan does not fit" in line and "GB per rank" in line and "GB per process" in line
    assert not (run / "logs").exists() and not (run / "config.yaml").exists()
    said = []
    cfg = cfg_of("model.n_layer=48", "model.n_embd=4096", "model.n_head=32", "train.memory_check=warn")
    plan = memplan.check(cfg, 1, 1, "cpu", say=said.append)
    assert not plan.fits and any("warning: the memory plan does not fit" in line for line in said)


@pytest.mark.slow  # ~12 s
def test_the_plan_is_within_15_percent_of_a_measured_run(tmp_path, cache_dir):
    run = tmp_path / "run"
    args = ["model.n_layer=8", "model.n_embd=512", "model.n_head=8", "model.block_size=128",
            "train.micro_batch_size=8", "train.global_batch_size=16", "train.max_steps=2", "train.log_every=1",
            "train.eval_every=0", "train.eval_max_samples=8", "log.progress=off"]
    proc = phalanx("train", f"data.train={SHAKESPEARE}", f"data.cache_dir={cache_dir}", "--run-dir", run, *args,
                   check=True, timeout=240)
    planned = float(next(line for line in proc.stdout.splitlines() if "memory plan:" in line)
                    .split("about ")[1].split(" GB")[0]) * GB
    measured = max(max(m["ranks/host_peak_mb"]) for m in metrics(run) if "ranks/host_peak_mb" in m) * 2 ** 20
    assert abs(planned / measured - 1) < 0.15, (planned / GB, measured / GB)


def test_lora_plans_the_base_in_its_stored_dtype_and_suggests_fsdp(tmp_path):
    """A bf16 base under LoRA: 2 bytes per frozen parameter (4 per adapter), sharded under fsdp; a LoRA run
    that does not fit under ddp is told to use fsdp (which shards the frozen base)."""
    import torch
    from transformers import GPT2Config

    # the plan reads the config alone (its dtype says how the weights were saved): no weights written
    GPT2Config(vocab_size=4096, n_positions=128, n_embd=2048, n_layer=12, n_head=16, bos_token_id=0, eos_token_id=0,
               dtype="bfloat16").save_pretrained(tmp_path / "base")
    lora = cfg_of("task=chat", f"model.pretrained={tmp_path / 'base'}", "model.lora.r=8", "train.precision=bf16",
                  "train.activation_checkpointing=full",
                  "model.block_size=128")
    s = memplan.shapes(lora)
    assert s.saved_dtype == torch.bfloat16 and 0 < s.trainable < 0.05 * s.parameters
    ddp = memplan.estimate(lora, s, 4, "cpu", 100 * GB)
    fsdp_cfg = dataclasses.replace(lora, train=dataclasses.replace(lora.train, strategy="fsdp"))
    fsdp = memplan.estimate(fsdp_cfg, s, 4, "cpu", 100 * GB)
    frozen = s.parameters - s.trainable
    assert ddp.weights == pytest.approx(2 * frozen + 4 * s.trainable)
    # bf16 gathers; LoRA's gradients are a sliver of a unit
    assert fsdp.weights == pytest.approx((2 * frozen + 4 * s.trainable) / 4 + 4 * s.largest_unit, rel=0.02)
    fp32 = dataclasses.replace(lora, model=dataclasses.replace(lora.model, base_dtype="fp32"))
    assert memplan.estimate(fp32, s, 4, "cpu", 100 * GB).weights == pytest.approx(4 * s.parameters)
    room = (ddp.peak + fsdp.peak) / 2  # fits sharded, not whole
    assert fsdp.peak < room < ddp.peak
    assert memplan.suggest(lora, s, 4, "cpu", room) == "train.strategy=fsdp"
