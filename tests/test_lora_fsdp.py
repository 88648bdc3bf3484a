"""LoRA on models larger than one device (issue 26): FSDP2 + LoRA with a 16-bit frozen base.

In-memory checks run tests/lora_worker.py under torch.distributed.run (Gloo, CPU; chat's own build and
export code); trajectories and resumes are real `phalanx train` runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, phalanx, train_losses, with_worker_zygote, zygote_python
from test_chat import LORA, base, chat_args, talk  # noqa: F401 - fixtures

from phalanx.core.errors import ConfigError

WORKER = REPO / "tests" / "lora_worker.py"
FP32 = ["train.precision=fp32", "train.keep_checkpoints=4"]


def torchrun(out: Path, base_folder: Path, nproc: int, strategy: str = "fsdp") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([zygote_python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(WORKER), str(out), str(base_folder), strategy], cwd=REPO, capture_output=True,
                          text=True, timeout=240, env=with_worker_zygote({**os.environ, "OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """bf16 checkpoints with a tokenizer: GPT-2 (Conv1D: in x out weights, tied head) and Llama (Linear, an
    untied head, so trainable-token rows live in the head too)."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    from conftest import SHAKESPEARE
    from phalanx.data import tokenizer as toks

    root = tmp_path_factory.mktemp("bases")
    tok = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([SHAKESPEARE.read_text()[:100_000]], 300),
                                  **toks.SPECIALS["bpe"])
    torch.manual_seed(0)
    models = {"gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=48, n_layer=2,
                                                 n_head=2)),
              "llama": LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=80,
                                                    num_hidden_layers=2, num_attention_heads=2,
                                                    num_key_value_heads=2, tie_word_embeddings=False))}
    for arch, model in models.items():
        model.to(torch.bfloat16).save_pretrained(root / arch)
        tok.save_pretrained(root / arch)
    return {arch: root / arch for arch in models}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, bases) -> dict:
    root = tmp_path_factory.mktemp("lora-worlds")
    runs = {"gpt2-2": ("gpt2", 2), "gpt2-3": ("gpt2", 3), "llama-2": ("llama", 2)}
    return {key: torchrun(root / key, bases[arch], n) for key, (arch, n) in runs.items()}


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _world_one(base_folder: Path) -> dict[str, torch.Tensor]:
    """The same build in this process: world size 1, no sharding."""
    sys.path.insert(0, str(REPO / "tests"))
    from lora_worker import build, gathered

    from phalanx.core import dist

    info = dist.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, attempt=0,
                         backend="gloo", device=torch.device("cpu"))
    return gathered(build(info, str(base_folder), "ddp")[2])


def test_adapters_are_the_same_at_world_1_2_and_3(worlds, bases):
    """Named init: every adapter and trainable-token row equal bitwise at any world size; A drawn (not
    zero), B zero, token rows = the base's rows (bf16 values)."""
    one = _world_one(bases["gpt2"])
    two, three = _load(worlds["gpt2-2"] / "init.safetensors"), _load(worlds["gpt2-3"] / "init.safetensors")
    assert one.keys() == two.keys() == three.keys() and any("lora_A" in k for k in one)
    assert any("trainable_tokens_delta" in k for k in one)
    for name in one:
        assert torch.equal(one[name], two[name]) and torch.equal(one[name], three[name]), name
        if "lora_A" in name:
            assert one[name].abs().sum() > 0, name
        if "lora_B" in name:
            assert one[name].abs().sum() == 0, name
    # rows were really split: a rank-0-only save (accelerate #4206) would miss most of them
    rows = [json.loads((worlds["gpt2-3"] / f"rank{r}.json").read_text())["local_rows"] for r in range(3)]
    name = next(n for n in one if "lora_B" in n)
    assert rows[0][name] < one[name].shape[0] == sum(r[name] for r in rows)


def test_a_16_bit_base_stays_16_bit_and_only_adapters_train(worlds):
    """Stored frozen shards bf16, adapters fp32; gradients and AdamW state fp32 and only for the adapters;
    every frozen shard bit-identical after 3 optimizer steps."""
    for key in ("gpt2-2", "llama-2"):
        for rank in range(2):
            r = json.loads((worlds[key] / f"rank{rank}.json").read_text())
            assert r["frozen_stored"] == ["torch.bfloat16"] and r["adapters_stored"] == ["torch.float32"], key
            assert r["frozen_count"] > 10 and r["frozen_unchanged"], key
            assert r["with_grad"] == r["trainable"] == r["with_state"], key  # nothing frozen has either
            assert r["grad_dtypes"] == ["torch.float32"] and r["state_dtypes"] == ["torch.float32"], key
    trained, init = _load(worlds["gpt2-2"] / "trained.safetensors"), _load(worlds["gpt2-2"] / "init.safetensors")
    assert all(not torch.equal(trained[k], init[k]) for k in init)  # every adapter moved


def _adapter_file(run: Path) -> dict[str, torch.Tensor]:
    return _load(run / "final" / "final" / "adapter" / "adapter_model.safetensors")


def test_the_saved_adapter_holds_every_ranks_rows(worlds):
    """RUN/final/adapter read back == the adapters gathered in memory (peft's names: without the adapter's
    name); at 3 processes too."""
    for key in ("gpt2-2", "gpt2-3", "llama-2"):
        saved, memory = _adapter_file(worlds[key]), _load(worlds[key] / "trained.safetensors")
        memory = {k.replace(".default", ""): v for k, v in memory.items()}
        for name, value in memory.items():
            assert torch.equal(saved[name], value), (key, name)
        extra = set(saved) - set(memory)  # peft also writes a tied head's token rows: the embedding's
        tied = "base_model.model.transformer.wte.token_adapter.trainable_tokens_delta"
        assert extra == ({tied.replace("transformer.wte", "lm_head")} if key.startswith("gpt2") else set()), key
        assert all(torch.equal(saved[name], memory[tied]) for name in extra)


@pytest.mark.parametrize("key", ["gpt2-2", "llama-2"])
def test_merged_export_equals_base_plus_adapter_through_peft(worlds, bases, key):
    """The merged RUN/final (written by all ranks, merged in fp32): plain transformers' logits equal the
    base + adapter through peft.PeftModel within 1e-5 in fp32; the bf16 export within 2e-2 (bf16 rounds
    each merged weight to 8 bits of mantissa); without the adapter the logits differ."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = worlds[key]
    tok = AutoTokenizer.from_pretrained(run / "final" / "final")
    base_model = AutoModelForCausalLM.from_pretrained(bases[key.split("-")[0]], dtype=torch.float32)
    base_model.resize_token_embeddings(len(tok), mean_resizing=False)
    adapted = PeftModel.from_pretrained(base_model, run / "final" / "final" / "adapter").eval()
    ids = torch.tensor([[3, 7, len(tok) - 2, 20, 40, len(tok) - 1, 5, 9]])
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        with adapted.disable_adapter():
            plain = adapted(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(run / "final" / "final").eval()
        assert next(merged.parameters()).dtype == torch.float32
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        half = AutoModelForCausalLM.from_pretrained(run / "final-bf16" / "final", dtype=torch.float32).eval()
        assert float((half(input_ids=ids).logits - want).abs().max()) < 2e-2
    assert float((plain - want).abs().max()) > 1e-3


# ---- real runs ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp_lora(tmp_path_factory, talk, base, cache_dir) -> Path:  # noqa: F811
    run = tmp_path_factory.mktemp("fsdp-lora")
    phalanx(*chat_args(run, talk, cache_dir, *LORA, *FP32, f"model.pretrained={base}", "train.strategy=fsdp"),
            "--nproc-per-node", 2, check=True, timeout=240)
    return run


def test_fsdp_lora_equals_ddp_lora(fsdp_lora, talk, base, cache_dir, tmp_path):  # noqa: F811
    """The same config under ddp: per-step losses within 1e-5; the start line says what is stored and what
    computes; checkpoints hold only adapters and trainable-token rows."""
    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "ddp"
    proc = phalanx(*chat_args(run, talk, cache_dir, *LORA, *FP32, f"model.pretrained={base}"),
                   "--nproc-per-node", 2, check=True, timeout=240)
    got, want = train_losses(fsdp_lora), train_losses(run)
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert "frozen base stored fp32 (auto), compute fp32" in proc.stdout
    keys = FileSystemReader(str(fsdp_lora / "checkpoints" / "step_000008")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k or "trainable_tokens" in k for k in model_keys), model_keys[:5]


def test_fsdp_lora_resumes_bitwise_on_the_same_world_size(fsdp_lora, talk, base, cache_dir, tmp_path):  # noqa: F811
    run = tmp_path / "again"
    phalanx(*chat_args(run, talk, cache_dir, *LORA, *FP32, f"model.pretrained={base}", "train.strategy=fsdp"),
            "--nproc-per-node", 2, "--resume", fsdp_lora / "checkpoints" / "step_000003", check=True, timeout=240)
    got, want = train_losses(run), train_losses(fsdp_lora)
    assert sorted(got) == list(range(4, 9))  # resumed, not started over (which would give the same losses)
    assert got == {s: want[s] for s in range(4, 9)}


@pytest.mark.slow
def test_fsdp_lora_resumes_2_to_4_then_4_to_1(fsdp_lora, talk, base, cache_dir, tmp_path):  # noqa: F811
    """Saved by 2 processes, continued by 4 (resharded by DCP), whose checkpoint 1 process continues: the
    same trajectory within 1e-5."""
    four, one = tmp_path / "four", tmp_path / "one"
    args = [*LORA, *FP32, f"model.pretrained={base}", "train.strategy=fsdp"]
    phalanx(*chat_args(four, talk, cache_dir, *args), "--nproc-per-node", 4, "--resume",
            fsdp_lora / "checkpoints" / "step_000003", check=True, timeout=300)
    phalanx(*chat_args(one, talk, cache_dir, *args), "--resume", four / "checkpoints" / "step_000006", check=True,
            timeout=300)
    want = train_losses(fsdp_lora)
    for run, steps in ((four, range(4, 9)), (one, range(7, 9))):
        got = train_losses(run)
        assert sorted(got) == list(steps), run.name  # resumed there
        for step in steps:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (run.name, step)


def test_a_16_bit_base_under_ddp_needs_16_bit_compute(tmp_path, talk, base, cache_dir):  # noqa: F811
    from phalanx.core.config import load_config
    from phalanx.model import precision

    proc = phalanx(*chat_args(tmp_path / "r", talk, cache_dir, "model.lora.r=4", "model.base_dtype=bf16", *FP32,
                              f"model.pretrained={base}"), "--nproc-per-node", 2)
    assert proc.returncode == 2 and "train.precision=bf16" in proc.stderr and not (tmp_path / "r" / "logs").exists()
    with pytest.raises(ConfigError, match="model.base_dtype.*only LoRA"):
        load_config(None, ["model.base_dtype=bf16"])
    lora = load_config(None, ["task=chat", "model.lora.r=4"]).model
    bf16 = lambda: torch.bfloat16  # noqa: E731 - a bf16 checkpoint
    assert precision.base_dtype(lora, "fsdp", 2, None, bf16) == torch.bfloat16  # FSDP2 casts per block
    assert precision.base_dtype(lora, "ddp", 2, None, bf16) is None  # auto keeps fp32 for fp32 compute
    assert precision.base_dtype(lora, "ddp", 2, torch.bfloat16, bf16) == torch.bfloat16
    assert precision.base_dtype(lora, "fsdp", 2, None, lambda: torch.float32) is None
