"""Building a model so that no rank ever holds more than its share: on the meta device, sharded, then
materialised and filled.

`Builder.build(define, pretrained)`: the architecture is defined on the meta device (no storage); under
FSDP2 each transformer block and then the root are sharded (`fully_shard`); only then is storage
allocated (`to_empty`), for this rank's shards alone; then the tensors are filled, from the pretrained
checkpoint's slices this rank owns (load.py) and, for everything the checkpoint does not have (all of it
when training from scratch, buffers such as rotary `inv_freq` that no checkpoint stores, and what a
pretrained build adds: a new head, `Builder.report`), by the named initialisation (init.py). Without
sharding (world size 1, DDP) the same steps give the full model, with the same values, and still without
a second full copy.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from phalanx.model import precision
from phalanx.model.init import init_by_name
from phalanx.model.load import LoadReport, load_pretrained
from phalanx.model.weights import pretrained_folder


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
    # the last pretrained build's: what the run added to the checkpoint (a new head, grown embedding rows)
    report: LoadReport = field(default_factory=LoadReport, init=False)

    def build(self, define: Callable[[], nn.Module], pretrained: str = "", mismatched: str = "error") -> nn.Module:
        """`define()` makes the architecture (it runs on the meta device); `pretrained` = model.pretrained
        (empty: random init); `mismatched="init"`: a checkpoint tensor of another shape is initialised instead
        of an error (a classifier head with another number of labels). A pretrained build that would leave a
        parameter unloaded is a ConfigError (load.WeightPlan); what it adds is in `self.report`."""
        with torch.device("meta"):
            model = define()
        template = copy.deepcopy(model)  # unsharded and storage-free: the shapes init and loading read
        if self.prepare:
            self.prepare(model)
        if self.shard:
            self.shard(model)
        model.to_empty(device=self.device)
        retie(model, template)
        todo = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        if pretrained:
            loaded, self.report = load_pretrained(todo, template, pretrained_folder(pretrained), seed=self.seed,
                                                  growable=_embedding_names(template), mismatched=mismatched)
            todo = {k: v for k, v in todo.items() if k not in loaded}
        blocks = {id(b) for b in transformer_blocks(template)}
        init_by_name(model, template, {n for n, m in template.named_modules() if id(m) in blocks}, self.seed, todo)
        if self.buffer_device is not None:
            _move_buffers(model, self.buffer_device)
        return model


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
