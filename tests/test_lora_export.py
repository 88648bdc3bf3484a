"""LoRA's merged export (RUN/final) against peft's own merge (issue 32 item 5): LoRA on an embedding merges
as `merge_and_unload` merges it; an input embedding whose merge could not be what trained is refused; the
export leaves the model as it trained (the merge works on the written copy, not the live weights).

In-process: tiny GPT-2 (Conv1D, tied head) and Llama (Linear, untied head) built from a config, LoRA through
phalanx's apply_lora, the export through the same merged_entries + write_hf chat's export calls (world size
1, the CPU: where the live fp32 weights were merged into). One real `phalanx train` shows the path end to end."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import phalanx, small_gpt2_base
from test_chat import base, chat_args, talk  # noqa: F401 - fixtures

from phalanx.core import dist
from phalanx.core.errors import ConfigError
from phalanx.core.sections import LoraSettings

INFO = dist.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, attempt=0,
                     backend="gloo", device=torch.device("cpu"))
IDS = torch.tensor([[3, 7, 90, 20, 40, 95, 5, 9]])


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def adapted(model, targets: list[str], token_ids: list[int] = ()):
    """`model` with phalanx's LoRA on `targets` and every adapter tensor drawn at random (peft starts B, or
    an embedding's A, at zero: the merge would add nothing)."""
    from phalanx.model.lora import apply_lora

    model = apply_lora(model, LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=targets), list(token_ids))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


class NoTokenizer:
    def save_pretrained(self, out) -> None:
        pass


def export(model, out: Path) -> dict[str, torch.Tensor]:
    """What chat's export writes for a LoRA model (tasks/chat.ChatTask.export), read back."""
    from safetensors.torch import load_file

    from phalanx.model.build import export_entries
    from phalanx.model.lora import merged_entries
    from phalanx.run.export import write_hf

    entries = merged_entries(model, export_entries(model.get_base_model()))
    write_hf(model.get_base_model(), NoTokenizer(), out, info=INFO, entries=entries, dtype=torch.float32)
    return load_file(str(out / "model.safetensors"))


def peft_merged(model) -> dict[str, torch.Tensor]:
    """The reference: peft's merge_and_unload of a copy (a tie stays a tie through deepcopy)."""
    return copy.deepcopy(model).merge_and_unload().state_dict()


CASES = {  # LoRA on an embedding that a merge can reproduce: untied, with no trainable-token rows
    "gpt2-wpe": (gpt2, ["wpe", "c_attn"], [3, 7, 95]),  # position embedding; token rows on the tied wte
    "llama-embed_tokens": (llama, ["embed_tokens", "q_proj", "down_proj"], []),  # untied head
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_on_an_embedding_merges_as_peft_merge_and_unload(tmp_path, case):
    """Every exported tensor == peft's merge_and_unload of the same adapter weights (the embedding's
    lora_embedding_A/B included, which the merge moved); from_pretrained(export) gives the adapted model's
    logits; the tied head is written once and reads back tied."""
    from transformers import AutoModelForCausalLM

    make, targets, token_ids = CASES[case]
    model = adapted(make(), targets, token_ids)
    assert any("lora_embedding_A" in n for n, _ in model.named_parameters())
    want = peft_merged(model)
    written = export(model, tmp_path)
    emb = next(n for n in written if n.endswith(("wpe.weight", "embed_tokens.weight")))
    frozen = model.get_base_model().get_submodule(emb.removesuffix(".weight")).base_layer.weight
    assert float((want[emb] - frozen).abs().max()) > 1e-2  # the adapter moved the embedding
    assert set(written) <= set(want)
    for name, tensor in written.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-6, msg=name)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
    if case.startswith("gpt2"):
        assert "lm_head.weight" not in written
        assert reloaded.lm_head.weight is reloaded.transformer.wte.weight


@pytest.mark.parametrize("case", ["gpt2-c_attn", *sorted(CASES)])
def test_the_export_leaves_the_model_as_it_trained(tmp_path, case):
    """After the export every parameter (frozen base, adapters, token rows) equals its value before, bitwise:
    the merge goes into the written copy (a whole fp32 weight on the CPU was merged into in place)."""
    make, targets, token_ids = CASES.get(case, (gpt2, ["c_attn", "c_fc"], [3, 7]))
    model = adapted(make(), targets, token_ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    written = export(model, tmp_path)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert not changed, changed
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, logits)
    want = peft_merged(model)
    for name, tensor in written.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-6, msg=name)
    # a second export writes the same (a merge into the live weights would add the adapter twice)
    again = export(model, tmp_path / "again")
    assert all(torch.equal(again[n], written[n]) for n in written)


@pytest.mark.parametrize("make,targets,token_ids,why", [
    (gpt2, ["wte", "c_attn"], [], "input embedding.*tied"),
    (gpt2, ["lm_head"], [3], "output head.*tied"),
    (llama, ["embed_tokens", "q_proj"], [3, 7], "input embedding.*template"),
    (llama, ["lm_head"], [3], "output head.*template"),
])
def test_lora_where_the_merge_cannot_be_what_trained_is_refused(make, targets, token_ids, why):
    """A tied input embedding or head: training adapts the one weight in one place (the lookup, or the head),
    peft's merge changes both (and the head's adapter was not written: the tie is exported once, under the
    embedding's name). A layer whose rows train for the chat template (peft's trainable tokens, which cannot
    share a layer with LoRA: a TypeError from peft). Each: one ConfigError naming the key."""
    from phalanx.model.lora import apply_lora

    with pytest.raises(ConfigError, match=f"model.lora.target_modules.*{why}") as e:
        apply_lora(make(), LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=targets), token_ids)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def small_base(tmp_path_factory) -> Path:
    """A pretrained GPT-2 folder with a tokenizer (BPE of 300 on a slice of Tiny Shakespeare)."""
    return small_gpt2_base(tmp_path_factory.mktemp("small-base"), 20_000, 300, positions=64, width=32)


def test_chat_export_merges_lora_on_the_position_embedding_and_leaves_the_model(tmp_path, small_base):
    """Chat's own export (ChatTask.export through export_final, in process, world size 1, fp32 on the CPU) of
    a model built the trainer's way (LoRA on GPT-2's wpe and c_attn, the template's rows as trainable
    tokens, two grown): RUN/final's weights == peft's merge_and_unload of the base and RUN/final/adapter;
    the adapter holds wpe's lora_embedding_A/B; every parameter as before the export."""
    from types import SimpleNamespace

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.core.config import load_config
    from phalanx.core.runfolder import RunFolder
    from phalanx.model.build import model_builder
    from phalanx.run.export import export_final
    from phalanx.tasks.chat import ChatTask

    cfg = load_config(None, ["task=chat", f"model.pretrained={small_base}", "model.lora.r=4", "model.lora.dropout=0",
                             "model.lora.target_modules=wpe,c_attn", "train.precision=fp32"], check_paths=False)
    task = ChatTask(cfg, INFO)
    task.tokenizer = AutoTokenizer.from_pretrained(small_base)
    task.tokenizer.add_special_tokens({"additional_special_tokens": ["<|a|>", "<|b|>"]})  # grows the vocabulary
    task.data = SimpleNamespace(template_tokens=[3, 7], end_of_turn=[len(task.tokenizer) - 1])
    model = task.build_model(model_builder(cfg.train, INFO.device, 1, None))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # as if trained: peft starts an embedding's A (and a Linear's B) at zero
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    export_final(model, task, RunFolder(tmp_path / "run"), INFO, dtype=torch.float32)
    assert not [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    final = tmp_path / "run" / "final"
    assert any("wpe.lora_embedding_A" in n for n in load_file(str(final / "adapter" / "adapter_model.safetensors")))
    start = AutoModelForCausalLM.from_pretrained(small_base, dtype=torch.float32)
    start.resize_token_embeddings(len(task.tokenizer), mean_resizing=False)
    want = PeftModel.from_pretrained(start, final / "adapter").merge_and_unload().state_dict()
    written = load_file(str(final / "model.safetensors"))
    base_wpe = load_file(str(Path(small_base) / "model.safetensors"))["transformer.wpe.weight"]
    assert float((written["transformer.wpe.weight"] - base_wpe).abs().max()) > 1e-2
    for name, tensor in written.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.slow  # the same path in process: test_chat_export_merges_lora_on_the_position_embedding_...
def test_a_real_run_exports_lora_on_the_position_embedding_merged(tmp_path, talk, base, cache_dir):  # noqa: F811
    """`phalanx train` (chat, LoRA on GPT-2's wpe and c_attn, 3 steps, 1 process): RUN/final's weights ==
    peft's merge_and_unload of the base and RUN/final/adapter; wpe moved."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    phalanx(*chat_args(run, talk, cache_dir, "model.lora.r=4", "model.lora.dropout=0",
                       "model.lora.target_modules=wpe,c_attn", "train.precision=fp32", "train.max_steps=3",
                       "train.global_batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=0",
                       f"model.pretrained={base}"), check=True, timeout=240)
    tok = AutoTokenizer.from_pretrained(run / "final")
    start = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    start.resize_token_embeddings(len(tok), mean_resizing=False)
    adapter = load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))
    assert any("wpe.lora_embedding_A" in n for n in adapter)
    want = PeftModel.from_pretrained(start, run / "final" / "adapter").merge_and_unload().state_dict()
    written = load_file(str(run / "final" / "model.safetensors"))
    base_wpe = load_file(str(Path(base) / "model.safetensors"))["transformer.wpe.weight"]
    assert float((written["transformer.wpe.weight"] - base_wpe).abs().max()) > 1e-4
    for name, tensor in written.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_refused_target_is_exit_2_before_any_worker():
    """The launcher's task check refuses what the worker would (chat: the input embedding always has template
    rows; a head tied to it), with one line naming model.lora.target_modules; other targets pass."""
    from phalanx.core.config import ConfigError, load_config
    from phalanx.tasks.chat import ChatTask

    for targets in ("wte,c_attn", "lm_head"):
        with pytest.raises(ConfigError, match=r"^model.lora.target_modules=.*(tied|template)"):
            ChatTask.check_config(load_config(None, ["task=chat", "model.lora.r=4",
                                                     f"model.lora.target_modules={targets}"]))
    ChatTask.check_config(load_config(None, ["task=chat", "model.lora.r=4", "model.lora.target_modules=c_attn,wpe"]))
