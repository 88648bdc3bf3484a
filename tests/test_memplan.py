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
    # the shard, the root unit gathered once and a block twice (in the compute dtype) and, training it all, the
    # largest unit's gradient buffers at the end of backward
    fsdp_cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, strategy="fsdp"))
    gathers, unit_gradients = memplan._unit_transients(fsdp_cfg, s, "cpu")
    assert s.root + s.layers * s.block == s.parameters and s.largest_unit == max(s.root, s.block)
    assert gathers == pytest.approx(4 * (s.root + 2 * s.block))
    assert unit_gradients == pytest.approx(memplan.UNIT_GRADIENT_BYTES * s.largest_unit)
    assert fsdp.weights == pytest.approx(s.parameters + gathers)
    lora = cfg_of("task=chat", "model.n_layer=8", "model.n_embd=512", "model.n_head=8", "model.lora.r=8")
    ls = memplan.shapes(lora)
    assert ls.trainable < 0.05 * ls.parameters
    assert memplan.estimate(lora, ls, 1, "cpu", 100 * GB).optimizer < 0.05 * ddp.optimizer


def test_every_k_counts_the_blocks_the_trainer_checkpoints():
    """5 blocks, every 2nd: blocks 0, 2, 4 are checkpointed (model/checkpointing.py), so 2 keep activations."""
    cfg = cfg_of("model.n_layer=5", "train.activation_checkpointing=every_k", "train.activation_checkpointing_every=2")
    s = memplan.shapes(cfg)
    tokens = cfg.train.micro_batch_size * cfg.model.block_size
    block, adapters = memplan.block_activation_bytes(s, cfg.model.block_size, cfg.model.lora)
    per_token = block * memplan.activation_factor(cfg, s, tokens, "cpu", False)
    assert adapters == 0
    expected = 4 * 3 * tokens * s.hidden + per_token * (2 + 1) * tokens
    assert memplan.estimate(cfg, s, 1, "cpu", 100 * GB).activations == pytest.approx(expected)


def _with(cfg, **train):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def test_fsdp_sync_counts_the_gradient_backward_starts_with():
    """With accumulation, train.fsdp_sync=step holds every unit's unsharded fp32 gradient (4 T) until the last
    micro-batch, micro_batch only this rank's accumulated shard (4 T / S); one micro-batch per step: the same."""
    base = _with(cfg_of("model.n_layer=4", "model.n_embd=512", "model.n_head=8", "model.block_size=64",
                        "data.vocab_size=4096"), strategy="fsdp", micro_batch_size=1)
    s = memplan.shapes(base)
    plans = {(sync, accum): memplan.estimate(_with(base, fsdp_sync=sync, global_batch_size=4 * accum), s, 4, "cpu",
                                              100 * GB) for sync in ("micro_batch", "step") for accum in (1, 2)}
    assert plans["step", 1].peak == plans["micro_batch", 1].peak
    assert plans["micro_batch", 2].peak >= plans["micro_batch", 1].peak
    # backward's start is the peak of both accumulating plans here (activations on top of the held gradient)
    assert plans["step", 2].peak - plans["micro_batch", 2].peak == pytest.approx(4 * s.trainable * (1 - 1 / 4))
    room = (plans["step", 2].peak + plans["micro_batch", 2].peak) / 2  # the same update, in less memory
    assert memplan.suggest(_with(base, fsdp_sync="step", global_batch_size=8), s, 4, "cpu", room) == \
        "train.fsdp_sync=micro_batch"
    ddp = memplan.estimate(_with(base, strategy="ddp", fsdp_sync="step", global_batch_size=8), s, 4, "cpu", 100 * GB)
    assert ddp.peak == memplan.estimate(_with(base, strategy="ddp", global_batch_size=8), s, 4, "cpu", 100 * GB).peak


def test_the_heads_term_follows_the_chunked_head():
    """model/head.py: no B x T x V tensor. A few chunks of fp32 logits of at most head.CHUNK_BYTES each, the
    selected hidden states and their gradient, and where the head trains two V x H fp32 tensors in backward."""
    from phalanx.model import head

    cfg = cfg_of("model.n_layer=2", "model.n_embd=256", "model.n_head=4", "data.vocab_size=50000")
    s = memplan.shapes(cfg)
    rows = head.CHUNK_BYTES // (4 * s.vocab)
    assert rows == head.chunk_rows(s.vocab) and 1 < rows < 4096
    big = memplan.head_bytes(s, 4096, trains_head=True)
    weight = memplan.HEAD_WEIGHT_GRADIENTS * 4 * s.vocab * s.hidden
    assert big == pytest.approx(memplan.LOGIT_CHUNKS * 4 * rows * s.vocab + 2 * 4 * 4096 * s.hidden + weight)
    assert memplan.head_bytes(s, 4096, trains_head=False) == pytest.approx(big - weight)  # LoRA: a frozen head
    # past one chunk more targets add their hidden states only; the old term was 12 bytes per target per entry
    assert memplan.head_bytes(s, 8192, trains_head=False) - memplan.head_bytes(s, 4096, trains_head=False) == \
        pytest.approx(2 * 4 * 4096 * s.hidden)
    assert memplan.head_bytes(s, 4096, trains_head=True) < 0.1 * 12 * 4096 * s.vocab
    small = memplan.head_bytes(s, 8, trains_head=False)  # fewer targets than a chunk: those rows only
    assert small == pytest.approx(memplan.LOGIT_CHUNKS * 4 * 8 * s.vocab + 2 * 4 * 8 * s.hidden)
    other = dataclasses.replace(s, arch="gpt_neox")  # a head model/head.py does not fuse: logits at targets only
    assert memplan.head_bytes(other, 100, trains_head=True) == 12 * 100 * s.vocab
    plan = memplan.estimate(cfg, s, 1, "cpu", 100 * GB)
    assert plan.logits == memplan.head_bytes(s, cfg.train.micro_batch_size * cfg.model.block_size, True)
    classify = cfg_of("task=classify", "model.n_layer=2", "model.n_embd=256", "model.n_head=4")
    assert memplan.estimate(classify, memplan.shapes(classify), 1, "cpu", 100 * GB).logits == 0


def test_activations_follow_the_blocks_saved_tensors():
    """Bytes a block saves per token, fp32 (counted with saved-tensor hooks on these shapes): GPT-2 4 (8 h + 5 I)
    (with dropout + 16 h and 12 x heads x seq: math-path attention), Llama 4 (8 h + 2 kv + 4 I); LoRA's
    adapters each adapted layer's input and its 1-byte dropout mask."""
    gpt2 = memplan.shapes(cfg_of("model.n_layer=2", "model.n_embd=256", "model.n_head=4"))
    lora_off = cfg_of().model.lora
    assert gpt2.intermediate == 1024 and gpt2.dropout == 0
    assert memplan.block_activation_bytes(gpt2, 128, lora_off) == pytest.approx((4 * (8 + 20) * 256, 0))
    dropped = dataclasses.replace(gpt2, dropout=0.1)
    assert memplan.block_activation_bytes(dropped, 128, lora_off)[0] == pytest.approx(
        4 * 28 * 256 + 16 * 256 + 12 * 4 * 128)
    llama = memplan.shapes(cfg_of("model.arch=llama", "model.n_layer=2", "model.n_embd=256", "model.n_head=4"))
    assert (llama.intermediate, llama.kv_width) == (1024, 256)
    assert memplan.block_activation_bytes(llama, 128, lora_off)[0] == pytest.approx(4 * (8 + 2 + 16) * 256)
    lora = cfg_of("task=chat", "model.arch=llama", "model.n_layer=2", "model.n_embd=256", "model.n_head=4",
                  "model.lora.r=8")
    ls = memplan.shapes(lora)
    assert ls.lora_inputs == 6 * 256 + 1024  # q, k, v, o, gate, up read h; down reads I
    assert memplan.block_activation_bytes(ls, 128, lora.model.lora) == pytest.approx(
        (4 * 26 * 256, 5 * ls.lora_inputs))


def test_activations_cost_more_where_they_come_from_the_heaps():
    """A block's tensors (tokens x h fp32) under glibc's mmap threshold come from its heaps: 1 MiB where fsdp
    returns freed memory, 32 MiB where ddp keeps it; at or above it each is mapped on its own."""
    cfg = cfg_of("model.n_layer=2", "model.n_embd=1024", "model.n_head=16", "model.block_size=512")
    s = memplan.shapes(cfg)
    fsdp = _with(cfg, strategy="fsdp")
    assert memplan.activation_factor(fsdp, s, 512, "cpu", False) == memplan.MAPPED_FACTOR  # 2 MiB tensors
    assert memplan.activation_factor(fsdp, s, 64, "cpu", False) == memplan.HEAP_FACTOR    # 256 KiB
    assert memplan.activation_factor(fsdp, s, 256, "cpu", True) == memplan.HEAP_FACTOR    # 16-bit: 512 KiB
    assert memplan.activation_factor(cfg, s, 512, "cpu", False) == memplan.HEAP_FACTOR     # ddp keeps freed memory
    assert memplan.activation_factor(cfg, s, 512, "cuda", False) == memplan.MAPPED_FACTOR
    assert memplan.HEAP_FACTOR > memplan.MAPPED_FACTOR


def test_a_pretrained_tokenizer_sizes_the_vocabulary(tmp_path):
    """Workers build the model with len(tokenizer) when data.tokenizer is set; data.vocab_size only trains one."""
    folder = tokenizer_dir(tmp_path, SHAKESPEARE.read_text()[:20000])
    s = memplan.shapes(cfg_of(f"data.tokenizer={folder}", "data.vocab_size=8192"))
    from transformers import AutoTokenizer
    assert s.vocab == len(AutoTokenizer.from_pretrained(folder)) != 8192


def test_a_plan_that_does_not_fit_names_the_smallest_change():
    cfg = cfg_of("model.block_size=512", "train.micro_batch_size=32", "train.global_batch_size=64")
    s = memplan.shapes(cfg)
    room = 0.75 * memplan.estimate(cfg, s, 1, "cpu", 0).peak  # activations are most of it
    plan = memplan.estimate(cfg, s, 1, "cpu", room)
    assert not plan.fits
    fix = memplan.suggest(cfg, s, 1, "cpu", room)
    assert fix and fix.startswith("train.")
    key, value = fix.split()[0].split("=")
    section, name = key.split(".")
    typed = type(getattr(cfg.train, name))(value)
    fixed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{name: typed}))
    assert memplan.estimate(fixed, s, 1, "cpu", room).fits
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
    # bf16 gathers of the root and of a block twice; LoRA's gradients are a sliver of a unit
    assert fsdp.weights == pytest.approx((2 * frozen + 4 * s.trainable) / 4 + 2 * (s.root + 2 * s.block), rel=0.02)
    fp32 = dataclasses.replace(lora, model=dataclasses.replace(lora.model, base_dtype="fp32"))
    assert memplan.estimate(fp32, s, 4, "cpu", 100 * GB).weights == pytest.approx(4 * s.parameters)
    room = (ddp.peak + fsdp.peak) / 2  # fits sharded, not whole
    assert fsdp.peak < room < ddp.peak
    assert memplan.suggest(lora, s, 4, "cpu", room) == "train.strategy=fsdp"


def test_a_grpo_sample_is_its_g_completions():
    """Task grpo's micro-batch sample is a prompt, trained as grpo.num_generations rows of the block (up to
    model.block_size each): the plan counts 8 prompts' activations and head as 8 x 8 rows of task chat. Before,
    it counted one row per prompt: GSM8K's 8 x 512-token rows planned 1.8 GB of activations and took >13 GB."""
    common = ("model.arch=llama", "model.n_layer=2", "model.n_embd=256", "model.n_head=4", "model.lora.r=8",
              "model.block_size=128", "train.global_batch_size=64")

    def plan(*overrides):
        cfg = cfg_of(*common, *overrides)
        return memplan.estimate(cfg, memplan.shapes(cfg), 1, "cpu", 100 * GB)
    grpo = plan("task=grpo", "train.micro_batch_size=8", "grpo.num_generations=8")
    rows = plan("task=chat", "train.micro_batch_size=64")
    assert grpo.activations == pytest.approx(rows.activations) and grpo.logits == pytest.approx(rows.logits)
    assert grpo.activations > 7 * plan("task=chat", "train.micro_batch_size=8").activations  # not a row per prompt
