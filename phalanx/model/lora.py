"""Low-rank adapters (LoRA) through peft, injected into the model's skeleton before it is sharded.

`LoraAdapters` is what the Builder (shard.py) is handed: peft's LoRA layers (and, for the chat template's
tokens, peft's trainable tokens) go into the architecture on the meta device, before activation
checkpointing and FSDP2, so an FSDP2 unit (one block) holds the block's frozen base and its adapters, and
each rank materialises only its rows of both. The names stay peft's (`base_model.model.…`, `.base_layer.`,
`.lora_A.default.weight`), so the adapter saved to RUN/final/adapter is what `PeftModel.from_pretrained`
loads; the loader maps them back to the base model's names (`base_name`) to find each checkpoint tensor.

Adapters are initialised as a function of (seed, layer name) with peft's own rule (`reset_lora_parameters`:
A Kaiming-uniform, B zeros), run on a CPU copy of each layer's A and B, of which every rank keeps its
rows: the same config gives the same adapters at any world size and strategy. Trainable-token rows start
as the loaded (or grown) embedding rows, as peft starts them, gathered from the ranks that hold them.

Only the adapters and trainable-token rows require gradients, so DDP reduces only them, FSDP2 reduces
only their gradients and AdamW keeps state only for them; checkpoints hold just what trains
(run/stateful.ModelState with trainable_only).
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as tdist
from torch import nn

from phalanx.core.errors import ConfigError
from phalanx.core.sections import LoraSettings
from phalanx.model.init import name_seed
from phalanx.model.slices import local, rows, write_local

PREFIX = "base_model.model."  # peft's prefix of the wrapped model's names
ADAPTER_MARKS = (".lora_", "trainable_tokens_")  # peft's adapter tensors (LoRA A/B, trainable-token rows)


def apply_lora(model: nn.Module, lora: LoraSettings, token_ids: list[int]) -> nn.Module:
    """`model` wrapped by peft with LoRA on `lora.target_modules` (all linear layers but the head when
    empty); the embedding rows of `token_ids` (the chat template's tokens: added to the vocabulary, or in
    it but never trained, such as a base model's end-of-turn token) train as peft's trainable tokens.
    On the meta device nothing is allocated (the Builder initialises the adapters by name). ConfigError for
    a target whose merged export could not be what trains (check_targets)."""
    from peft import get_peft_model  # lazy: only runs with model.lora.r > 0 import peft

    check_targets(model, lora, token_ids)
    with warnings.catch_warnings():  # GPT-2's Conv1D: peft sets fan_in_fan_out itself and says so
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, _config(model, lora, token_ids))


def _config(model: nn.Module, lora: LoraSettings, token_ids: list[int]):
    from peft import LoraConfig

    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules) or "all-linear",
                      trainable_token_indices=_token_rows(model, token_ids) or None, task_type="CAUSAL_LM")


def check_targets(model: nn.Module, lora: LoraSettings, token_ids: list[int] = ()) -> None:
    """ConfigError naming model.lora.target_modules when they adapt a layer whose merged export (RUN/final)
    could not be what trains: the input embedding or the output head when the two share one weight (LoRA
    adapts that weight in one place only; merged into it, as peft's merge_and_unload merges, both would
    change — and the head's adapter is not even written, the tie being exported once under the embedding's
    name), or a layer whose rows train for the chat template (`token_ids`: peft's trainable tokens cannot
    share a layer with LoRA, peft raises a TypeError). Any other embedding (GPT-2's wpe, an untied input
    embedding) merges (merged_entries). `model`: the base model, on the meta device or not."""
    from peft.tuners.tuners_utils import check_target_module_exists

    if not lora.target_modules:
        return  # all-linear (the default) adapts neither the embedding nor the head
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = out is not None and out.weight is inp.weight
    names, rows_train = {id(m): n for n, m in model.named_modules()}, _token_rows(model, token_ids)
    config = _config(model, lora, [])
    for layer, role, other in ((inp, "input embedding", "output head"), (out, "output head", "input embedding")):
        name = names.get(id(layer)) if layer is not None else None
        if name is None or not check_target_module_exists(config, name):
            continue
        if tied:
            why = (f"shares its weight with the {other} (tied): LoRA adapts it in one place only, a merged RUN/final "
                   f"would change both; leave it out")
        elif name in rows_train:
            why = ("has rows that train for the chat template's tokens (peft's trainable tokens, which cannot share "
                   "a layer with LoRA); leave it out (those rows train anyway)")
        else:
            continue
        raise ConfigError(f"model.lora.target_modules={','.join(lora.target_modules)}: the {role} '{name}' {why}")


def _token_rows(model: nn.Module, token_ids: list[int]) -> dict[str, list[int]]:
    """peft's trainable_token_indices: the rows in the input embedding, and in the output embedding too
    when it is not tied to the input one (peft follows a tie itself): its row is what predicts the token."""
    if not token_ids:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    wanted = sorted(set(token_ids))
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    indices = {names[id(inp)]: wanted}
    if out is not None and out.weight is not inp.weight:
        indices[names[id(out)]] = wanted
    return indices


def is_adapter(name: str) -> bool:
    """Is the model tensor `name` (peft's name) an adapter's, not the base model's?"""
    return any(mark in name for mark in ADAPTER_MARKS)


def base_name(name: str) -> str:
    """peft's name of a base-model tensor -> the base model's own name (what the checkpoint is keyed by
    after transformers' renaming): `base_model.model.transformer.h.0.attn.c_attn.base_layer.weight` ->
    `transformer.h.0.attn.c_attn.weight`; trainable tokens wrap an embedding in `.token_adapter.base_layer`."""
    name = name.removeprefix(PREFIX)
    return name.replace(".base_layer.", ".").replace(".token_adapter.", ".")


class LoraAdapters:
    """LoRA for a Builder: `inject` on the meta skeleton, `base_name`/`is_adapter` for the loader, `init`
    after the base is loaded. `token_ids()` is called at injection (the chat task knows its template's
    tokens once the architecture is defined)."""

    def __init__(self, settings: LoraSettings, token_ids):
        self.settings, self.token_ids = settings, token_ids

    def inject(self, model: nn.Module) -> nn.Module:
        return apply_lora(model, self.settings, self.token_ids())

    is_adapter = staticmethod(is_adapter)
    base_name = staticmethod(base_name)

    @torch.no_grad()
    def init(self, model: nn.Module, skeleton: nn.Module, seed: int, todo: dict[str, torch.Tensor]) -> None:
        """Fill the adapter tensors of `todo` (model name -> this rank's tensor): LoRA's A and B by peft's
        rule under a generator seeded from (seed, layer name), on a CPU copy of the layer's adapters alone
        (`skeleton`: the adapted model on the meta device, unsharded); trainable-token rows from the loaded
        embedding rows."""
        from peft.tuners.lora import LoraLayer
        from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

        for name, layer in skeleton.named_modules():
            if isinstance(layer, LoraLayer):
                _init_lora_layer(layer, name, seed, todo, model.peft_config)
            elif isinstance(layer, TrainableTokensLayer) and not layer.tied_adapter:
                _init_token_rows(model.get_submodule(name), name, todo)


def _init_lora_layer(layer, name: str, seed: int, todo: dict, configs: dict) -> None:
    clone = copy.deepcopy(layer)  # on the meta device: only its adapters get storage below
    parts = [clone.lora_A, clone.lora_B, clone.lora_embedding_A, clone.lora_embedding_B]
    for part in parts:
        part.to_empty(device="cpu")
    for adapter in clone.lora_A.keys() | clone.lora_embedding_A.keys():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(seed, name))
            clone.reset_lora_parameters(adapter, configs[adapter].init_lora_weights)
    for part, attr in zip(parts, ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")):
        for key, tensor in part.state_dict().items():
            full = f"{name}.{attr}.{key}"
            if full in todo:
                write_local(todo[full], tensor)


def _init_token_rows(layer, name: str, todo: dict) -> None:
    """peft starts each trainable-token row at the embedding's row: each rank contributes the rows it holds
    (zeros elsewhere), summed over the ranks."""
    weight = layer.base_layer.weight
    part = rows(weight) or slice(0, weight.shape[0])
    for adapter, indices in layer.token_indices.items():
        values = torch.zeros((len(indices), weight.shape[1]), dtype=torch.float32, device=local(weight).device)
        for i, row in enumerate(indices):
            if part.start <= row < part.stop:
                values[i] = local(weight)[row - part.start].float()
        if rows(weight) is not None:
            tdist.all_reduce(values)
        for kind in ("trainable_tokens_delta", "trainable_tokens_original"):
            full = f"{name}.{kind}.{adapter}"
            if full in todo:
                write_local(todo[full], values)


# ---- export -------------------------------------------------------------------------------------
@dataclass
class Merged:
    """A base weight of the export with its adapter merged in: `base` (this rank's tensor, maybe a shard),
    `adapters` (tensors every rank gathers whole: LoRA's A and B, both r x dim, or trainable-token rows),
    `merge(base fp32, adapters fp32)` -> the merged weight in fp32, on the rank that writes it. `merge` may
    write into the base it is given: the writer's own copy (run/export.py), never the model's weight."""
    base: torch.Tensor
    adapters: list[torch.Tensor]
    merge: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]


def merged_entries(model: nn.Module, entries: list[tuple[str, torch.Tensor]]) -> list[tuple]:
    """The export entries of `model.get_base_model()` (build.export_entries: peft-injected names) -> (the
    base model's name, its tensor, how to merge it or None), adapters left out. LoRA merges as peft's
    `merge` does (W + scaling x B @ A; transposed for GPT-2's Conv1D and for an embedding, whose A is
    r x rows and B columns x r), trainable tokens replace their rows; all in fp32 (the base may be stored in
    16 bit). Nothing here changes the model: the merge runs on the writer's copy."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    base_model = model.get_base_model()
    out = []
    for name, tensor in entries:
        if is_adapter(name):
            continue
        owner, _, leaf = name.rpartition(".")
        owner = owner.removesuffix(".base_layer")
        layer = base_model.get_submodule(owner) if owner else None
        merged = None
        if leaf == "weight" and (lora := _lora_factors(layer)) is not None:
            a, b, scaling, transpose = lora
            merged = Merged(tensor, [a, b], partial(_merge_lora, scaling=scaling, transpose=transpose))
        elif leaf == "weight" and isinstance(layer, TrainableTokensLayer):
            adapter = next(iter(layer.token_indices))
            merged = Merged(tensor, [layer.trainable_tokens_delta[adapter]],
                            partial(_merge_rows, indices=layer.token_indices[adapter]))
        out.append((base_name(name), tensor, merged))
    return out


def _lora_factors(layer) -> tuple[torch.Tensor, torch.Tensor, float, bool] | None:
    """A LoRA layer's (A, B, scaling, transposed): a Linear's or Conv1D's lora_A/lora_B, an embedding's
    lora_embedding_A/B (peft's delta is (B @ A).T there); None for any other layer."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(layer, LoraLayer):
        return None
    if layer.lora_A:
        adapter = next(iter(layer.lora_A))
        return (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.scaling[adapter],
                layer.fan_in_fan_out)
    if layer.lora_embedding_A:
        adapter = next(iter(layer.lora_embedding_A))
        return layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter], layer.scaling[adapter], True
    return None


def _merge_lora(weight: torch.Tensor, adapters: list[torch.Tensor], scaling: float, transpose: bool) -> torch.Tensor:
    """`weight` (fp32, the writer's own copy) += scaling x B @ A, in place (no delta-sized temporary)."""
    a, b = adapters
    return weight.addmm_(a.T, b.T, alpha=scaling) if transpose else weight.addmm_(b, a, alpha=scaling)


def _merge_rows(weight: torch.Tensor, adapters: list[torch.Tensor], indices: list[int]) -> torch.Tensor:
    """`weight` (fp32, the writer's own copy) with the trainable-token rows in place of its own, in place."""
    return weight.index_copy_(0, torch.tensor(indices), adapters[0])


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every trainable tensor (adapters, trainable-token rows) whole, on the CPU, on rank 0 (the
    other ranks get an empty dict) — all of every rank's rows, for RUN/final/adapter."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                  ignore_frozen_params=True))
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    # a tied parameter (the embedding's trainable-token rows shared with the head's) comes back under one of
    # its names only (FSDP's state dict drops duplicates); peft's adapter file wants it under each
    first = {}
    for n, p in named:
        if n in state:
            first.setdefault(id(p), n)
    return {n: state[n] if n in state else state[first[id(p)]] for n, p in named
            if n in state or id(p) in first}


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "merge_and_unload") and hasattr(model, "peft_config")


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
