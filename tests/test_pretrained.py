"""Pretrained checkpoints saved in 16 bit load as fp32 master weights; train.precision decides compute;
RUN/final is written in train.export_dtype (auto: the base's own dtype).

transformers 5 loads `dtype="auto"`: without phalanx asking for fp32, a bf16/fp16 folder (most hub models)
would train 16-bit weights with 16-bit AdamW state, and fp16 GradScaler would refuse to unscale fp16
gradients ("Attempting to unscale FP16 gradients").
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import SHAKESPEARE, TINY_LM, phalanx
from safetensors import safe_open

from phalanx.core.config import load_config
from phalanx.data import tokenizer as toks
from phalanx.model.build import build_causal_lm
from phalanx.run.export import INDEX


def save_half(folder, dtype: torch.dtype):
    """A tiny GPT-2 with its tokenizer, saved with save_pretrained in 16 bit."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([SHAKESPEARE.read_text()[:50_000]], 512),
                                  **toks.SPECIALS["bpe"])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                       eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id))
    model.to(dtype).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, dtype


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def half_folder(request, tmp_path_factory):
    return save_half(tmp_path_factory.mktemp(f"gpt2-{request.param}"), getattr(torch, request.param))


def test_half_precision_checkpoint_loads_as_fp32(half_folder):
    folder, saved = half_folder
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # the file really is 16 bit
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in stored.values()} == {saved}
    cfg = load_config(None, [f"model.pretrained={folder}"])
    model = build_causal_lm(cfg.model, 0, 0)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}
    for name, value in stored.items():  # the same numbers, upcast exactly
        if name in params:
            assert torch.equal(params[name], value.float()), name


def exported(final) -> tuple[set[torch.dtype], str]:
    """The dtypes of RUN/final's weight files (one file or the index's shards), and config.json's dtype."""
    files = sorted(final.glob("model*.safetensors"))
    assert files and all(f.name != "model.safetensors" for f in files) == (final / INDEX).exists()
    dtypes = set()
    for file in files:
        with safe_open(str(file), "pt") as f:
            dtypes |= {f.get_tensor(k).dtype for k in f.keys()}
    return dtypes, json.loads((final / "config.json").read_text())["dtype"]


@pytest.mark.parametrize("precision", [pytest.param("fp16", marks=pytest.mark.slow), "bf16"])  # ~12 s each
def test_train_from_a_half_precision_checkpoint(half_folder, precision, tmp_path, cache_dir):
    """fp16 autocast + GradScaler on a 16-bit checkpoint trains (it raised in unscale_ before); RUN/final is
    written in the base's own dtype (train.export_dtype=auto; it was fp32, twice the base), and loads."""
    from transformers import AutoModelForCausalLM

    folder, saved = half_folder
    run = tmp_path / "run"
    phalanx("train", f"data.train={SHAKESPEARE}", f"data.cache_dir={cache_dir}", "--run-dir", run, *TINY_LM,
            f"model.pretrained={folder}", "train.max_steps=2", f"train.precision={precision}",
            check=True, timeout=180)
    assert exported(run / "final") == ({saved}, str(saved).split(".")[1])
    assert AutoModelForCausalLM.from_pretrained(run / "final").dtype == saved


def test_export_dtype_fp32_of_a_16_bit_base_in_shards(tmp_path, cache_dir):
    """train.export_dtype=fp32 keeps the master weights' dtype; train.export_shard_mb below the model's size
    takes the sharded path (counted in fp32 bytes), and the files load."""
    from transformers import AutoModelForCausalLM

    folder, _ = save_half(tmp_path / "base", torch.bfloat16)
    run = tmp_path / "run"
    phalanx("train", f"data.train={SHAKESPEARE}", f"data.cache_dir={cache_dir}", "--run-dir", run, *TINY_LM,
            f"model.pretrained={folder}", "train.max_steps=1", "train.export_dtype=fp32",
            "train.export_shard_mb=0.05", check=True, timeout=180)
    assert exported(run / "final") == ({torch.float32}, "float32")
    index = json.loads((run / "final" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert AutoModelForCausalLM.from_pretrained(run / "final").dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_write_hf_casts_parameters_on_both_paths_and_counts_the_limit_in_that_dtype(tmp_path, dtype):
    """Parameters are written in the export dtype (cast from the fp32 master weights, tied ones once), a
    persistent buffer keeps its own; config.json says the dtype; the size limit is counted in it: a limit
    between the model's 16-bit and fp32 sizes is one file in 16 bit and shards in fp32."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from phalanx.core import dist
    from phalanx.core.config import ModelConfig
    from phalanx.run.export import write_hf

    info = dist.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, attempt=0,
                         backend="gloo", device=torch.device("cpu"))
    model = build_causal_lm(ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=64, block_size=32), 300, 0, seed=4)
    model.model.register_buffer("counts", torch.arange(3.0))  # a persistent fp32 buffer
    fp32_mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    tok = type("Tok", (), {"save_pretrained": lambda self, out: None})()
    for limit, path in ((2048, "one"), (0.6 * fp32_mb, "limit"), (0.02, "shards")):
        write_hf(model, tok, tmp_path / path, info=info, shard_mb=limit, dtype=dtype)
        files = sorted((tmp_path / path).glob("model*.safetensors"))
        sharded = (tmp_path / path / INDEX).exists()
        assert sharded == (path == "shards" or (path == "limit" and dtype == torch.float32)), path
        written = {k: v for f in files for k, v in load_file(str(f)).items()}
        assert written.pop("model.counts").dtype == torch.float32
        assert {t.dtype for t in written.values()} == {dtype} and "lm_head.weight" not in written  # tied: once
        for name, t in written.items():
            assert torch.equal(t, model.get_parameter(name).detach().to(dtype)), name
        if sharded:
            index = json.loads((tmp_path / path / INDEX).read_text())
            assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values()) + 12
        assert json.loads((tmp_path / path / "config.json").read_text())["dtype"] == str(dtype).split(".")[1]
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / path)
        assert loaded.dtype == dtype and torch.equal(loaded.lm_head.weight, written["model.embed_tokens.weight"])
