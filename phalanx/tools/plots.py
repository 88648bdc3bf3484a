"""Matplotlib for the report commands: headless, and imported only when a plot is drawn."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib  # lazy: plotting only, at the end

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path
