"""Pretrained weights, as the Builder loads them (model/load.py, model/weights.py): transformers' own key
renaming for the class, every parameter loaded or said to be new, the index deciding which files are read,
and the logits of plain `from_pretrained` for the families the chat task claims."""
from __future__ import annotations

import copy
import json
from functools import partial

import pytest
import torch
from conftest import SHAKESPEARE, TINY_LM, phalanx
from safetensors.torch import load_file, save_file

from phalanx.core.config import ConfigError, ModelConfig
from phalanx.data import tokenizer as toks
from phalanx.model.build import causal_lm, classifier, quiet_transformers
from phalanx.model.shard import Builder, transformer_blocks

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)
IDS = (torch.arange(24).reshape(2, 12) * 7) % 96


def family_config(arch: str):
    """Tiny configs of the families the chat task claims (some with untied heads, so lm_head must load)."""
    import transformers as T

    return {"llama": lambda: T.LlamaConfig(**SMALL, tie_word_embeddings=False),
            "mistral": lambda: T.MistralConfig(**SMALL, sliding_window=4),
            "qwen2": lambda: T.Qwen2Config(**SMALL, tie_word_embeddings=False),
            "qwen3": lambda: T.Qwen3Config(**SMALL, head_dim=16),
            "gemma2": lambda: T.Gemma2Config(**SMALL, head_dim=16, sliding_window=4),
            "gemma3": lambda: T.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=4),
            "phi3": lambda: T.Phi3Config(**SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2)}[arch]()


def saved(folder, config, dtype=torch.float32, seed=0):
    """A model of `config` with random weights, saved by save_pretrained in `dtype`; returns it (fp32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    model.to(dtype).save_pretrained(folder)
    return model


def built(folder, builder=None):
    """phalanx's pretrained build (the trainer's load path), whole, on the CPU."""
    return (builder or Builder(seed=1)).build(partial(causal_lm, ModelConfig(pretrained=str(folder)), 0, 0),
                                             str(folder)).eval()


def reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def assert_same_logits(model, ref) -> None:
    assert model.config._attn_implementation == ref.config._attn_implementation
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, ref(input_ids=IDS).logits, rtol=0, atol=1e-6)


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    quiet_transformers()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_the_chat_families_load_to_the_logits_of_from_pretrained(tmp_path, arch, dtype):
    saved(tmp_path, family_config(arch), dtype)
    builder = Builder(seed=1)
    model = built(tmp_path, builder)
    assert builder.report.new == [] and builder.report.grown == {}  # everything came from the checkpoint
    assert_same_logits(model, reference(tmp_path))


def gemma3_multimodal():
    from transformers import Gemma3Config

    return Gemma3Config(text_config=dict(SMALL, head_dim=16, sliding_window=4),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14),
                        mm_tokens_per_image=4)


def test_keys_transformers_renames_load_like_from_pretrained(tmp_path, monkeypatch):
    """Gemma-3 with its vision tower: save_pretrained writes `language_model.model.*` (the hub's layout);
    the model's names are `model.language_model.*`. transformers' conversion mapping for model_type gemma3
    renames them, and the decoder blocks are the text model's, not the vision tower's layers."""
    import transformers.conversion_mapping as mapping

    saved(tmp_path, gemma3_multimodal())
    assert any(k.startswith("language_model.model.layers.") for k in load_file(str(tmp_path / "model.safetensors")))
    model = built(tmp_path)
    assert_same_logits(model, reference(tmp_path))
    blocks = transformer_blocks(model)
    assert len(blocks) == 2 and all(type(b).__name__ == "Gemma3DecoderLayer" for b in blocks)
    # negative control: without transformers' renaming the text model is not in the checkpoint (before this
    # change, phalanx initialised it at random without a word)
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", lambda model, *a, **k: [])
    with pytest.raises(ConfigError, match=r"does not hold \d+ parameters of Gemma3ForConditionalGeneration.*"
                                          r"model\.language_model\.layers\.\*\.self_attn\.q_proj\.weight \(x2\)"):
        built(tmp_path)


def test_fused_moe_experts_load_through_transformers_converters(tmp_path):
    """Qwen2-MoE: the checkpoint holds one tensor per expert, the model one fused tensor per layer."""
    from transformers import Qwen2MoeConfig

    saved(tmp_path, Qwen2MoeConfig(**SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                   num_experts=4, num_experts_per_tok=2))
    keys = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    assert_same_logits(built(tmp_path), reference(tmp_path))


def test_an_unloaded_parameter_is_an_error_naming_it(tmp_path):
    """A Llama saved with its keys under `language_model.` (no mapping of transformers covers that): every
    parameter would stay random, so the build is refused naming them (it used to build without a word)."""
    saved(tmp_path, family_config("llama"))
    weights = load_file(str(tmp_path / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.pretrained.*does not hold 21 parameters of LlamaForCausalLM.*"
                                          r"model\.layers\.\*\.self_attn\.q_proj\.weight \(x2\).*lm_head\.weight"):
        built(tmp_path)
    # one tensor missing is enough
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"does not hold 1 parameters.*: model\.layers\.1\.mlp\.up_proj\.weight;"):
        built(tmp_path)


def test_a_new_head_is_what_from_pretrained_initialises_and_is_reported(tmp_path):
    """classify from a masked-LM checkpoint: the head transformers reports as newly initialised (DistilBERT's
    pre_classifier + classifier; the checkpoint's class has no such modules) is initialised by name and named
    in the report; the body is loaded."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM, DistilBertForSequenceClassification

    torch.manual_seed(0)
    DistilBertForMaskedLM(DistilBertConfig(vocab_size=96, dim=32, n_layers=2, n_heads=2, hidden_dim=64)) \
        .save_pretrained(tmp_path)
    builder = Builder(seed=1)
    model = builder.build(partial(classifier, ModelConfig(pretrained=str(tmp_path)), 0, 0, 16, {0: "a", 1: "b"}),
                          str(tmp_path), mismatched="init")
    assert sorted(builder.report.new) == ["classifier.bias", "classifier.weight", "pre_classifier.bias",
                                          "pre_classifier.weight"]
    assert builder.report.clause() == "new: pre_classifier, classifier (not in the checkpoint)"
    _, info = DistilBertForSequenceClassification.from_pretrained(tmp_path, num_labels=2, output_loading_info=True)
    assert sorted(info["missing_keys"]) == sorted(builder.report.new)  # what transformers reports as new
    body = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(model.distilbert.transformer.layer[1].ffn.lin2.weight,
                       body["distilbert.transformer.layer.1.ffn.lin2.weight"])


def test_grown_embedding_rows_are_reported(tmp_path):
    saved(tmp_path, family_config("llama"))  # untied: both embeddings grow

    def define():
        model = causal_lm(ModelConfig(pretrained=str(tmp_path)), 0, 0)
        model.resize_token_embeddings(100, mean_resizing=False)
        return model

    builder = Builder(seed=1)
    builder.build(define, str(tmp_path))
    assert builder.report.grown == {"model.embed_tokens.weight": (96, 100), "lm_head.weight": (96, 100)}
    assert builder.report.new == []
    assert builder.report.clause() == "grown: model.embed_tokens 96 -> 100 rows, lm_head 96 -> 100 rows"


def test_the_index_decides_which_files_are_read(tmp_path):
    """Sharded files + their index, beside a stale model.safetensors of other weights: the index's files
    are read (before, every *.safetensors was opened and the stale one, sorted last, won)."""
    model = saved(tmp_path / "m", family_config("llama"), seed=0)
    model.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    stale = saved(tmp_path / "stale", family_config("llama"), seed=1)
    (tmp_path / "stale" / "model.safetensors").rename(tmp_path / "m" / "model.safetensors")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = built(tmp_path / "m")
    for name, p in got.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name
        assert p.dim() == 1 or not torch.equal(p, stale.get_parameter(name)), name  # (norms start at one)


@pytest.fixture(scope="module")
def renamed_llama(tmp_path_factory):
    """A tiny Llama with a tokenizer, its weights saved under `language_model.` names."""
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("renamed-llama")
    tok = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([SHAKESPEARE.read_text()[:50_000]], 512),
                                  **toks.SPECIALS["bpe"])
    saved(folder, LlamaConfig(**{**SMALL, "vocab_size": len(tok)}, eos_token_id=tok.eos_token_id))
    tok.save_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


def test_unloaded_weights_are_exit_2_before_any_worker_starts(tmp_path, renamed_llama, cache_dir):
    run = tmp_path / "run"
    proc = phalanx("train", f"data.train={SHAKESPEARE}", f"data.cache_dir={cache_dir}", "--run-dir", run, *TINY_LM,
                   f"model.pretrained={renamed_llama}", "train.max_steps=1", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.pretrained" in lines[0], proc.stderr
    assert "model.layers.*.self_attn.q_proj.weight (x2)" in lines[0] and "lm_head.weight" in lines[0]
    assert "phalanx: task" not in proc.stdout and not (run / "logs").exists()  # no worker started


def test_the_start_line_names_what_the_run_adds(tmp_path, cache_dir):
    """classify from a masked-LM base (as from distilbert-base-uncased): the new head is said at the start."""
    from conftest import SST2
    from transformers import DistilBertConfig, DistilBertForMaskedLM, PreTrainedTokenizerFast

    base = tmp_path / "base"
    texts = [json.loads(line)["text"] for line in (SST2 / "train.jsonl").read_text().splitlines()[:2000]]
    tok = PreTrainedTokenizerFast(tokenizer_object=toks.train_wordpiece(texts, 500), **toks.SPECIALS["wordpiece"])
    torch.manual_seed(0)
    DistilBertForMaskedLM(DistilBertConfig(vocab_size=len(tok), dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                           pad_token_id=tok.pad_token_id)).save_pretrained(base)
    tok.save_pretrained(base)
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join((SST2 / "train.jsonl").read_text().splitlines()[:32]) + "\n")
    proc = phalanx("train", "task=classify", f"data.train={train}", f"data.validation={SST2 / 'validation.jsonl'}",
                   f"data.cache_dir={cache_dir}", "--run-dir", tmp_path / "run", f"model.pretrained={base}",
                   "classify.max_length=32", "train.micro_batch_size=8", "train.global_batch_size=16",
                   "train.max_steps=1", "train.eval_max_samples=16", "log.progress=lines",
                   "dist.threads_per_worker=1", check=True, timeout=180)
    start = next(line for line in proc.stdout.splitlines() if line.startswith("phalanx: task classify"))
    assert start.endswith(", new: pre_classifier, classifier (not in the checkpoint)"), start
