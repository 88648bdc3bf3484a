"""Where metric records go: RUN/metrics.jsonl always, plus optional TensorBoard, W&B and MLflow.

Every sink has the same two methods, `write(record)` and `close()`; `open_sinks` builds the list from
`log.*`, so the loop never asks which sinks are on. Records are flat dicts whose keys carry units;
list values (one entry per rank, keys starting `ranks/`) are spread into one scalar per rank for the
scalar-only services. This module does not import torch (the report reads runs with it).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from phalanx.core.config import ConfigError
from phalanx.core.runfolder import RunFolder


class JsonlSink:
    """RUN/metrics.jsonl: one JSON object per line, flushed per record so a killed run keeps its lines."""

    def __init__(self, path: Path, truncate_after_step: int | None = None):
        self.path = path
        if truncate_after_step is not None and path.exists():
            _truncate_after(path, truncate_after_step)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, allow_nan=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _truncate_after(path: Path, step: int) -> None:
    """On resume, drop lines logged after the checkpoint so the file reads as one uninterrupted run."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line from a killed process
        if rec.get("step", 0) <= step or rec.get("event"):
            kept.append(line)
    path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")


def read_metrics(path: Path) -> list[dict]:
    """Every readable record of a metrics.jsonl; torn or garbled lines (a killed writer) are skipped."""
    records = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return records
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def scalars(record: dict) -> dict[str, float]:
    """The numeric values of a record, per-rank lists spread to `KEY/rankN`; text and events dropped."""
    out = {}
    for key, value in record.items():
        if key in ("step", "time_s"):
            continue
        if isinstance(value, list):
            out.update({f"{key}/rank{r}": float(v) for r, v in enumerate(value) if _is_number(v)})
        elif _is_number(value):
            out[key] = float(value)
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("config key 'log.tensorboard': the tensorboard package is not installed "
                              "(pip install 'phalanx[tensorboard]')") from None
        self.writer = SummaryWriter(str(log_dir))

    def write(self, record: dict) -> None:
        if "step" not in record or record.get("event"):
            return
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, name: str, run_dir: Path, config: dict):
        wandb = _require("wandb", "log.wandb_project")
        # The run folder name as the id: a resumed run appends to the same W&B run.
        self.run = wandb.init(project=project, name=name, id=_safe_id(run_dir), resume="allow",
                              dir=str(run_dir), config=config)

    def write(self, record: dict) -> None:
        if "step" in record and not record.get("event"):
            self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, experiment: str, name: str, config: dict):
        self.mlflow = _require("mlflow", "log.mlflow_experiment")
        self.mlflow.set_experiment(experiment)
        self.mlflow.start_run(run_name=name)
        self.mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})

    def write(self, record: dict) -> None:
        if "step" in record and not record.get("event"):
            self.mlflow.log_metrics(scalars(record), step=record["step"])

    def close(self) -> None:
        self.mlflow.end_run()


def _require(module: str, key: str):
    import importlib  # optional sinks: their packages load only when configured

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"config key '{key}': the {module} package is not installed "
                          f"(pip install 'phalanx[{module}]')") from None


def _safe_id(run_dir: Path) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(run_dir).resolve().name)[:64]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def open_sinks(log_cfg, run_dir: Path, *, start_step: int, name: str, config: dict) -> list:
    """The sinks `log.*` asks for; JSONL first and always (the report and tests read it)."""
    run_dir = Path(run_dir)
    sinks = [JsonlSink(RunFolder(run_dir).metrics, truncate_after_step=start_step)]
    if log_cfg is None:
        return sinks
    if log_cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if log_cfg.wandb_project:
        sinks.append(WandbSink(log_cfg.wandb_project, name, run_dir, config))
    if log_cfg.mlflow_experiment:
        sinks.append(MlflowSink(log_cfg.mlflow_experiment, name, config))
    return sinks
