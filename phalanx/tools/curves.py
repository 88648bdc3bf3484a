"""Curves of a task's own training metrics (`phalanx report`): the keys a task logs beside the loss whose name
holds a '/' (preference tuning: rewards/chosen, rewards/margins, rewards/accuracies, logps/chosen, ...), each
with its evaluation counterpart (eval/<key>) where the run has one. One panel per group (the name before
the '/'; accuracies, a fraction, get their own), training as lines, evaluation as markers."""
from __future__ import annotations

from pathlib import Path

from phalanx.tools.plots import pyplot, save_figure

NOT_TASK = ("ranks/", "eval/")  # per-rank lists and evaluation keys are drawn elsewhere


def task_keys(train: list[dict]) -> list[str]:
    return sorted({k for r in train for k, v in r.items()
                   if "/" in k and not k.startswith(NOT_TASK) and isinstance(v, (int, float))})


def _group(key: str) -> str:
    return "accuracies" if key.endswith("accuracies") else key.split("/")[0]


def plot_task_curves(runs: list, path: Path) -> Path | None:
    """`runs`: report.Run objects (their train and evals records). None when no run logs such metrics."""
    keys = sorted({k for run in runs for k in task_keys(run.train)})
    if not keys:
        return None
    groups = sorted({_group(k) for k in keys})
    plt = pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
    for ax, group in zip(axes[0], groups):
        for run in runs:
            prefix = f"{run.name} " if len(runs) > 1 else ""
            for key in (k for k in keys if _group(k) == group):
                train = [r for r in run.train if isinstance(r.get(key), (int, float))]
                line, = ax.plot([r["step"] for r in train], [r[key] for r in train], label=f"{prefix}{key}")
                evals = [r for r in run.evals if isinstance(r.get(f"eval/{key}"), (int, float))]
                if evals:
                    ax.plot([r["step"] for r in evals], [r[f"eval/{key}"] for r in evals], "o--",
                            color=line.get_color(), label=f"{prefix}eval/{key}")
        ax.set(xlabel="step", title=group)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)
