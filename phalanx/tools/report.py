"""Plots and a Markdown summary of one or more runs, from what the run folder holds; no torch needed.

    phalanx report RUN                 -> RUN/report.md and RUN/report/*.png
    phalanx report RUN1 RUN2 [...]     -> the same for each run, plus an overlay in --out
    phalanx report SWEEP               -> SWEEP/report.md and SWEEP/report/*.png (tools/sweepreport.py)

Works on a finished run (summary.json), a running one and a failed or killed one: everything is
derived from metrics.jsonl, whose torn or garbled lines are skipped, and summary.json only adds to it.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from phalanx.core.config import ConfigError, config_hash, load_config
from phalanx.core.runfolder import RunFolder
from phalanx.tools.curves import plot_task_curves
from phalanx.tools.plots import pyplot, save_figure
from phalanx.tools.sweepreport import is_sweep, report_sweep
from phalanx.run.sinks import read_metrics
from phalanx.run.stragglers import detect

SPLIT_LABELS = {"data_time_s": "data", "sync_time_s": "step-start sync (incl. waiting for others)",
                "fwd_bwd_time_s": "forward+backward", "optimizer_time_s": "optimizer"}
SPLIT = tuple(SPLIT_LABELS)
EVAL_COUNTS = ("eval/tokens", "eval/samples", "eval/pairs", "eval/pairs_truncated")


@dataclass
class Run:
    path: Path
    records: list[dict]
    summary: dict | None
    config: dict | None
    status: str
    skipped_lines: int = 0
    train: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"run folder '{path}' not found")
    metrics_file = RunFolder(path).metrics
    records = read_metrics(metrics_file)
    lines = metrics_file.read_text(encoding="utf-8", errors="replace").splitlines() if metrics_file.exists() else []
    summary = _read_json(RunFolder(path).summary)
    config = _read_yaml(RunFolder(path).config)
    run = Run(path, records, summary, config, _status(path, records, summary),
              skipped_lines=sum(1 for line in lines if line.strip()) - len(records))
    run.train = [r for r in records if "loss" in r and "event" not in r and "step" in r]
    run.evals = [r for r in records if any(k.startswith("eval/") for k in r) and "step" in r]
    return run


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _read_yaml(path: Path) -> dict | None:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


# outcome.json's status -> the report's words (the launcher's line follows for failures and hangs)
OUTCOME_WORDS = {"ok": "finished", "preempted": "preempted (resumable)", "hang": "hung", "failed": "failed"}


def _status(path: Path, records: list[dict], summary: dict | None) -> str:
    """From the launcher's RUN/outcome.json; for a run without one (still going, its launcher killed, or
    older than outcome.json, or started by an outside torchrun), from the markers and the metrics."""
    folder = RunFolder(path)
    outcome = folder.outcome()
    if outcome:
        words = OUTCOME_WORDS.get(outcome["status"], outcome["status"])
        if outcome["status"] in ("ok", "preempted"):
            return words
        line = str(outcome.get("line", ""))
        for prefix in ("training failed: ", "stopped: "):  # 'failed: training failed: ...' says it twice
            line = line.removeprefix(prefix)
        return f"{words}: {line}"
    last_step = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
    if folder.preempted.exists():
        return "preempted (resumable)"
    error = _read_json(folder.error)
    if error:
        return f"failed: {error.get('error', 'unknown error')}"
    hang = folder.hang_summary
    if hang.exists():
        return f"hung: {hang.read_text(encoding='utf-8').strip()}"
    if summary and summary.get("steps", -1) >= last_step:
        return "finished"
    metrics = folder.metrics
    if metrics.exists() and time.time() - metrics.stat().st_mtime < 120:
        return "running (no summary yet)"
    return "stopped without a summary (killed or failed)"


# ---- numbers for the summary ------------------------------------------------------------------
def facts(run: Run) -> dict:
    """What the Markdown summary says, from summary.json where there is one, else from the metrics."""
    s, last = run.summary or {}, (run.train[-1] if run.train else {})
    times = [r["time_s"] for r in run.records if "time_s" in r]
    train_time = _train_time(run.train)
    tokens = s.get("tokens_seen", last.get("tokens_seen", 0))
    world = s.get("world_size") or len(last.get("ranks/step_time_s", [])) or None
    peaks = {k: max((r.get(k, 0) for r in run.train), default=0) for k in ("host_peak_mb", "cuda_peak_mb")}
    stragglers = s["stragglers"] if "stragglers" in s else detect(run.records, *_straggler_cfg(run))
    return {
        "status": run.status, "digest": config_digest(run), "world_size": world,
        "global_batch_size": s.get("global_batch_size") or _cfg(run, "train", "global_batch_size"),
        "micro_batch_size": s.get("micro_batch_size") or _cfg(run, "train", "micro_batch_size"),
        "grad_accum": s.get("grad_accum"), "steps": s.get("steps", last.get("step", 0)),
        "max_steps": _cfg(run, "train", "max_steps"), "final_loss": last.get("loss"),
        "final_eval": {k: v for k, v in (run.evals[-1] if run.evals else {}).items()
                       if k.startswith("eval/") and k not in EVAL_COUNTS},
        "tokens_seen": tokens, "wall_time_s": s.get("wall_time_s", (max(times) - min(times)) if times else 0),
        "tokens_per_s": s.get("tokens_per_s", tokens / train_time if train_time else 0),
        "host_peak_mb": s.get("host_peak_mb", peaks["host_peak_mb"]),
        "cuda_peak_mb": s.get("cuda_peak_mb", peaks["cuda_peak_mb"]),
        "mfu": last.get("mfu"), "stragglers": stragglers,
        "metrics_overhead_pct": s.get("metrics_overhead_pct"), "skipped_lines": run.skipped_lines}


def _train_time(train: list[dict]) -> float:
    """Seconds spent in training steps: each line's mean step time times the steps it covers."""
    total, prev = 0.0, 0
    for r in train:
        total += r.get("step_time_s", 0) * (r["step"] - prev)
        prev = r["step"]
    return total


def _cfg(run: Run, section: str, key: str):
    return ((run.config or {}).get(section) or {}).get(key)


def _straggler_cfg(run: Run) -> tuple[float, int]:
    log = (run.config or {}).get("log") or {}
    return log.get("straggler_margin", 0.2), log.get("straggler_windows", 3)


def config_digest(run: Run) -> str:
    """The training-relevant config hash (as checkpoints record it), or a hash of the raw file."""
    path = RunFolder(run.path).config
    if not path.exists():
        return "no config.yaml"
    try:
        return config_hash(load_config(str(path), check_paths=False))
    except ConfigError:
        return "file " + hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ---- Markdown ---------------------------------------------------------------------------------
def _fmt(v, unit: str = "") -> str:
    if v is None or v == "":
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.4g}{unit}" if abs(v) < 1000 else f"{v:,.0f}{unit}"
    if isinstance(v, int):
        return f"{v:,}{unit}"
    return f"{v}{unit}"


def _shape(run: Run) -> str:
    m, t = (run.config or {}).get("model") or {}, (run.config or {}).get("train") or {}
    if not m:
        return ""
    return (f" ({(run.config or {}).get('task', '?')}, {m.get('arch')} {m.get('n_layer')}x{m.get('n_embd')}, "
            f"lr {t.get('lr')}, {t.get('precision')}, {t.get('strategy')})")


def _straggler_text(stragglers: list[dict]) -> str:
    if not stragglers:
        return "none"
    return "; ".join(f"rank {s['rank']} ({s['slowdown']:.2f}x the median busy time, slow in "
                     f"{s['slow_windows']}/{s['windows']} log windows, named at step {s['first_step']})"
                     for s in stragglers)


def markdown(run: Run, plots: list[Path]) -> str:
    f = facts(run)
    batch = _fmt(f["global_batch_size"])
    if f["micro_batch_size"] and f["world_size"] and f["grad_accum"]:
        batch += f" = micro {f['micro_batch_size']} x world {f['world_size']} x accum {f['grad_accum']}"
    peak = _fmt(f["host_peak_mb"], " MB host (max over ranks)")
    if f["cuda_peak_mb"]:
        peak += ", " + _fmt(f["cuda_peak_mb"], " MB CUDA")
    rows = [("status", f["status"]), ("config digest", f"`{f['digest']}`{_shape(run)}"),
            ("world size", _fmt(f["world_size"])), ("global batch", batch),
            ("steps", f"{_fmt(f['steps'])} of {_fmt(f['max_steps'])}"),
            ("final train loss", _fmt(f["final_loss"]))]
    rows += [(f"final {k}", _fmt(v)) for k, v in f["final_eval"].items()]
    rows += [("tokens seen", _fmt(f["tokens_seen"])), ("wall time", _fmt(f["wall_time_s"], " s")),
             ("training tokens/s", _fmt(f["tokens_per_s"])), ("peak memory", peak),
             ("MFU (last window)", _fmt(f["mfu"])), ("stragglers", _straggler_text(f["stragglers"])),
             ("metric collection overhead", _fmt(f["metrics_overhead_pct"], " % of step time"))]
    if f["skipped_lines"]:
        rows.append(("unreadable metric lines skipped", str(f["skipped_lines"])))
    lines = [f"# Run `{run.name}`", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.relative_to(run.path).as_posix()})" for p in plots]
    return "\n".join(lines) + "\n"


# ---- plots ------------------------------------------------------------------------------------
def _series(records: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _minutes(run: Run, records: list[dict]) -> list[float]:
    t0 = min((r["time_s"] for r in run.records if "time_s" in r), default=0)
    return [(r["time_s"] - t0) / 60 for r in records]


def _eval_keys(run: Run) -> list[str]:
    """Validation metrics other than the loss (accuracy, F1, ...): drawn on a second y axis; those of a task's
    metric groups (eval/rewards/margins, ...) are drawn with their training curves (curves.py)."""
    skip = set(EVAL_COUNTS) | {"eval/loss", "eval/ppl"}
    return sorted({k for r in run.evals for k in r if k.startswith("eval/") and k not in skip and k.count("/") == 1})


def plot_loss(runs: list[Run], path: Path) -> Path:
    """Training and validation loss (and other validation metrics) vs step and vs wall time."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    extra = sorted({k for run in runs for k in _eval_keys(run)})
    twins = [ax.twinx() for ax in axes] if extra else []
    for run in runs:
        prefix = f"{run.name} " if len(runs) > 1 else ""
        for i, xs in enumerate((lambda rs: [r["step"] for r in rs], lambda rs, run=run: _minutes(run, rs))):
            train = [r for r in run.train if "loss" in r]
            axes[i].plot(xs(train), [r["loss"] for r in train], label=f"{prefix}train loss")
            for key in ["eval/loss"] + extra:
                evals = [r for r in run.evals if isinstance(r.get(key), (int, float))]
                if evals:
                    ax = axes[i] if key == "eval/loss" else twins[i]
                    ax.plot(xs(evals), [r[key] for r in evals], "o--", label=f"{prefix}{key}")
    for i, (xlabel, title) in enumerate((("step", "vs step"), ("wall time (min since first log line)",
                                                               "vs wall time"))):
        axes[i].set(xlabel=xlabel, ylabel="loss", title=f"loss {title}")
        axes[i].grid(alpha=0.3)
        axes[i].legend(fontsize=8, loc="upper right")
        if twins:
            twins[i].set_ylabel(", ".join(extra))
            twins[i].legend(fontsize=8, loc="center right")
    return save_figure(fig, path)


def plot_throughput(runs: list[Run], path: Path) -> Path:
    """Global tokens/s (and per rank for a single run) and MFU where known."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        prefix = f"{run.name} " if len(runs) > 1 else ""
        ax.plot(*_series(run.train, "tokens_per_s"), label=f"{prefix}all ranks", lw=2)
        if len(runs) == 1:
            for rank, (steps, values) in enumerate(_per_rank(run.train, "ranks/tokens_per_s")):
                ax.plot(steps, values, "--", label=f"rank {rank}", lw=1)
    ax.set(xlabel="step", ylabel="tokens/s", title="training throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _per_rank(records: list[dict], key: str) -> list[tuple[list, list]]:
    """[(steps, values) for each rank] of a `ranks/...` list key."""
    rows = [(r["step"], r[key]) for r in records if isinstance(r.get(key), list)]
    world = max((len(v) for _, v in rows), default=0)
    return [([s for s, v in rows if len(v) > k], [v[k] for s, v in rows if len(v) > k]) for k in range(world)]


def plot_memory(runs: list[Run], path: Path) -> Path:
    """Resident and peak host memory per rank, and CUDA memory where the run used a GPU."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = (("ranks/rss_mb", "-", "RSS"), ("ranks/host_peak_mb", ":", "host peak"),
              ("ranks/cuda_allocated_mb", "-.", "CUDA allocated"), ("ranks/cuda_peak_mb", "--", "CUDA peak"))
    colors = iter(f"C{i}" for i in range(1000))
    for run in runs:
        prefix = f"{run.name} " if len(runs) > 1 else ""
        run_colors = [next(colors) for _ in range(len(_per_rank(run.train, "ranks/rss_mb")))]
        for key, style, what in styles:
            for rank, (steps, values) in enumerate(_per_rank(run.train, key)):
                ax.plot(steps, values, style, color=run_colors[rank % len(run_colors)],
                        label=f"{prefix}rank {rank} {what}")
    ax.set(xlabel="step", ylabel="MB", title="memory per rank")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def plot_step_split(run: Run, path: Path) -> Path:
    """Where a step's time goes (mean over ranks), stacked; gradient all-reduce time drawn over it."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    rows = [r for r in run.train if all(k in r for k in SPLIT)]
    steps = [r["step"] for r in rows]
    if rows:
        ax.stackplot(steps, *[[r[k] * 1e3 for r in rows] for k in SPLIT], labels=list(SPLIT_LABELS.values()),
                     alpha=0.8)
        for key, style, label in (("comm_time_s", "k--", "gradient all-reduce in flight"),
                                  ("comm_exposed_time_s", "k:", "gradient all-reduce not hidden by backward")):
            if any(key in r for r in rows):
                ax.plot(steps, [r.get(key, 0) * 1e3 for r in rows], style, label=label)
        ax.plot(steps, [r["step_time_s"] * 1e3 for r in rows], "r-", lw=1, label="step time (rank 0)")
    ax.set(xlabel="step", ylabel="ms per step", title="step-time split")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return save_figure(fig, path)


def plot_rank_times(run: Run, path: Path, stragglers: list[dict]) -> Path:
    """Per-rank busy time (step minus waiting for others) and wall-clock step time."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for rank, (steps, values) in enumerate(_per_rank(run.train, "ranks/busy_time_s")):
        ax.plot(steps, [v * 1e3 for v in values], "-", color=f"C{rank}", label=f"rank {rank} busy")
    for rank, (steps, values) in enumerate(_per_rank(run.train, "ranks/step_time_s")):
        ax.plot(steps, [v * 1e3 for v in values], ":", color=f"C{rank}", label=f"rank {rank} step")
    named = ", ".join(f"rank {s['rank']}" for s in stragglers)
    ax.set(xlabel="step", ylabel="ms per step",
           title="per-rank step time" + (f" (stragglers: {named})" if named else " (no stragglers)"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


# ---- commands ---------------------------------------------------------------------------------
def report_run(run: Run) -> list[Path]:
    """RUN/report/*.png and RUN/report.md; returns the files written."""
    out = run.path / "report"
    stragglers = facts(run)["stragglers"]
    plots = [plot_loss([run], out / "loss.png"), plot_throughput([run], out / "throughput.png"),
             plot_memory([run], out / "memory.png"), plot_step_split(run, out / "step_time_split.png"),
             plot_rank_times(run, out / "rank_step_time.png", stragglers), plot_task_curves([run], out / "task.png")]
    plots = [p for p in plots if p is not None]
    md = run.path / "report.md"
    md.write_text(markdown(run, plots), encoding="utf-8")
    return plots + [md]


def compare(runs: list[Run], out: Path) -> list[Path]:
    """Overlay plots and a table with one row per run."""
    plots = [plot_loss(runs, out / "loss.png"), plot_throughput(runs, out / "throughput.png"),
             plot_memory(runs, out / "memory.png"), plot_task_curves(runs, out / "task.png")]
    plots = [p for p in plots if p is not None]
    head = ("run", "status", "world", "global batch", "steps", "final loss", "tokens/s", "wall time s",
            "host peak MB", "stragglers")
    lines = ["# Run comparison", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        f = facts(run)
        cells = (run.name, f["status"], f["world_size"], f["global_batch_size"], f["steps"], f["final_loss"],
                 f["tokens_per_s"], f["wall_time_s"], f["host_peak_mb"],
                 ", ".join(f"rank {s['rank']}" for s in f["stragglers"]) or "none")
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return plots + [md]


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folder(s); several are also overlaid")
    p.add_argument("--out", default=None,
                   help="folder for the overlay of several runs (default: compare-<names> beside the first)")


def run(args) -> int:
    sweeps = [Path(r) for r in args.runs if is_sweep(Path(r))]
    if sweeps:  # a sweep folder gets the sweep report (its trials are runs: report them one by one)
        if len(sweeps) != len(args.runs):
            raise ConfigError("report: sweep folders and run folders cannot be mixed in one call")
        for path in (p for folder in sweeps for p in report_sweep(folder)):
            print(path)
        return 0
    try:
        runs = [load_run(r) for r in args.runs]
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    for r in runs:
        if not r.records:
            raise ConfigError(f"run '{r.path}': no readable metrics.jsonl lines yet")
    written = [p for r in runs for p in report_run(r)]
    if len(runs) > 1:
        out = Path(args.out) if args.out else runs[0].path.parent / ("compare-" + "-".join(r.name for r in runs))[:120]
        written += compare(runs, out)
    for path in written:
        print(path)
    return 0
