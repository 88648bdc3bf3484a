"""Entry point of one worker process: `python -m phalanx.run.worker RUN/config.yaml` (started by torchrun)."""
from __future__ import annotations

import os
import sys
import traceback

from phalanx.core.config import load_config
from phalanx.core.runfolder import RunFolder
from phalanx.run.state import StopTraining
from phalanx.run.train import train


def main() -> None:
    code, cfg = 0, None
    try:
        cfg = load_config(sys.argv[1], check_paths=False)
        train(cfg)  # a clean preemption also exits 0
    except BaseException as e:
        trace = traceback.format_exc()
        if isinstance(e, StopTraining):
            print(f"phalanx: {e}", file=sys.stderr)
        else:
            sys.stderr.write(trace)
        if cfg is not None:  # the launcher names this error in its one-line account of the failure
            RunFolder(cfg.run_dir).mark_rank_error(int(os.environ.get("RANK", "0")), e, trace)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: Gloo/DDP destructors at exit can deadlock (DESIGN.md pitfall 2).
    os._exit(code)


if __name__ == "__main__":
    main()
