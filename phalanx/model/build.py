"""Hugging Face models from the config (random init) or a pretrained folder: their architecture (built on
the meta device by shard.Builder, which fills in the weights), ready-made models for callers outside the
trainer, and the DDP wrapper.

transformers is imported inside the builders: it costs ~2 s, and the launcher (which imports the tasks)
never builds a model.
"""
from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from phalanx.core.config import ConfigError, hub_name
from phalanx.core.sections import ModelConfig, TrainConfig
from phalanx.model import precision
from phalanx.model.checkpointing import apply_activation_checkpointing
from phalanx.model.shard import Builder, fsdp_shard

# Master weights are fp32 whatever dtype a checkpoint was saved in: the architecture is defined in fp32 and
# load.py upcasts 16-bit checkpoints as it copies them (a bf16/fp16 hub model would otherwise train 16-bit
# weights with 16-bit AdamW state, and fp16 GradScaler refuses to unscale fp16 gradients); train.precision
# decides the compute dtype.
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


def load_token_classifier(folder):
    """A finished run's RUN/final token classifier (eval mode) and tokenizer, with plain transformers."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    quiet_transformers()
    return AutoModelForTokenClassification.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def load_classifier(folder):
    """A finished run's RUN/final classifier (eval mode) and tokenizer, with plain transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    quiet_transformers()
    return AutoModelForSequenceClassification.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


# ---- attention implementation -------------------------------------------------------------------
def check_attention(m: ModelConfig, device_type: str) -> None:
    """model.attn_implementation against what this machine has (the launcher, before any worker starts);
    whether the architecture has that kernel is transformers' to say when the model is built."""
    impl, key = m.attn_implementation, "config key 'model.attn_implementation'"
    if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(f"{key}: flash_attention_2 needs the flash-attn package, which is not installed "
                          f"(pip install flash-attn on a CUDA machine), or use sdpa")
    if impl in ("flash_attention_2", "flex_attention") and device_type != "cuda":
        why = "a CUDA GPU" if impl == "flash_attention_2" else \
            "a GPU (torch's FlexAttention has no backward pass on the CPU)"
        raise ConfigError(f"{key}: {impl} needs {why}; use sdpa or eager on the CPU")


def _attention(m: ModelConfig) -> dict:
    """The config/from_config keyword for model.attn_implementation; auto = the architecture's own default."""
    return {} if m.attn_implementation == "auto" else {"attn_implementation": m.attn_implementation}


@contextmanager
def _attention_refused(m: ModelConfig):
    """transformers refusing the chosen kernel (an architecture without it, a missing package) as a config error."""
    try:
        yield
    except (ValueError, ImportError) as e:
        if m.attn_implementation == "auto" or "attention" not in str(e).lower():
            raise
        reason = str(e).split(". ")[0].rstrip(".")
        raise ConfigError(f"config key 'model.attn_implementation': {m.attn_implementation} is not available: "
                          f"{reason}; use auto (the architecture's default) or another one") from None


def attention_in_use(model: nn.Module) -> str:
    """The attention implementation a built transformers model runs, through a DDP or compile wrapper
    ('' for another module)."""
    config = getattr(getattr(model, "module", model), "config", None)
    return getattr(config, "_attn_implementation", None) or ""


# ---- architectures ------------------------------------------------------------------------------
def causal_lm(m: ModelConfig, vocab_size: int, eos_id: int) -> nn.Module:
    """The causal LM's architecture: from the fields of `m`, or the pretrained model's config (its weights
    are loaded by the Builder), with model.attn_implementation. Built on the current default device (meta
    under a Builder)."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with _attention_refused(m):
        if m.pretrained:
            return _pretrained_skeleton(AutoModelForCausalLM, m.pretrained, _attention(m))
        if m.arch == "gpt2":
            cfg = GPT2Config(vocab_size=vocab_size, n_positions=m.block_size, n_embd=m.n_embd, n_layer=m.n_layer,
                             n_head=m.n_head, resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout,
                             bos_token_id=eos_id, eos_token_id=eos_id, **_attention(m))
            return GPT2LMHeadModel(cfg)
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=m.n_embd, intermediate_size=4 * m.n_embd,
                          num_hidden_layers=m.n_layer, num_attention_heads=m.n_head, num_key_value_heads=m.n_head,
                          max_position_embeddings=m.block_size, attention_dropout=m.dropout,
                          bos_token_id=eos_id, eos_token_id=eos_id, tie_word_embeddings=True, **_attention(m))
        return LlamaForCausalLM(cfg)


def classifier(m: ModelConfig, vocab_size: int, pad_id: int, max_length: int, id2label: dict[int, str],
               head: str = "SequenceClassification") -> nn.Module:
    """The classifier's architecture (see causal_lm); a pretrained one gets a new head for these labels. `head`:
    one label per sequence (SequenceClassification) or per token (TokenClassification)."""
    import transformers
    from transformers import BertConfig, DistilBertConfig, RobertaConfig

    label2id = {v: k for k, v in id2label.items()}
    AutoModel = getattr(transformers, f"AutoModelFor{head}")
    BertModel, DistilBertModel, RobertaModel = (getattr(transformers, f"{arch}For{head}")
                                                for arch in ("Bert", "DistilBert", "Roberta"))
    with _attention_refused(m):
        if m.pretrained:
            return _pretrained_skeleton(AutoModel, m.pretrained, _attention(m),
                                        num_labels=len(id2label), id2label=id2label, label2id=label2id)
        common = dict(vocab_size=vocab_size, pad_token_id=pad_id, num_labels=len(id2label), id2label=id2label,
                      label2id=label2id, **_attention(m))
        if m.arch == "distilbert":
            cfg = DistilBertConfig(dim=m.n_embd, n_layers=m.n_layer, n_heads=m.n_head, hidden_dim=4 * m.n_embd,
                                   max_position_embeddings=max_length, dropout=m.dropout,
                                   attention_dropout=m.dropout, seq_classif_dropout=m.dropout, **common)
            return DistilBertModel(cfg)
        kw = dict(hidden_size=m.n_embd, num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
                  intermediate_size=4 * m.n_embd, hidden_dropout_prob=m.dropout,
                  attention_probs_dropout_prob=m.dropout, **common)
        if m.arch == "roberta":
            # RoBERTa numbers positions from padding_idx + 1: a tokenizer whose pad id is not 0 or 1 (a byte-level
            # BPE with <pad> added last) needs that many more rows
            return RobertaModel(RobertaConfig(max_position_embeddings=max_length + max(pad_id, 1) + 1, **kw))
        return BertModel(BertConfig(max_position_embeddings=max_length, **kw))


def _pretrained_skeleton(auto_class, spec: str, attention: dict, **config_changes) -> nn.Module:
    """A pretrained model's architecture from its config (and its generation config), in fp32."""
    from transformers import AutoConfig, GenerationConfig

    name = hub_name(spec)
    model = auto_class.from_config(AutoConfig.from_pretrained(name, **config_changes), dtype=MASTER_DTYPE,
                                   **attention)
    try:
        model.generation_config = GenerationConfig.from_pretrained(name)
    except OSError:  # none saved: the default derived from the config stays
        pass
    return model


def build_causal_lm(m: ModelConfig, vocab_size: int, eos_id: int, seed: int | None = None) -> nn.Module:
    """A causal LM with its weights, whole, on the CPU: random init by name from `seed` (None: drawn from
    torch's global generator), or model.pretrained loaded."""
    return Builder(seed=_seed(seed)).build(lambda: causal_lm(m, vocab_size, eos_id), m.pretrained)


def build_classifier(m: ModelConfig, vocab_size: int, pad_id: int, max_length: int,
                     id2label: dict[int, str], seed: int | None = None) -> nn.Module:
    """A classifier with its weights (see build_causal_lm); a pretrained model's head for another number of
    labels is initialised anew."""
    return Builder(seed=_seed(seed)).build(lambda: classifier(m, vocab_size, pad_id, max_length, id2label),
                                           m.pretrained, mismatched="init")


def _seed(seed: int | None) -> int:
    return int(torch.randint(0, 2**62, ())) if seed is None else seed


def model_builder(t: TrainConfig, device: torch.device, world_size: int, amp_dtype: torch.dtype | None,
                  frozen_dtype: torch.dtype | None = None) -> Builder:
    """How a training worker builds its model: under FSDP2 (more than one process) on the meta device,
    sharded, then only this rank's shards materialised and filled; otherwise whole, on the worker's
    device. Either way initialised by (seed, name), so every strategy and world size starts from the same
    weights; the chosen blocks are activation-checkpointed. `frozen_dtype`: a LoRA run's frozen base is
    stored in it (precision.base_dtype). Under FSDP2 a unit then holds two dtypes (16-bit base, fp32
    adapters), so without a 16-bit compute dtype the gathers are cast to fp32 (FSDP2 needs one dtype)."""
    precision.check_offload(t.cpu_offload, device.type)
    sharded = t.strategy == "fsdp" and world_size > 1
    gather_dtype = amp_dtype or (torch.float32 if frozen_dtype is not None else None)
    shard = partial(fsdp_shard, device=device, world_size=world_size, param_dtype=gather_dtype,
                    cpu_offload=t.cpu_offload) if sharded else None
    offload = sharded and t.cpu_offload  # the shards live on the host; buffers go to the GPU
    return Builder(seed=t.seed, device=torch.device("cpu") if offload else device, shard=shard,
                   prepare=partial(apply_activation_checkpointing, mode=t.activation_checkpointing,
                                   every=t.activation_checkpointing_every),
                   buffer_device=device if offload else None, frozen_dtype=frozen_dtype)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def wrap(model: nn.Module, strategy: str, info) -> nn.Module:
    """DDP around `model`; at world size 1 no wrapper (it would cost ~5% for nothing). Under FSDP2 the model
    was sharded as it was built (shard.fsdp_shard), so there is nothing to wrap."""
    if info.world_size == 1 or strategy == "fsdp":
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)


def export_entries(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what an export holds, in state-dict order: parameters and persistent buffers, a
    tied tensor once under its first name (as save_pretrained writes it). Tensors may be FSDP2 shards."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # each shared tensor once
    return [(name, tensors[name]) for name in model.state_dict() if name in tensors]


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

