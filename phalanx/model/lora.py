"""Low-rank adapters (LoRA) through peft, and the pieces a fine-tuned model needs around them.

Only the adapters (and the embedding rows of the chat template's tokens, as peft's trainable tokens)
require gradients, so DDP reduces only them and AdamW keeps state only for them; checkpoints then
hold just what trains (run/stateful.ModelState with trainable_only). The export merges the adapters into
the base for RUN/final and saves the adapter itself to RUN/final/adapter.
"""
from __future__ import annotations

import warnings

from torch import nn

from phalanx.core.config import LoraSettings


def apply_lora(model: nn.Module, lora: LoraSettings, token_ids: list[int]) -> nn.Module:
    """`model` wrapped by peft with LoRA on `lora.target_modules` (all linear layers but the head when
    empty); the embedding rows of `token_ids` (the chat template's tokens: added to the vocabulary, or in
    it but never trained, such as a base model's end-of-turn token) train as peft's trainable tokens."""
    from peft import LoraConfig, get_peft_model  # lazy: only runs with model.lora.r > 0 import peft

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules) or "all-linear",
                        trainable_token_indices=_token_rows(model, token_ids) or None, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # GPT-2's Conv1D: peft sets fan_in_fan_out itself and says so
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, config)


def _token_rows(model: nn.Module, token_ids: list[int]) -> dict[str, list[int]]:
    """peft's trainable_token_indices: the rows in the input embedding, and in the output embedding too
    when it is not tied to the input one (peft follows a tie itself): its row is what predicts the token."""
    if not token_ids:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    rows = sorted(set(token_ids))
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    indices = {names[id(inp)]: rows}
    if out is not None and out.weight is not inp.weight:
        indices[names[id(out)]] = rows
    return indices


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "merge_and_unload") and hasattr(model, "peft_config")


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
