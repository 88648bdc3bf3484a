"""`phalanx report SWEEP`: one Markdown page for a sweep folder, from the files the sweep wrote.

SWEEP/report.md with SWEEP/report/*.png: the trials sorted by the metric, configurations ranked by the
mean over seeds (with the spread), eval curves of every trial on one plot (pruned ones dashed, failed
ones dotted), the metric against each parameter, a parallel-coordinates plot and parameter importances
(Optuna's default evaluator, on the completed trials rebuilt from trials.jsonl: no storage needed).
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

from phalanx.core.config import ConfigError
from phalanx.core.runfolder import read_json, write_text
from phalanx.tools.plots import pyplot, save_figure
from phalanx.tools.sweepspec import Param

STYLE = {"COMPLETE": "-", "PRUNED": "--", "FAIL": ":", "RUNNING": "-."}


def is_sweep(folder: Path) -> bool:
    return (Path(folder) / "sweep.json").is_file()


def load(folder: Path) -> tuple[dict, list[dict], list[Param]]:
    summary = read_json(folder / "summary.json")
    lines = (folder / "trials.jsonl").read_text().splitlines() if (folder / "trials.jsonl").exists() else []
    rows = [json.loads(line) for line in lines if line.strip()]
    if not summary or not rows:
        raise ConfigError(f"sweep folder '{folder}': no trials recorded yet (summary.json, trials.jsonl)")
    space = [Param(**p) for p in read_json(folder / "sweep.json")["space"]]
    return summary, rows, space


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def markdown(summary: dict, rows: list[dict], space: list[Param], importances: dict, plots: list[Path]) -> str:
    metric, keys = summary["metric"], [p.key for p in space]
    sign = -1 if summary["direction"] == "maximize" else 1
    ranked = sorted(rows, key=lambda r: (r["value"] is None, sign * (r["value"] or 0), r["number"]))
    counts = summary["counts"]
    out = [f"# Sweep {summary['study']}", "",
           f"{metric} ({summary['direction']}), sampler {summary['sampler']}, pruner {summary['pruner']['type']}: "
           f"{counts['COMPLETE']} complete, {counts['PRUNED']} pruned, {counts['FAIL']} failed, "
           f"{counts['RUNNING']} running or interrupted, of {summary['trials_planned']} planned.", ""]
    best = summary.get("best")
    if best:
        out += [f"Best: trial {best['number']}, {metric} {best['value']:.4g} "
                f"({', '.join(f'{k}={_fmt(v)}' for k, v in best['params'].items())}); its config: best.yaml", ""]
    out += ["## Trials (sorted by the metric)", "",
            "| trial | " + " | ".join(keys) + f" | seed | state | {metric} | steps | wall s | note |",
            "|---" * (len(keys) + 7) + "|"]
    for r in ranked:
        note = r.get("reason") or (f"pruned, stopped at step {r['pruned_at_step']}" if r.get("pruned_at_step") else "")
        out.append(f"| {r['number']} | " + " | ".join(_fmt(r["params"].get(k)) for k in keys) +
                   f" | {_fmt(r['seed'])} | {r['state']} | {_fmt(r['value'])} | {r['steps']} | "
                   f"{_fmt(r['wall_time_s'])} | {note} |")
    configs = summary.get("configs") or []
    if any(c["n"] > 1 for c in configs):
        out += ["", "## Configurations over seeds (ranked by the mean)", "",
                "| " + " | ".join(keys) + f" | mean {metric} | ± std | seeds | trials |",
                "|---" * (len(keys) + 4) + "|"]
        for c in configs:
            out.append("| " + " | ".join(_fmt(c["params"].get(k)) for k in keys) +
                       f" | {c['mean']:.4g} | {c['std']:.2g} | {c['n']} | {', '.join(map(str, c['trials']))} |")
    if importances:
        n = sum(1 for r in rows if r["state"] == "COMPLETE")
        out += ["", "## Parameter importances (fANOVA over completed trials)", ""]
        if n < 10:
            out += [f"({n} completed trials: too few for the forest to separate the parameters; read as rough)", ""]
        out += ["| parameter | importance |", "|---|---|"]
        out += [f"| {k} | {v:.3f} |" for k, v in importances.items()]
    out += [""] + [f"![{p.stem}](report/{p.name})" for p in plots]
    return "\n".join(out) + "\n"


def importances(rows: list[dict], space: list[Param], direction: str) -> dict:
    """Optuna's parameter importances on the completed trials (needs two or more, and a varying metric)."""
    import optuna

    done = [r for r in rows if r["state"] == "COMPLETE" and r["value"] is not None and math.isfinite(r["value"])]
    if len(done) < 2 or len({r["value"] for r in done}) < 2:
        return {}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction=direction)
    dists = {p.key: p.distribution() for p in space}
    for r in done:
        study.add_trial(optuna.trial.create_trial(params=r["params"], distributions=dists, value=r["value"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(optuna.importance.get_param_importances(study))


def plot_curves(rows: list[dict], metric: str, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in rows:
        steps = [int(s) for s in r["evals"]]
        if steps:
            ax.plot(steps, list(r["evals"].values()), STYLE.get(r["state"], "-"), marker=".",
                    label=f"{r['number']} ({r['state'].lower()})")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} of every trial (dashed: pruned, dotted: failed)")
    ax.legend(fontsize="small", ncol=2)
    return save_figure(fig, path)


def plot_params(rows: list[dict], space: list[Param], metric: str, path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(space), figsize=(4.5 * len(space), 4), squeeze=False)
    done = [r for r in rows if r["state"] == "COMPLETE" and r["value"] is not None]
    for ax, p in zip(axes[0], space):
        xs = [r["params"].get(p.key) for r in done]
        if p.kind == "choice":  # categories in the file's order
            ax.set_xticks(range(len(p.values)), [str(v) for v in p.values])
            xs = [p.values.index(x) for x in xs]
        ax.scatter(xs, [r["value"] for r in done])
        if p.kind == "loguniform":
            ax.set_xscale("log")
        ax.set_xlabel(p.key)
        ax.set_ylabel(metric)
    fig.suptitle(f"{metric} against each parameter (completed trials)")
    return save_figure(fig, path)


def plot_parallel(rows: list[dict], space: list[Param], metric: str, path: Path) -> Path:
    """One line per completed trial across the parameters' axes (scaled to 0..1) and the metric."""
    plt = pyplot()
    done = [r for r in rows if r["state"] == "COMPLETE" and r["value"] is not None]
    fig, ax = plt.subplots(figsize=(2.2 * (len(space) + 1) + 2, 4.5))
    values = [r["value"] for r in done]
    lo, hi = (min(values), max(values)) if values else (0, 1)
    cmap = plt.get_cmap("viridis")

    def scaled(p: Param, x):
        if p.kind == "choice":
            return p.values.index(x) / max(1, len(p.values) - 1)
        a, b, x = (math.log(p.low), math.log(p.high), math.log(x)) if p.kind == "loguniform" else (p.low, p.high, x)
        return (x - a) / (b - a)

    for r in done:
        ys = [scaled(p, r["params"][p.key]) for p in space] + [(r["value"] - lo) / ((hi - lo) or 1)]
        ax.plot(range(len(ys)), ys, color=cmap((r["value"] - lo) / ((hi - lo) or 1)), marker="o")
    ax.set_xticks(range(len(space) + 1), [p.key for p in space] + [metric])
    ax.set_yticks([0, 1], ["low", "high"])
    ax.set_title(f"parallel coordinates (colour: {metric}, {lo:.4g} to {hi:.4g})")
    return save_figure(fig, path)


def report_sweep(folder: Path) -> list[Path]:
    summary, rows, space = load(folder)
    metric = summary["metric"]
    out = folder / "report"
    plots = [plot_curves(rows, metric, out / "curves.png"), plot_params(rows, space, metric, out / "params.png"),
             plot_parallel(rows, space, metric, out / "parallel.png")]
    text = markdown(summary, rows, space, importances(rows, space, summary["direction"]), plots)
    write_text(folder / "report.md", text)
    return [folder / "report.md", *plots]
