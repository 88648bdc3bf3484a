"""The sweep file: what to search, how, and how each trial runs; checked whole before any trial starts.

    config: examples/shakespeare.yaml        # base config (empty = the built-in default)
    overrides: {train.max_steps: 60}         # applied to every trial (a mapping, or a list of key=value)
    space:                                   # config keys to search
      train.lr: {type: loguniform, low: 1.0e-4, high: 1.0e-2}
      model.n_layer: [1, 2]                  # a list: grid values (= {type: choice, values: [...]})
    metric: eval/loss                        # a key of the trial's final eval (summary.json)
    direction: minimize
    sampler: grid                            # grid | random | tpe
    trials: 8
    pruner: {type: median, startup_trials: 2, warmup_steps: 20}
    parallel: 2
    nproc_per_trial: 1
    seeds: [1, 2]                            # each configuration x seed is one trial (sets train.seed)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.core.config import ConfigError, load_config, read_yaml
from phalanx.core.registry import TASKS

KINDS = ("choice", "int", "uniform", "loguniform")
SAMPLERS = ("grid", "random", "tpe")
DIRECTIONS = ("minimize", "maximize")
# Pruner settings (besides `type`) and their defaults; passed to Optuna's pruners by these names.
PRUNERS = {"none": {},
           "median": {"startup_trials": 5, "warmup_steps": 0, "interval_steps": 1},
           "asha": {"min_resource": "auto", "reduction_factor": 4, "min_early_stopping_rate": 0},
           "hyperband": {"min_resource": 1, "max_resource": "auto", "reduction_factor": 3}}
TOP_KEYS = {"config", "overrides", "space", "metric", "direction", "sampler", "sampler_seed", "trials", "pruner",
            "parallel", "nproc_per_trial", "seeds", "heartbeat_grace_s"}


@dataclass
class Param:
    key: str
    kind: str
    values: list | None = None   # choice
    low: float | None = None     # int, uniform, loguniform
    high: float | None = None
    step: int = 1                # int

    def suggest(self, trial) -> Any:
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, self.values)
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=self.step)
        return trial.suggest_float(self.key, self.low, self.high, log=self.kind == "loguniform")

    def distribution(self):
        """The Optuna distribution of this key (rebuilds trials for the report's importances)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
        if self.kind == "choice":
            return CategoricalDistribution(self.values)
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high), step=self.step)
        return FloatDistribution(self.low, self.high, log=self.kind == "loguniform")

    def examples(self) -> list:
        """Values that must all make a valid config: every choice, or both ends of a range."""
        if self.kind == "choice":
            return list(self.values)
        return [int(self.low), int(self.high)] if self.kind == "int" else [self.low, self.high]


@dataclass
class Sweep:
    path: Path
    name: str
    config: str | None
    overrides: list[str]
    space: list[Param]
    metric: str = "eval/loss"
    direction: str = "minimize"
    sampler: str = "tpe"
    sampler_seed: int = 0
    trials: int = 10
    pruner: dict = field(default_factory=lambda: {"type": "none"})
    parallel: int = 1
    nproc_per_trial: int = 1
    seeds: list[int] = field(default_factory=list)
    heartbeat_grace_s: float = 120.0

    @property
    def grid(self) -> dict[str, list] | None:
        if self.sampler != "grid":
            return None
        return {p.key: list(p.values) for p in self.space}

    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.grid.values()) * max(1, len(self.seeds))

    def make_sampler(self):
        import optuna
        if self.sampler == "grid":
            return _quiet_grid()(self.grid, seed=self.sampler_seed)
        if self.sampler == "random":
            return optuna.samplers.RandomSampler(seed=self.sampler_seed)
        return optuna.samplers.TPESampler(seed=self.sampler_seed)

    def make_pruner(self):
        import optuna
        kind, s = self.pruner["type"], self.pruner
        if kind == "median":
            return optuna.pruners.MedianPruner(n_startup_trials=s["startup_trials"], n_warmup_steps=s["warmup_steps"],
                                               interval_steps=s["interval_steps"])
        if kind == "asha":
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=s["min_resource"],
                                                          reduction_factor=s["reduction_factor"],
                                                          min_early_stopping_rate=s["min_early_stopping_rate"])
        if kind == "hyperband":
            return optuna.pruners.HyperbandPruner(min_resource=s["min_resource"], max_resource=s["max_resource"],
                                                  reduction_factor=s["reduction_factor"])
        return optuna.pruners.NopPruner()

    def trial_overrides(self, params: dict, seed: int | None) -> list[str]:
        extra = [override(k, v) for k, v in params.items()]
        return self.overrides + extra + ([override("train.seed", seed)] if seed is not None else [])


def _quiet_grid():
    """GridSampler without its `study.stop()` once the grid is used up: that call is only allowed inside
    `study.optimize`, and the sweep's own loop already stops at the grid size."""
    import optuna

    class Grid(optuna.samplers.GridSampler):
        def after_trial(self, study, trial, state, values) -> None:
            pass

    return Grid


def override(key: str, value: Any) -> str:
    """key=value as the command line takes it (YAML parses JSON scalars and lists)."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def _fail(path: Path, where: str, expected: str, got: Any = None) -> ConfigError:
    tail = f", got {got!r}" if got is not None else ""
    return ConfigError(f"sweep file '{path}': {where}: expected {expected}{tail}")


def _number(path, where, value, *, integer=False, positive=False):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (positive and value <= 0):
        raise _fail(path, where, ("a positive " if positive else "a ") + ("integer" if integer else "number"), value)
    return value


def _param(path: Path, key: str, spec: Any) -> Param:
    where = f"space.{key}"
    if isinstance(spec, list):
        spec = {"type": "choice", "values": spec}
    if not isinstance(spec, dict) or spec.get("type") not in KINDS:
        raise _fail(path, where, f"a list of values or a mapping with type one of {', '.join(KINDS)}", spec)
    kind = spec["type"]
    allowed = ({"type", "values"} if kind == "choice" else
               {"type", "low", "high"} | ({"step"} if kind == "int" else set()))
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise _fail(path, where, f"only {', '.join(sorted(allowed))}", unknown)
    if kind == "choice":
        values = spec.get("values")
        if not isinstance(values, list) or not values or len({json.dumps(v) for v in values}) != len(values):
            raise _fail(path, f"{where}.values", "a non-empty list of distinct values", values)
        return Param(key, kind, values=values)
    low = _number(path, f"{where}.low", spec.get("low"), integer=kind == "int")
    high = _number(path, f"{where}.high", spec.get("high"), integer=kind == "int")
    if not low < high or (kind == "loguniform" and low <= 0):
        raise _fail(path, where, "low < high" + (" and low > 0" if kind == "loguniform" else ""), [low, high])
    step = _number(path, f"{where}.step", spec.get("step", 1), integer=True, positive=True)
    return Param(key, kind, low=low, high=high, step=step)


def _resolve_config(path: Path, config: Any) -> str | None:
    if config in (None, ""):
        return None
    if not isinstance(config, str):
        raise _fail(path, "config", "a config file path", config)
    for candidate in (Path(config), path.parent / config):
        if candidate.is_file():
            return str(candidate.resolve())
    raise _fail(path, "config", "an existing config file (relative to the current folder or the sweep file)",
                config)


def load_sweep(path: str | Path, *, parallel: int | None = None, trials: int | None = None) -> Sweep:
    """Parse and check a sweep file; every trial's config is validated here (ConfigError = exit 2)."""
    path = Path(path)
    raw = read_yaml(path)
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise _fail(path, f"unknown key(s) {', '.join(unknown)}", f"some of {', '.join(sorted(TOP_KEYS))}")
    overrides = raw.get("overrides") or {}
    if isinstance(overrides, dict):
        overrides = [override(k, v) for k, v in overrides.items()]
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise _fail(path, "overrides", "a mapping of config keys to values, or a list of key=value", overrides)
    space = raw.get("space")
    if not isinstance(space, dict) or not space:
        raise _fail(path, "space", "a mapping of config keys to search spaces", space)
    sweep = Sweep(path=path, name=path.stem, config=_resolve_config(path, raw.get("config")), overrides=overrides,
                  space=[_param(path, str(k), v) for k, v in space.items()])
    for key in ("metric", "direction", "sampler"):
        if key in raw:
            setattr(sweep, key, raw[key])
    if sweep.direction not in DIRECTIONS:
        raise _fail(path, "direction", " or ".join(DIRECTIONS), sweep.direction)
    if "sampler" not in raw and all(p.kind == "choice" for p in sweep.space):
        sweep.sampler = "grid"
    if sweep.sampler not in SAMPLERS:
        raise _fail(path, "sampler", " or ".join(SAMPLERS), sweep.sampler)
    if sweep.sampler == "grid":
        ranged = [p.key for p in sweep.space if p.kind != "choice"]
        if ranged:
            raise _fail(path, "sampler: grid", "lists of values for every key (ranges need random or tpe)", ranged)
    sweep.sampler_seed = _number(path, "sampler_seed", raw.get("sampler_seed", 0), integer=True)
    seeds = raw.get("seeds", [])
    if not isinstance(seeds, list) \
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise _fail(path, "seeds", "a list of distinct non-negative integers", seeds)
    sweep.seeds = seeds
    if "train.seed" in {p.key for p in sweep.space} and seeds:
        raise _fail(path, "seeds", "either seeds or train.seed in the space, not both")
    for key in ("parallel", "nproc_per_trial"):
        setattr(sweep, key, _number(path, key, raw.get(key, 1), integer=True, positive=True))
    sweep.heartbeat_grace_s = _number(path, "heartbeat_grace_s", raw.get("heartbeat_grace_s", 120.0), positive=True)
    default_trials = sweep.grid_size() if sweep.sampler == "grid" else 10
    sweep.trials = _number(path, "trials", raw.get("trials", default_trials), integer=True, positive=True)
    sweep.pruner = _pruner(path, raw.get("pruner", "none"))
    if parallel is not None:
        sweep.parallel = _number(path, "--parallel", parallel, integer=True, positive=True)
    if trials is not None:
        sweep.trials = _number(path, "--trials", trials, integer=True, positive=True)
    if sweep.sampler == "grid":
        sweep.trials = min(sweep.trials, sweep.grid_size())  # beyond the grid a sampler only repeats points
    _check_trial_configs(sweep)
    return sweep


def _pruner(path: Path, raw: Any) -> dict:
    if isinstance(raw, str):
        raw = {"type": raw}
    if not isinstance(raw, dict) or raw.get("type") not in PRUNERS:
        raise _fail(path, "pruner", f"one of {', '.join(PRUNERS)} (or a mapping with that type)", raw)
    defaults = PRUNERS[raw["type"]]
    unknown = sorted(set(raw) - {"type"} - set(defaults))
    if unknown:
        raise _fail(path, f"pruner ({raw['type']})", f"settings among {', '.join(defaults) or 'none'}", unknown)
    settings = {"type": raw["type"], **defaults, **{k: v for k, v in raw.items() if k != "type"}}
    for key, value in settings.items():
        if key != "type" and value != "auto":
            _number(path, f"pruner.{key}", value, integer=True)
    return settings


def _check_trial_configs(sweep: Sweep) -> None:
    """Every value of every searched key must give a valid config, with every other key at its first value."""
    base = sweep.overrides + [override(p.key, p.examples()[0]) for p in sweep.space]
    cfg = None
    for p in sweep.space:
        for value in p.examples():
            try:
                cfg = load_config(sweep.config, base + [override(p.key, value)])
            except ConfigError as e:
                raise ConfigError(f"sweep file '{sweep.path}': space.{p.key}={value!r}: {e}") from None
    if "run_dir" in {p.key for p in sweep.space} or any(o.startswith("run_dir=") for o in sweep.overrides):
        raise _fail(sweep.path, "run_dir", "not set: each trial runs in SWEEP/trials/NNNN")
    known = TASKS[cfg.task].eval_metrics
    if sweep.metric not in known:
        raise _fail(sweep.path, "metric", f"one of {', '.join(known)} (task {cfg.task})", sweep.metric)
