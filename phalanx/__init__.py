"""phalanx: distributed data-parallel NLP training on PyTorch.

    phalanx.launch(config, nproc_per_node=N)   # from a script or notebook: starts workers, returns exit code
    phalanx.train(config)                      # inside an existing worker (torchrun/srun) or one process
"""
from __future__ import annotations

__version__ = "0.1.0"


def launch(config, nproc_per_node: int = 1, **kwargs) -> int:
    """Validate `config` (a Config or a YAML path), start workers via torch.distributed.run; exit code."""
    from phalanx.tools.launch import launch as _launch

    return _launch(config, nproc_per_node, **kwargs)


def train(config) -> dict:
    """Train in this process as one worker of an existing process group (or alone); returns the summary."""
    from phalanx.run.train import train as _train

    return _train(config)


def load_config(path=None, overrides=()):
    from phalanx.core.config import load_config as _load

    return _load(path, list(overrides))
