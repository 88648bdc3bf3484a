"""Pretrained weights into a model built on the meta device: which checkpoint tensor fills which model
tensor, whether that covers the model, and each rank reading only the rows it holds.

Names: a checkpoint key becomes a model name through transformers' own rules for the model's class
(`conversion_mapping.get_model_conversion_mapping`: the renamings of its class and model type, e.g.
Gemma-3's `language_model.model.*`, legacy LayerNorm gamma/beta, then `rename_source_key`, which also adds
or strips the base model's prefix), exactly as `from_pretrained` renames them. A renamed tensor keeps its
layout, so it is read by row ranges; a converted one (fused MoE experts, several checkpoint tensors for one
model tensor) is read whole and converted by transformers' own operations, then each rank keeps its rows.

Coverage (`WeightPlan`, from the headers alone: the launcher checks it before any worker starts): every
parameter must be loaded, except what the run adds, which is initialised by name and said in the start
line: parameters the checkpoint's own class (its config's `architectures`) does not have — a new head, as
transformers' `from_pretrained` reports it newly initialised (DistilBERT's `pre_classifier`, RoBERTa's
`classifier.dense`), those the class lists in `_keys_to_ignore_on_load_missing`, a head re-initialised
for another shape (classify's labels) — and token-embedding rows grown for new tokens. Anything else left
over is exit 2 naming it. Buffers a checkpoint does not store (rotary `inv_freq`) are computed by init.
16-bit checkpoints are upcast into the fp32 master weights as they are copied.
"""
from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from phalanx.core.config import ConfigError
from phalanx.model.init import name_seed
from phalanx.model.slices import local, rows, write_local
from phalanx.model.weights import Checkpoint


@dataclass
class LoadReport:
    """What a pretrained build did not take from the checkpoint as it was saved."""
    new: list[str] = field(default_factory=list)  # parameters the run adds, initialised by name
    grown: dict[str, tuple[int, int]] = field(default_factory=dict)  # embeddings: name -> (rows saved, rows now)

    def clause(self) -> str:
        """For the start line: '' when everything came from the checkpoint."""
        parts = []
        if self.new:
            modules = dict.fromkeys(n.rpartition(".")[0] or n for n in self.new)
            parts.append(f"new: {', '.join(_collapse(modules))} (not in the checkpoint)")
        if self.grown:
            parts.append("grown: " + ", ".join(f"{n.rpartition('.')[0]} {a} -> {b} rows"
                                               for n, (a, b) in self.grown.items()))
        return "; ".join(parts)


class WeightPlan:
    """Which checkpoint tensors fill which tensors of `template` (the model on the meta device, unsharded),
    from the checkpoint's headers; raises ConfigError when a parameter would be left unloaded or a shape
    differs (`mismatched="init"`: a head of another shape is initialised anew instead). `growable`: the
    token embeddings, which may have more rows than saved (grown by mean resizing)."""

    def __init__(self, template: nn.Module, ckpt: Checkpoint, *, growable: set[str] = frozenset(),
                 mismatched: str = "error"):
        self.template, self.ckpt = template, ckpt
        self.canonical = _canonical_names(template)
        self.plain, self.groups = _match_keys(template, ckpt.keys(), self.canonical)
        meta = {**dict(template.named_parameters()), **dict(template.named_buffers())}
        self.report = LoadReport()
        for name in [n for n in meta if n in self.plain]:  # in the model's order
            key = self.plain[name]
            saved, want = ckpt.shape(key), tuple(meta[name].shape)
            if saved == want:
                continue
            if name in growable and saved[1:] == want[1:] and saved[0] < want[0]:
                self.report.grown[name] = (saved[0], want[0])
            elif mismatched == "init":
                del self.plain[name]
                self.report.new.append(name)
            else:
                raise ConfigError(f"config key 'model.pretrained': '{key}' has shape {list(saved)} in "
                                  f"'{ckpt.folder}', the model needs {list(want)}")
        self._check_coverage()

    def targets(self) -> set[str]:
        """The model tensors that converted checkpoint tensors fill."""
        return {self.canonical.get(t, t) for name, (conv, _) in self.groups.items()
                for t in (name.replace(conv.target_patterns[0], p) for p in conv.target_patterns)}

    def _check_coverage(self) -> None:
        covered = set(self.plain) | self.targets()
        missing = [n for n, _ in self.template.named_parameters() if n not in covered and n not in self.report.new]
        own = _checkpoint_class_names(self.template)
        ignored = getattr(self.template, "_keys_to_ignore_on_load_missing", None) or ()
        unloaded = []
        for name in missing:
            if _strip(self.template, name) not in own or any(re.search(p, name) for p in ignored):
                self.report.new.append(name)
            else:
                unloaded.append(name)
        if unloaded:
            raise ConfigError(
                f"config key 'model.pretrained': '{self.ckpt.folder}' does not hold {len(unloaded)} parameters of "
                f"{type(self.template).__name__} (names after transformers' key renaming for it): "
                f"{', '.join(_collapse(unloaded))}; a checkpoint of another architecture, or saved under other names?")

    @torch.no_grad()
    def load(self, todo: dict[str, torch.Tensor], seed: int) -> set[str]:
        """Fill the tensors of `todo` (qualified name -> this rank's tensor) that the plan covers; returns
        their names. Grown embeddings get their new rows by mean resizing (grown_rows)."""
        loaded = set()
        for name, key in self.plain.items():
            t = todo.get(name)
            if t is None:
                continue
            if name in self.report.grown:
                write_local(t, grown_rows(self.ckpt.read(key).float(), t.shape[0], name_seed(seed, name)))
            else:
                local(t).copy_(self.ckpt.read(key, rows(t)).reshape(local(t).shape))
            loaded.add(name)
        for first, (converter, sources) in self.groups.items():
            for target, value in self._convert(first, converter, sources).items():
                name = self.canonical.get(target, target)
                if name not in todo:
                    continue
                if tuple(value.shape) != tuple(todo[name].shape):
                    raise ConfigError(f"config key 'model.pretrained': '{name}' converted from '{sources[0][0]}' in "
                                      f"'{self.ckpt.folder}' has shape {list(value.shape)}, the model needs "
                                      f"{list(todo[name].shape)}")
                write_local(todo[name], value)
                loaded.add(name)
        return loaded

    def _convert(self, first: str, converter, sources: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
        """transformers' conversion of whole checkpoint tensors (e.g. experts stacked into one tensor)."""
        conv = copy.deepcopy(converter)
        for key, pattern in sources:
            conv.add_tensor(first, key, pattern, lambda key=key: self.ckpt.read(key))
        out = conv.convert(first, model=self.template, config=self.template.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def load_pretrained(todo: dict[str, torch.Tensor], template: nn.Module, folder: Path, *, seed: int,
                    growable: set[str], mismatched: str) -> tuple[set[str], LoadReport]:
    """Fill `todo` from the checkpoint in `folder` (see WeightPlan): the names filled, and the report."""
    plan = WeightPlan(template, Checkpoint(folder), growable=growable, mismatched=mismatched)
    return plan.load(todo, seed), plan.report


def _match_keys(template: nn.Module, keys: list[str], canonical: dict[str, str]):
    """(model name -> checkpoint key for renamed tensors, first target -> (converter, [(key, pattern)]) for
    converted ones), by transformers' renaming of each checkpoint key, as from_pretrained does it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(template)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta, prefix = template.state_dict(), template.base_model_prefix
    plain: dict[str, str] = {}
    groups: dict[str, tuple] = {}
    for key in sorted(keys, key=dot_natural_key):  # converters stack experts in this order
        name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if name not in meta and key in meta:  # a key that should not have been renamed
            name, pattern = rename_source_key(key, [], [], prefix, meta)
        if name not in meta:
            continue  # a tensor this model does not have (from_pretrained: "unexpected")
        if pattern is None:
            plain.setdefault(canonical.get(name, name), key)
        else:
            groups.setdefault(name, (by_pattern[pattern], []))[1].append((key, pattern))
    return plain, groups


def _canonical_names(template: nn.Module) -> dict[str, str]:
    """Every name of a shared tensor (tied embeddings) -> the first one (the one the model lists)."""
    first: dict[int, str] = {}
    out = {}
    for name, t in [*template.named_parameters(remove_duplicate=False),
                    *template.named_buffers(remove_duplicate=False)]:
        out[name] = first.setdefault(id(t), name)
    return out


def _checkpoint_class_names(template: nn.Module) -> set[str]:
    """The parameter names (base prefix stripped) of the class the checkpoint was saved from (its config's
    `architectures`), built on the meta device; the model's own class when that is the same or unknown."""
    import transformers

    arch = (getattr(template.config, "architectures", None) or [type(template).__name__])[0]
    source = template
    cls = getattr(transformers, arch, None) if arch != type(template).__name__ else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        try:
            with torch.device("meta"):
                source = cls(copy.deepcopy(template.config))
        except Exception:  # noqa: BLE001 - a class this config cannot build: the model's own class decides
            source = template
    return {_strip(source, n) for n, _ in source.named_parameters()}


def _strip(model: nn.Module, name: str) -> str:
    prefix = getattr(model, "base_model_prefix", "")
    return name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name


def _collapse(names) -> list[str]:
    """Names with layer numbers as '*' (counted), each once, in order: one line for many layers."""
    names = list(names)
    patterns = [re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names]
    counts, first = Counter(patterns), {}
    for name, pattern in zip(names, patterns):
        first.setdefault(pattern, name)
    return [f"{p} (x{c})" if c > 1 else first[p] for p, c in counts.items()]


def grown_rows(old: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """`old` with rows added up to `n`, drawn as transformers' mean resizing does (from a normal around the
    mean old row with 1e-9 x their covariance, or the mean where that is not positive definite), so new
    tokens start where the old ones are, with a generator of their own."""
    mean = old.mean(0)
    centred = old - mean
    covariance = 1e-9 * (centred.T @ centred) / old.shape[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if torch.distributions.constraints.positive_definite.check(covariance).all():
            new = torch.distributions.MultivariateNormal(mean, covariance_matrix=covariance).sample((n - old.shape[0],))
        else:
            new = mean.expand(n - old.shape[0], -1).clone()
    return torch.cat([old, new])
