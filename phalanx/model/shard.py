"""Building a model so that no rank ever holds more than its share: on the meta device, sharded, then
materialised and filled.

`Builder.build(define, pretrained)`: the architecture is defined on the meta device (no storage); under
FSDP2 each transformer block and then the root are sharded (`fully_shard`); only then is storage
allocated (`to_empty`), for this rank's shards alone; then the tensors are filled, from the pretrained
checkpoint's slices this rank owns (load.py) and, for everything the checkpoint does not have (all of it
when training from scratch, buffers such as rotary `inv_freq` that no checkpoint stores, and what a
pretrained build adds: a new head, `Builder.report`), by the named initialisation (init.py). Without
sharding (world size 1, DDP) the same steps give the full model, with the same values, and still without
a second full copy. Adapters (LoRA, model/lora.py) go into the skeleton right after it is defined, before
checkpointing and sharding; the frozen base may then be stored in 16 bit (`frozen_dtype`); loading and
named init see the base model's names (peft's mapped back), and the adapters are initialised by name last.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from phalanx.model import precision
from phalanx.model.init import init_by_name
from phalanx.model.load import LoadReport, load_pretrained
from phalanx.model.weights import pretrained_folder


class Adapters(Protocol):
    """What a Builder needs of adapters (model/lora.LoraAdapters)."""
    def inject(self, model: nn.Module) -> nn.Module: ...
    def is_adapter(self, name: str) -> bool: ...
    def base_name(self, name: str) -> str: ...
    def init(self, model: nn.Module, skeleton: nn.Module, seed: int, todo: dict[str, torch.Tensor]) -> None: ...


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face transformer's decoder (the natural FSDP unit): the first layer
    list of `get_decoder()` (a model with a vision tower registers that tower's layers first), or of the
    model itself when it has no decoder to name (encoders)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    for root in ([decoder] if isinstance(decoder, nn.Module) else []) + [model]:
        for module in root.modules():
            if isinstance(module, nn.ModuleList) and len(module) > 0:
                return list(module)
    return []


@dataclass
class Builder:
    """Where and how a model is built: the device of its tensors, the init seed, an optional sharding step
    (FSDP2; None = whole tensors) and an optional change to the skeleton before it (activation
    checkpointing)."""
    seed: int
    device: torch.device = torch.device("cpu")
    shard: Callable[[nn.Module], None] | None = None
    prepare: Callable[[nn.Module], None] | None = None
    buffer_device: torch.device | None = None  # CPU offload: parameters stay on the CPU, buffers go here
    frozen_dtype: torch.dtype | None = None  # with adapters: the frozen base stored in this dtype (None: fp32)
    # the last pretrained build's: what the run added to the checkpoint (a new head, grown embedding rows)
    report: LoadReport = field(default_factory=LoadReport, init=False)

    def build(self, define: Callable[[], nn.Module], pretrained: str = "", mismatched: str = "error",
              adapters: Adapters | None = None) -> nn.Module:
        """`define()` makes the architecture (it runs on the meta device); `pretrained` = model.pretrained
        (empty: random init); `mismatched="init"`: a checkpoint tensor of another shape is initialised instead
        of an error (a classifier head with another number of labels); `adapters` (LoRA): injected into the
        skeleton before checkpointing and sharding, initialised by name after the base is loaded. A pretrained
        build that would leave a base parameter unloaded is a ConfigError (load.WeightPlan); what it adds is
        in `self.report`."""
        with torch.device("meta"):
            model = define()
        template = copy.deepcopy(model)  # unsharded and storage-free: the shapes init and loading read
        if adapters:
            model = adapters.inject(model)
            _store_frozen(model, self.frozen_dtype)
        skeleton = copy.deepcopy(model) if adapters else template  # the model's own names, unsharded
        if self.prepare:
            self.prepare(model)
        if self.shard:
            self.shard(model)
        model.to_empty(device=self.device)
        retie(model, skeleton)
        todo = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        base = _base_tensors(todo, template, adapters)  # base model name -> this rank's tensor
        if pretrained:
            loaded, self.report = load_pretrained(base, template, pretrained_folder(pretrained), seed=self.seed,
                                                  growable=_embedding_names(template), mismatched=mismatched)
            base = {k: v for k, v in base.items() if k not in loaded}
        blocks = {id(b) for b in transformer_blocks(template)}
        init_by_name(template, {n for n, m in template.named_modules() if id(m) in blocks}, self.seed, base)
        if adapters:
            adapters.init(model, skeleton, self.seed, {n: t for n, t in todo.items() if adapters.is_adapter(n)})
        if self.buffer_device is not None:
            _move_buffers(model, self.buffer_device)
        return model


def _base_tensors(todo: dict[str, torch.Tensor], template: nn.Module, adapters: Adapters | None) -> dict:
    """The model's tensors that are the base model's, by the base model's names (peft's names mapped back);
    every other tensor must be an adapter's."""
    if not adapters:
        return todo
    known = {*dict(template.named_parameters()), *dict(template.named_buffers())}
    base = {adapters.base_name(n): t for n, t in todo.items() if not adapters.is_adapter(n)}
    strays = sorted(set(base) - known)
    if strays:  # a wrapper phalanx does not know the names of: loading would silently miss these
        raise ValueError(f"adapted model tensors with no base-model name: {strays[:5]}")
    return base


def _store_frozen(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Frozen floating-point parameters in `dtype` (a 16-bit base under LoRA), on the meta device: the
    shards are then allocated in it. Adapters (trainable) stay fp32."""
    if dtype is None:
        return
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)


def _embedding_names(template: nn.Module) -> set[str]:
    """Names of the input and output token embeddings (the tensors a grown vocabulary may resize)."""
    wanted = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(template, get, lambda: None)()
        if module is not None:
            wanted.add(id(module.weight))
    return {n for n, p in template.named_parameters(remove_duplicate=False) if id(p) in wanted}


def retie(model: nn.Module, template: nn.Module) -> None:
    """Point every name of a tensor shared in the definition (tied input and output embeddings) at one
    tensor again: to_empty gives each module its own new parameter (FSDP2 keeps shared ones shared)."""
    first: dict[int, str] = {}
    for name, param in template.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name and model.get_parameter(owner) is not model.get_parameter(name):
            module, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module), leaf, model.get_parameter(owner))


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))


def fsdp_shard(model: nn.Module, *, device: torch.device, world_size: int, param_dtype: torch.dtype | None,
               cpu_offload: bool) -> None:
    """FSDP2 on `model`: each transformer block, then the root (embeddings, final norm, head), so each
    block's all-gather overlaps the previous block's compute. With a 16-bit param_dtype, parameters are
    gathered in 16 bit and gradients reduced in fp32 into fp32 shards (precision.fsdp_policy);
    cpu_offload keeps the shards, their gradients and the optimizer state on the host."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # An explicit mesh on the worker's device: the default is CUDA whenever CUDA exists, which is wrong
    # for a Gloo/CPU run on a GPU machine.
    mesh = init_device_mesh(device.type, (world_size,))
    kw = dict(mesh=mesh, mp_policy=precision.fsdp_policy(param_dtype),
              offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    for block in transformer_blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
