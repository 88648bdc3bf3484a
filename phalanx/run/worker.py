"""Entry point of one worker process: `python -m phalanx.run.worker RUN/config.yaml` (started by torchrun)."""
from __future__ import annotations

import os
import sys
import traceback

from phalanx.core.config import load_config
from phalanx.run.state import StopTraining
from phalanx.run.train import train


def main() -> None:
    code = 0
    try:
        train(load_config(sys.argv[1], check_paths=False))  # a clean preemption also exits 0
    except StopTraining as e:
        print(f"phalanx: {e}", file=sys.stderr)
        code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: Gloo/DDP destructors at exit can deadlock (DESIGN.md pitfall 2).
    os._exit(code)


if __name__ == "__main__":
    main()
