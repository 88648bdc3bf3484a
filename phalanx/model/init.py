"""Random initialisation as a function of (seed, module name) only, whatever the strategy or world size.

The model's own rules are kept: each module is initialised by its Hugging Face model's `_init_weights`
(normal(initializer_range) for linear layers and embeddings, zero biases, norms at one, GPT-2's scaled
residual projections, rotary `inv_freq` recomputed, ...; torch's `reset_parameters` for other modules),
children before parents as transformers does it, each under the CPU generator seeded from
(seed, module name). It runs on a full-size CPU copy of one unit at a time — a transformer block, or a
block-free module outside the blocks (embeddings, final norm, head) — and each rank keeps only the rows it
holds (slices.write_local). So world size 1, DDP and FSDP2 at any world size start from the same weights,
and no rank ever materialises more than its shards plus one unit.
"""
from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn

from phalanx.model.slices import write_local


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one module, from the run's seed and the module's qualified name."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def units(template: nn.Module, block_names: set[str]) -> list[tuple[str, bool]]:
    """(module name, whole subtree) in post-order: every block and every block-free subtree is one unit;
    the modules above the blocks (the root, the block list) count with their own tensors only."""
    above = {".".join(b.split(".")[:i]) for b in block_names for i in range(len(b.split(".")))}
    out: list[tuple[str, bool]] = []

    def visit(name: str, module: nn.Module) -> None:
        if name in above and name not in block_names:
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
            out.append((name, False))
        else:
            out.append((name, True))

    visit("", template)
    return out


def init_rules(template: nn.Module) -> dict[str, object]:
    """Module name -> the function that initialises it: the `_init_weights` of the nearest enclosing
    Hugging Face model (a composite model's parts keep their own), else None (torch's reset_parameters)."""
    from transformers import PreTrainedModel  # lazy: the launcher imports the tasks, not transformers

    rules: dict[str, object] = {}
    for name, module in template.named_modules():
        if isinstance(module, PreTrainedModel):
            rules[name] = module._init_weights
        else:
            rules[name] = rules.get(name.rpartition(".")[0]) if name else None
    return rules


def init_by_name(template: nn.Module, block_names: set[str], seed: int, todo: dict[str, torch.Tensor]) -> None:
    """Initialise the tensors named in `todo` (qualified name in `template` -> the model's tensor, parameters
    and buffers; the others, loaded from a checkpoint, are left alone). `template` is the model on the meta
    device, unsharded; `block_names` its transformer blocks."""
    rules = init_rules(template)
    for name, whole in units(template, block_names):
        module = template.get_submodule(name)
        tensors = _tensor_names(module, name, whole)
        wanted = [n for n in tensors if n in todo]
        if not wanted:
            continue
        clone = copy.deepcopy(module).to_empty(device="cpu", recurse=whole)
        values = dict(_tensor_items(clone, name, whole))
        for n, t in values.items():
            if n not in wanted:  # loaded (or a tied copy owned elsewhere): transformers' init skips these
                t._is_hf_initialized = True
        _apply_rules(clone, name, whole, rules, seed)
        for n in wanted:
            write_local(todo[n], values[n])


@torch.no_grad()
def _apply_rules(clone: nn.Module, name: str, whole: bool, rules: dict, seed: int) -> None:
    """Children before parents (a parent's rule may override a child's: GPT-2's scaled c_proj)."""
    subs = list(clone.named_modules(prefix=name)) if whole else [(name, clone)]
    for sub_name, sub in reversed(subs):  # named_modules is pre-order: reversed, children come first
        rule = rules.get(sub_name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(seed, sub_name))
            if rule is not None:
                rule(sub)
            elif hasattr(sub, "reset_parameters"):
                sub.reset_parameters()


def _tensor_names(module: nn.Module, prefix: str, whole: bool) -> list[str]:
    return [n for n, _ in _tensor_items(module, prefix, whole)]


def _tensor_items(module: nn.Module, prefix: str, whole: bool):
    """(qualified name, tensor) of the unit's parameters and buffers, each shared tensor once."""
    seen: set[int] = set()
    for n, t in [*module.named_parameters(prefix=prefix, recurse=whole),
                 *module.named_buffers(prefix=prefix, recurse=whole)]:
        if id(t) not in seen:
            seen.add(id(t))
            yield n, t
