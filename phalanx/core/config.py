"""Typed config schema, YAML loading, dotted overrides and validation.

Every field carries its documentation in `metadata["help"]`; `phalanx config --show` prints it.
Errors are `ConfigError`: one line that names the key or file and what was expected.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from phalanx.core.errors import ConfigError  # also re-exported: `from phalanx.core.config import ConfigError`
from phalanx.core.errors import redact
from phalanx.core.faults import parse_fault
from phalanx.core import renames
from phalanx.core.registry import TASK_SECTIONS, TASKS
from phalanx.core.sections import (
    DataConfig,
    DebugConfig,
    DistConfig,
    LogConfig,
    ModelConfig,
    TrainConfig,
    setting,
)
from phalanx.core.task_sections import (
    ChatConfig,
    ClassifyConfig,
    GRPOConfig,
    LMConfig,
    PreferenceConfig,
    TemplateConfig,
    TokenClassifyConfig,
)
from phalanx.core.runfolder import write_text


class _Loader(yaml.SafeLoader):
    """YAML 1.2 scalars: only true/false are booleans ('off' stays a string), and 3e-4 is a float."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)


@dataclass
class Config:
    task: str = setting("lm", "what to train: " + "; ".join(f"{t.name} = {t.help}" for t in TASKS.values()),
                        choices=list(TASKS))
    name: str = setting("", "run name; default = the config file name, or 'default'")
    run_dir: str = setting("", "run folder; default = runs/<name>")
    resume: str = setting("auto", "auto = continue from the run folder's latest checkpoint if there is one; "
                          "never = start from scratch; or a checkpoint folder to start from")
    data: DataConfig = setting(None, "data sources, tokenization, stores and order", factory=DataConfig)
    model: ModelConfig = setting(None, "model architecture or pretrained weights", factory=ModelConfig)
    train: TrainConfig = setting(None, "optimisation, batch, schedule and checkpoints", factory=TrainConfig)
    lm: LMConfig = setting(None, "task lm: its own keys", factory=LMConfig)
    classify: ClassifyConfig = setting(None, "task classify: fields, labels, length", factory=ClassifyConfig)
    chat: ChatConfig = setting(None, "task chat: record formats, fields, targets, truncation", factory=ChatConfig)
    template: TemplateConfig = setting(None, "the chat template (tasks chat and preference)", factory=TemplateConfig)
    preference: PreferenceConfig = setting(None, "task preference: pairs, the loss and the reference",
                                           factory=PreferenceConfig)
    grpo: GRPOConfig = setting(None, "task grpo: prompts, generation, rewards and the loss", factory=GRPOConfig)
    token_classify: TokenClassifyConfig = setting(None, "task token_classify: fields, CoNLL columns, labels, windows",
                                                  factory=TokenClassifyConfig)
    dist: DistConfig = setting(None, "distributed settings", factory=DistConfig)
    log: LogConfig = setting(None, "logging sinks and progress display", factory=LogConfig)
    debug: DebugConfig = setting(None, "test-only hooks", factory=DebugConfig)


# Fields that change the training trajectory: a checkpoint is only resumed if these match.
TRAINING_RELEVANT = ("task", "data.train", "data.validation", "data.val_fraction", "data.tokenizer_sample_mb",
                     "data.format", "data.text_field", "data.packing", "data.order", "data.order_window",
                     "data.tokenizer", "data.vocab_size", "data.group_by_length", "lm", "classify", "chat",
                     "template", "preference", "grpo", "token_classify", "model", "train.global_batch_size", "train.lr",
                     "train.min_lr_ratio", "train.warmup_steps", "train.weight_decay", "train.beta1", "train.beta2",
                     "train.grad_clip", "train.seed")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def shown_dict(cfg) -> dict:
    """to_dict with every URL's secret redacted (errors.redact): what is printed, logged or saved in the run
    folder; the run itself keeps the real values."""
    def hide(value):
        if isinstance(value, str):
            return redact(value)
        if isinstance(value, dict):
            return {k: hide(v) for k, v in value.items()}
        return [hide(v) for v in value] if isinstance(value, list) else value
    return hide(to_dict(cfg))


def has_secret(cfg) -> bool:
    return shown_dict(cfg) != to_dict(cfg)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str):
    """Check `value` against the annotated type; ints are accepted for floats."""
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '3e-4' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is list:
        if isinstance(value, list):
            return [str(v) for v in value]
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
    elif tp is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        if value is None or value == "":
            return {}
    shown = type(value).__name__ if value is not None else "nothing"
    raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {shown} ({value!r})")


def _boolean_for_choices(key: str, value: bool, meta: dict) -> str:
    """A YAML true/false given to a key of named choices: the choices, and which one true (false) would mean."""
    choices = ", ".join(str(c) for c in meta["choices"])
    said = str(value).lower()
    means = dict(zip((True, False), meta.get("boolean") or ()))
    hint = (f"{said} would mean {means[value]}: write {key}={means[value]}" if value in means else
            f"{said} means none of them here; name one")
    return f"config key '{key}': expected one of {choices}, got {said} (a YAML boolean); {hint}"


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': expected a mapping, "
                          f"got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}' (known: {', '.join(sorted(names))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        tp, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, raw[f.name] if raw[f.name] is not None else {}, key + ".")
        elif isinstance(raw[f.name], bool) and "true" in (f.metadata.get("choices") or ()):
            kwargs[f.name] = "true" if raw[f.name] else "false"  # YAML's true/false for an auto|true|false key
        elif isinstance(raw[f.name], bool) and f.metadata.get("choices"):
            raise ConfigError(_boolean_for_choices(key, raw[f.name], f.metadata))
        else:
            kwargs[f.name] = _coerce(raw[f.name], tp, key)
    return cls(**kwargs)


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value, e.g. train.lr=3e-4")
    key, _, value = text.partition("=")
    try:
        parsed = _yaml(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        raw = _yaml(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        reason = str(e).replace("\n", " ")
        raise ConfigError(f"config file '{path}': not valid YAML ({reason})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file '{path}': expected a mapping at the top level")
    return raw


def load_config(path: str | None = None, overrides: list[str] = (), *, check_paths: bool = True,
                say=None) -> Config:
    """Load YAML (or the built-in default when `path` is None), apply overrides, validate. Keys renamed in 0.2
    (core/renames.py) are moved to their new names and `say` (default: stderr) gets one line naming them."""
    raw = read_yaml(path) if path else {}
    items = [parse_override(item) for item in overrides]
    task = next((v for k, v in reversed(items) if k == "task"), raw.get("task", "lm"))
    moved = renames.migrate(raw, task)
    for key, value in items:
        new = renames.new_name(key, task)
        if new:
            moved.append(f"{key} -> {new}")
        _set_dotted(raw, new or key, value)
    if moved:
        (say or (lambda line: print(line, file=sys.stderr, flush=True)))(renames.note(moved))
    cfg = _build(Config, raw, "")
    if not cfg.name:
        cfg.name = Path(path).stem if path else "default"
    if not cfg.run_dir:
        cfg.run_dir = str(Path("runs") / cfg.name)
    validate(cfg, check_paths=check_paths)
    return cfg


def _walk(cfg, prefix=""):
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _walk(value, prefix + f.name + ".")
        else:
            yield prefix + f.name, f, value


def hub_name(spec: str) -> str:
    """'hf:NAME' (a Hugging Face hub name) -> 'NAME'; a local path stays as it is."""
    return spec[3:] if spec.startswith("hf:") else spec


def base_config(cfg: Config) -> dict | None:
    """The pretrained base's config.json (a local folder); None from scratch or for a hub name (read when built)."""
    if not cfg.model.pretrained:
        return None
    config = Path(hub_name(cfg.model.pretrained)) / "config.json"
    return json.loads(config.read_text(encoding="utf-8")) if config.is_file() else None


def _check_path(key: str, value: str) -> None:
    if not value or value.startswith("hf:") or "://" in value:  # a hub name, or a URL listed when it is read
        return
    if not Path(value).exists():
        raise ConfigError(f"config key '{key}': file or folder '{value}' not found "
                          f"(use 'hf:NAME' for a hub name)")


def validate(cfg: Config, *, check_paths: bool = True) -> None:
    for key, f, value in _walk(cfg):
        meta = f.metadata
        if meta.get("choices") and value not in meta["choices"]:
            raise ConfigError(f"config key '{key}': expected one of {meta['choices']}, got {value!r}")
        if meta.get("min") is not None and value < meta["min"]:
            raise ConfigError(f"config key '{key}': must be >= {meta['min']}, got {value}")
        if meta.get("max") is not None and value > meta["max"]:
            raise ConfigError(f"config key '{key}': must be <= {meta['max']}, got {value}")
        if meta.get("path") and check_paths:
            _check_path(key, value)
    m, t = cfg.model, cfg.train
    if m.n_embd % m.n_head:
        raise ConfigError(f"config key 'model.n_embd': {m.n_embd} is not divisible by model.n_head={m.n_head}")
    if t.cpu_offload and t.strategy != "fsdp":
        raise ConfigError("config key 'train.cpu_offload': offloads FSDP2's shards; it needs train.strategy=fsdp")
    if m.base_dtype in ("bf16", "fp16") and not m.lora.r:
        raise ConfigError(f"config key 'model.base_dtype': {m.base_dtype} stores a frozen base, and only LoRA "
                          f"(model.lora.r > 0) freezes one; full fine-tuning keeps fp32 master weights")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(f"config key 'train.global_batch_size': {t.global_batch_size} is not a multiple "
                          f"of train.micro_batch_size={t.micro_batch_size}")
    if cfg.debug.fault:
        parse_fault(cfg.debug.fault)
    _check_extras(cfg.log)


def _check_extras(log: LogConfig) -> None:
    """An optional sink whose package is missing fails here, before any worker starts."""
    for key, enabled, module in (("log.tensorboard", log.tensorboard, "tensorboard"),
                                 ("log.wandb_project", log.wandb_project, "wandb"),
                                 ("log.mlflow_experiment", log.mlflow_experiment, "mlflow")):
        if enabled and importlib.util.find_spec(module) is None:
            raise ConfigError(f"config key '{key}': the {module} package is not installed "
                              f"(pip install 'phalanx[{module}]')")


def check_world(cfg: Config, world_size: int) -> int:
    """Gradient accumulation steps for this world size, or a ConfigError naming the fields."""
    t = cfg.train
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        raise ConfigError(f"config key 'train.global_batch_size': {t.global_batch_size} is not divisible by "
                          f"micro_batch_size ({t.micro_batch_size}) x world size ({world_size}) = {per_step}")
    return t.global_batch_size // per_step


def config_yaml(cfg: Config, *, secrets: bool = False) -> str:
    """The config as YAML, a URL's secret redacted; `secrets`: as it is (the workers' own file, private to the
    user: tools/launch.worker_config)."""
    return yaml.safe_dump(to_dict(cfg) if secrets else shown_dict(cfg), sort_keys=False)


def save_yaml(cfg: Config, path: str | os.PathLike) -> None:
    """RUN/config.yaml: the config, a URL's secret redacted."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text(Path(path), config_yaml(cfg))


def group_by_length(cfg: Config) -> bool:
    """data.group_by_length resolved for the config's task (auto = the task's own choice)."""
    return bool(_grouping(cfg.task, cfg.data.group_by_length))


def _grouping(task: str, value) -> bool | None:
    """The length grouping a task trains with; None where the key does not apply (lm). `value` as
    configured (auto|true|false) or as checkpoints before the auto choice recorded it (a bool)."""
    default = TASKS[task].group_by_length if task in TASKS else None
    if default is None:
        return None
    return default if value == "auto" else value in (True, "true")


def relevant_subset(cfg: Config) -> dict:
    """The training-relevant settings (flat), of the task's own sections only (a chat key does not stop an lm
    run from resuming)."""
    own = set(TASKS[cfg.task].sections) if cfg.task in TASKS else set()
    flat = {}
    for key, _, value in _walk(cfg):
        section = key.split(".")[0]
        if section in TASK_SECTIONS and section not in own:
            continue
        if any(key == k or key.startswith(k + ".") for k in TRAINING_RELEVANT):
            flat[key] = value
    return comparable(flat)


def recorded_settings(flat: dict, task: str) -> dict:
    """What a checkpoint recorded (relevant_subset at its save, flat) as today's relevant subset for `task`: keys
    renamed since under their new names (core/renames.py), keys it predates at their defaults, keys no longer
    relevant to the task (another task's section) left out."""
    defaults = relevant_subset(dataclasses.replace(Config(), task=task))
    recorded = {k: v for k, v in renames.migrate_flat(flat).items() if k in defaults}
    return comparable({**defaults, **recorded})


def comparable(flat: dict) -> dict:
    """Training-relevant settings as they act: data.group_by_length resolved for the task (so a checkpoint
    that recorded `true` compares equal to today's `auto` where that means true)."""
    key = "data.group_by_length"
    if key in flat:
        flat = {**flat, key: _grouping(flat.get("task", "lm"), flat[key])}
    return flat


def config_hash(cfg: Config) -> str:
    blob = json.dumps(relevant_subset(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def describe(cls=Config, prefix: str = "", task: str | None = None) -> list[str]:
    """One line per field: dotted key, type, default and doc (feeds `phalanx config --show`); with `task`, the
    shared sections and that task's own only."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            if task and not prefix and f.name in TASK_SECTIONS and f.name not in TASKS[task].sections:
                continue
            lines.append(f"\n[{prefix}{f.name}]  {f.metadata['help']}")
            lines.extend(describe(tp, prefix + f.name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        extra = f"  one of {f.metadata['choices']}" if f.metadata.get("choices") else ""
        lines.append(f"  {prefix}{f.name} ({_type_name(tp)}, default {default!r}): {f.metadata['help']}{extra}")
    return lines


def describe_markdown(cls=Config, prefix: str = "") -> list[str]:
    """The same as `describe`, as Markdown table rows (docs/config.md's key table is generated from it)."""
    rows = [] if prefix else ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe_markdown(tp, prefix + f.name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = ", ".join(str(c) or "'' (unset)" for c in f.metadata.get("choices") or [])
        extra = f" One of: {shown}." if shown else ""
        doc = (f.metadata["help"] + "." + extra).replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {_type_name(tp)} | `{default!r}` | {doc} |")
    return rows
