"""Build Hugging Face models from the config (random init) or a pretrained folder, and wrap them.

transformers is imported inside the builders: it costs ~2 s, and the launcher (which imports the tasks)
never builds a model.
"""
from __future__ import annotations

import torch
from torch import nn

from phalanx.core.config import ModelConfig, hub_name

# Master weights are fp32 whatever dtype a checkpoint was saved in (transformers 5 loads with
# dtype="auto", so a bf16/fp16 hub model would otherwise train 16-bit weights with 16-bit AdamW state,
# and fp16 GradScaler refuses to unscale fp16 gradients); train.precision decides the compute dtype.
MASTER_DTYPE = torch.float32


def quiet_transformers() -> None:
    """transformers' warnings and progress bars would interleave with phalanx's own output."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_causal_lm(folder):
    """A finished run's RUN/final language model (eval mode) and tokenizer, with plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def load_classifier(folder):
    """A finished run's RUN/final classifier (eval mode) and tokenizer, with plain transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    quiet_transformers()
    return AutoModelForSequenceClassification.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def build_causal_lm(m: ModelConfig, vocab_size: int, eos_id: int) -> nn.Module:
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    if m.pretrained:
        return AutoModelForCausalLM.from_pretrained(hub_name(m.pretrained), dtype=MASTER_DTYPE)
    if m.arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab_size, n_positions=m.block_size, n_embd=m.n_embd, n_layer=m.n_layer,
                         n_head=m.n_head, resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout,
                         bos_token_id=eos_id, eos_token_id=eos_id)
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=m.n_embd, intermediate_size=4 * m.n_embd,
                      num_hidden_layers=m.n_layer, num_attention_heads=m.n_head, num_key_value_heads=m.n_head,
                      max_position_embeddings=m.block_size, attention_dropout=m.dropout,
                      bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def build_classifier(m: ModelConfig, vocab_size: int, pad_id: int, max_length: int,
                     id2label: dict[int, str]) -> nn.Module:
    from transformers import (
        AutoModelForSequenceClassification,
        BertConfig,
        BertForSequenceClassification,
        DistilBertConfig,
        DistilBertForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    label2id = {v: k for k, v in id2label.items()}
    if m.pretrained:
        return AutoModelForSequenceClassification.from_pretrained(
            hub_name(m.pretrained), num_labels=len(id2label), id2label=id2label, label2id=label2id,
            ignore_mismatched_sizes=True, dtype=MASTER_DTYPE)
    common = dict(vocab_size=vocab_size, pad_token_id=pad_id, num_labels=len(id2label), id2label=id2label,
                  label2id=label2id)
    if m.arch == "distilbert":
        cfg = DistilBertConfig(dim=m.n_embd, n_layers=m.n_layer, n_heads=m.n_head, hidden_dim=4 * m.n_embd,
                               max_position_embeddings=max_length, dropout=m.dropout,
                               attention_dropout=m.dropout, seq_classif_dropout=m.dropout, **common)
        return DistilBertForSequenceClassification(cfg)
    kw = dict(hidden_size=m.n_embd, num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
              intermediate_size=4 * m.n_embd, hidden_dropout_prob=m.dropout,
              attention_probs_dropout_prob=m.dropout, **common)
    if m.arch == "roberta":
        return RobertaForSequenceClassification(RobertaConfig(max_position_embeddings=max_length + 2, **kw))
    return BertForSequenceClassification(BertConfig(max_position_embeddings=max_length, **kw))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def wrap(model: nn.Module, strategy: str, info) -> nn.Module:
    """DDP (or FSDP2) around `model`; at world size 1 no wrapper (it would cost ~5% for nothing)."""
    if info.world_size == 1:
        return model
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard

        # An explicit mesh on the worker's device: the default is CUDA whenever CUDA exists, which is
        # wrong for a Gloo/CPU run on a GPU machine. Blocks first, then the root (embeddings, head):
        # each block's all-gather overlaps the previous block's compute.
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face transformer (the natural FSDP unit)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return list(module)
    return []


def tie_shared(state: dict, model: nn.Module) -> dict:
    """Point the entries of a parameter shared by several modules (tied embeddings) at one tensor.

    A full state dict gathered from FSDP2 shards holds a separate copy per name, so save_pretrained
    would not recognise the tie and would write the weight twice."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name and owner in state and name in state:
            state[name] = state[owner]
    return state


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)
