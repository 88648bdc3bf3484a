"""GGUF bases: model.pretrained names a .gguf file (or hf:OWNER/REPO/FILE.gguf), which the launcher dequantises
once into a content-keyed fp32 folder of the cache. The real SmolLM2 (../shared/models) against transformers'
own GGUF reader; bad files are exit 2 naming the key, with nothing half-written left in the cache."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import gguf as ggufpkg
import numpy as np
import pytest
import torch
from conftest import SMOLLM2_GGUF, phalanx

from phalanx.core.config import ConfigError, load_config
from phalanx.data import hub
from phalanx.model import gguf
from phalanx.model.identity import base_identity
from phalanx.model.weights import checkpoint_dtype
from phalanx.tools.launch import resolve_pretrained

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # ../shared/models/README.md


def resolved(spec, cache: Path, *extra: str):
    return resolve_pretrained(load_config(None, [f"model.pretrained={spec}", f"data.cache_dir={cache}", *extra]))


def write_gguf(path: Path, arch: str, tensors: dict) -> Path:
    """A small GGUF file through the gguf package's own writer: name -> (array, quant type or None)."""
    writer = ggufpkg.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def leftovers(cache: Path) -> list[str]:
    """Whatever the GGUF part of the cache holds (temporary folders included)."""
    root = cache / "gguf"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


# ---- the real SmolLM2 --------------------------------------------------------------------------------
def test_logits_equal_transformers_own_gguf_reader(smollm2_folder, cache_dir):
    """phalanx's builder on model.pretrained=<the .gguf> (resolved as the launcher does) gives transformers'
    logits for the GGUF file within 1e-5 in fp32, with the embedding and the output head one tensor."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.model.build import build_causal_lm, quiet_transformers
    from phalanx.model.gguf import name_maps_once

    cfg = resolved(SMOLLM2_GGUF, cache_dir, "task=chat")
    assert Path(cfg.model.pretrained) == smollm2_folder  # the session's folder: found, not built again
    model = build_causal_lm(cfg.model, vocab_size=0, eos_id=0, seed=0).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    quiet_transformers()
    with name_maps_once():  # (the same maps, built once: ~15 s less)
        reference = AutoModelForCausalLM.from_pretrained(SMOLLM2_GGUF.parent, gguf_file=SMOLLM2_GGUF.name,
                                                         dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert got.dtype == want.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-5
    assert tok.decode(got[0, -1].argmax()) == tok.decode(want[0, -1].argmax())


def test_the_folder_is_a_plain_fp32_folder_that_names_its_gguf(smollm2_folder):
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    assert checkpoint_dtype(smollm2_folder) == torch.float32  # what model.base_dtype / train.export_dtype auto read
    from safetensors import safe_open

    with safe_open(str(smollm2_folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F32"}
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # tied: stored once
    marker = gguf.marker(smollm2_folder)
    assert marker["sha256"] == SMOLLM2_SHA256 and marker["source"] == str(SMOLLM2_GGUF)
    assert marker["quant_types"] == ["Q4_1", "Q8_0", "F32"] and marker["architecture"] == "llama"
    assert "<|im_start|>" in (smollm2_folder / "chat_template.jinja").read_text()
    assert json.loads((smollm2_folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert gguf.describe(str(smollm2_folder)) == (f"base SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1, Q8_0, F32) "
                                                  f"dequantised to fp32 in {smollm2_folder}")
    assert gguf.describe(str(smollm2_folder.parent)) == ""


def test_identity_is_the_hash_of_the_gguf_bytes(smollm2_folder, cache_dir):
    want = "sha256:" + SMOLLM2_SHA256
    assert base_identity(str(smollm2_folder), cache_dir) == want
    assert base_identity(str(SMOLLM2_GGUF), cache_dir) == want  # the file itself, before resolution
    assert hashlib.sha256(SMOLLM2_GGUF.read_bytes()).hexdigest() == SMOLLM2_SHA256


def test_a_second_resolution_reuses_the_folder(smollm2_folder, cache_dir, tmp_path, capsys):
    """By content: the same file, or a link to it without the .gguf suffix (as Ollama's blobs are named)."""
    weights = smollm2_folder / "model.safetensors"
    before = os.stat(weights)
    blob = tmp_path / "sha256-b179c9523d0e"
    blob.symlink_to(SMOLLM2_GGUF)
    for spec in (SMOLLM2_GGUF, blob):
        assert Path(resolved(spec, cache_dir).model.pretrained) == smollm2_folder
    waiting = load_config(None, [f"model.pretrained={SMOLLM2_GGUF}", f"data.cache_dir={cache_dir}"])
    assert Path(resolve_pretrained(waiting, builds=False).model.pretrained) == smollm2_folder  # there: no wait
    after = os.stat(weights)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert "dequantising" not in capsys.readouterr().out
    assert leftovers(cache_dir) == [smollm2_folder.name]


# ---- bad input: exit 2 naming the key, nothing left in the cache -----------------------------------------
def test_a_lone_safetensors_file_is_exit_2_through_the_cli(tmp_path):
    lone = tmp_path / "model.safetensors"
    lone.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    proc = phalanx("train", "task=chat", f"model.pretrained={lone}", f"data.cache_dir={tmp_path / 'cache'}",
                   "--run-dir", tmp_path / "run", timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "config key 'model.pretrained'" in lines[0], proc.stderr
    assert "config.json" in lines[0] and "model.safetensors" in lines[0] and ".gguf" in lines[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, content, says", [
    ("pytorch_model.bin", b"PK\x03\x04 a zip of tensors", "without the GGUF magic"),
    ("model.gguf", b"not a gguf at all", "without the GGUF magic"),
    ("cut.gguf", b"GGUF\x03\x00\x00\x00\x01", "not a readable GGUF file"),
])
def test_files_that_are_not_gguf_are_config_errors(tmp_path, name, content, says):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=says) as e:
        resolved(path, tmp_path / "cache")
    assert "config key 'model.pretrained'" in str(e.value) and "\n" not in str(e.value)
    assert leftovers(tmp_path / "cache") == []


def test_an_architecture_transformers_cannot_read_is_named(tmp_path):
    path = write_gguf(tmp_path / "enc.gguf", "bert", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    with pytest.raises(ConfigError, match="architecture bert is not supported") as e:
        resolved(path, tmp_path / "cache")
    assert "config key 'model.pretrained'" in str(e.value)
    assert leftovers(tmp_path / "cache") == []  # the temporary folder went with the failure


def test_a_quant_type_that_cannot_be_dequantised_is_named(tmp_path):
    kind = ggufpkg.GGMLQuantizationType.Q8_K
    block = np.zeros((2, ggufpkg.GGML_QUANT_SIZES[kind][1]), np.uint8)
    path = write_gguf(tmp_path / "k.gguf", "llama", {"token_embd.weight": (np.zeros((4, 8), np.float32), None),
                                                     "blk.0.attn_q.weight": (block, kind)})
    assert gguf.read_header(path).quant_types == ("Q8_K", "F32")
    with pytest.raises(ConfigError, match="type Q8_K, which the gguf package cannot dequantise"):
        resolved(path, tmp_path / "cache")
    assert leftovers(tmp_path / "cache") == []


# ---- hf:OWNER/REPO/FILE.gguf ---------------------------------------------------------------------------
@pytest.fixture
def empty_hub_cache(monkeypatch, tmp_path) -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


def test_a_hub_gguf_name_offline_is_one_line(empty_hub_cache, monkeypatch):
    monkeypatch.setattr(hub, "_probe", lambda name, kind: "ConnectError: no network")
    spec = "hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2-135m-instruct-q4_1.gguf"
    cfg = load_config(None, ["task=chat", f"model.pretrained={spec}"])
    hub.check_hub_names(cfg)  # the 3-part name is a file, fetched by gguf_file, not a repo name to check
    with pytest.raises(ConfigError) as e:
        resolve_pretrained(cfg)
    line = str(e.value)
    assert "\n" not in line and "config key 'model.pretrained'" in line and "unreachable" in line
    assert "'smollm2-135m-instruct-q4_1.gguf' of model 'HuggingFaceTB/SmolLM2-135M-Instruct-GGUF'" in line
    assert "hf download HuggingFaceTB/SmolLM2-135M-Instruct-GGUF smollm2-135m-instruct-q4_1.gguf" in line
    with pytest.raises(ConfigError, match="expected 'hf:OWNER/REPO/FILE.gguf'"):
        hub.gguf_file("hf:justone.gguf")


def test_a_cached_hub_gguf_file_needs_no_network(empty_hub_cache, monkeypatch):
    monkeypatch.setattr(hub, "_probe", lambda name, kind: pytest.fail(f"the hub was asked for {name}"))
    snapshot = empty_hub_cache / "models--owner--repo" / "snapshots" / ("a" * 40)
    (snapshot / "sub").mkdir(parents=True)
    (empty_hub_cache / "models--owner--repo" / "refs").mkdir()
    (empty_hub_cache / "models--owner--repo" / "refs" / "main").write_text("a" * 40)
    (snapshot / "sub" / "m.gguf").write_bytes(b"GGUF")
    assert hub.is_gguf_name("hf:owner/repo/sub/m.gguf") and not hub.is_gguf_name("hf:owner/repo")
    assert hub.gguf_file("hf:owner/repo/sub/m.gguf") == snapshot / "sub" / "m.gguf"


def test_a_waiting_process_gives_up_after_the_startup_timeout(tmp_path):
    """Not the node's first process under an outside torchrun/srun: it waits for the folder, bounded."""
    path = write_gguf(tmp_path / "enc.gguf", "bert", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    cfg = load_config(None, [f"model.pretrained={path}", f"data.cache_dir={tmp_path / 'cache'}",
                             "dist.startup_timeout_s=1"])
    with pytest.raises(ConfigError, match="waited 1 s .* for the node's first process to dequantise"):
        resolve_pretrained(cfg, builds=False)
    assert leftovers(tmp_path / "cache") == []


# ---- a chat run from the GGUF, end to end ----------------------------------------------------------------
QUESTION = "What is the capital of France?"


@pytest.mark.slow
def test_a_chat_run_from_the_gguf_resumes_exports_and_answers(smollm2_folder, cache_dir, tmp_path):
    """LoRA chat SFT on 2 processes from model.pretrained=<the .gguf>: the run records the folder, the same
    command resumes it, final/ loads in plain transformers with its chat template and answers through
    `phalanx chat` (greedy: SmolLM2 knows Paris, and one small LoRA step does not change that)."""
    data = tmp_path / "talk.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant",
                                                                                    "content": a}]}) + "\n"
                            for q, a in [(QUESTION, "Paris."), ("Name a colour.", "Blue."),
                                         ("How many legs has a cat?", "Four."), ("Say hello.", "Hello!")]))
    run = tmp_path / "run"
    args = ["train", "task=chat", f"data.train={data}", f"data.cache_dir={cache_dir}",
            f"model.pretrained={SMOLLM2_GGUF}", "model.lora.r=8", "model.block_size=64", "data.val_fraction=0",
            "train.global_batch_size=2", "train.micro_batch_size=1", "train.max_steps=1", "train.checkpoint_every=1",
            "train.eval_every=0", "train.warmup_steps=0", "train.lr=1e-4", "log.progress=lines",
            "dist.threads_per_worker=1", "dist.backend=gloo", "--run-dir", run, "--nproc-per-node", 2]
    first = phalanx(*args, check=True, timeout=600)
    assert "dequantising" not in first.stdout  # the session's folder, found by content
    assert (f"base SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1, Q8_0, F32) dequantised to fp32 in {smollm2_folder}"
            in first.stdout)
    assert load_config(str(run / "config.yaml"), check_paths=False).model.pretrained == str(smollm2_folder)
    meta = json.loads(next((run / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["base_model"] == "sha256:" + SMOLLM2_SHA256
    again = phalanx(*[a if a != "train.max_steps=1" else "train.max_steps=2" for a in args], check=True, timeout=600)
    assert "resumed from" in again.stdout and "at step 1" in again.stdout

    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run / "final"
    tok, model = AutoTokenizer.from_pretrained(final), AutoModelForCausalLM.from_pretrained(final).eval()
    assert "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    proc = phalanx("chat", run, "--message", QUESTION, "--max-new-tokens", 12, check=True, timeout=300)
    assert "Paris" in proc.stdout
