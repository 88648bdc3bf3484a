"""The one entry point of a worker process, however it was started.

    python -m phalanx.run.worker RUN/config.yaml     started by phalanx's launcher (tools/launch.py)
    phalanx train CONFIG  under an outside torchrun/srun, through launch.run_as_worker -> serve()

Either way a failing worker records its own error (RUN/errors/rank<r>.json: the launcher's failure account
reads it) and the process ends with os._exit, skipping the interpreter teardown in which Gloo/DDP
destructors can deadlock (4 hangs in 12 launches on this machine; 0 in 12 without it).
"""
from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as tdist

from phalanx.core.config import Config, ConfigError, load_config
from phalanx.core.runfolder import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, RunFolder
from phalanx.run.state import StopTraining
from phalanx.run.train import train

# What Gloo and NCCL say when the other end of a collective went away. Torch raises these as a plain
# RuntimeError from Gloo (torch 2.13: "[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection
# reset by peer ... GLHF!") and as DistBackendError from NCCL, hence the type first, the words second.
_PEER_GONE = re.compile(r"gloo/transport|connection (closed|reset|refused) by peer|connection reset|broken pipe|"
                        r"connectFullMesh|NCCL communicator was aborted|ncclRemoteError|remote process exited",
                        re.IGNORECASE)


def is_lost_peer(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) is a collective failing because a peer vanished:
    a consequence of another rank's failure, not a cause (see tools/failures.py)."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, tdist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
            return True
        if isinstance(error, RuntimeError) and _PEER_GONE.search(str(error)):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def serve(load: Callable[[], Config], preempted_code: int) -> NoReturn:
    """Load the config, train, end the process. `preempted_code`: the exit code of a clean preemption,
    0 under phalanx's launcher (which reads the PREEMPTED marker; any other code is a failure to the
    elastic agent), 75 under an outside torchrun/srun (the scheduler sees it)."""
    code, cfg = EXIT_OK, None
    try:
        cfg = load()
        summary = train(cfg)
        code = preempted_code if summary.get("preempted") else EXIT_OK
    except BaseException as e:  # noqa: BLE001 - every error is recorded, then the process ends
        trace = traceback.format_exc()
        if isinstance(e, (StopTraining, ConfigError)):
            print(f"phalanx: {'error: ' if isinstance(e, ConfigError) else ''}{e}", file=sys.stderr)
        else:
            sys.stderr.write(trace)
        if cfg is not None:  # the launcher names this error in its one-line account of the failure
            RunFolder(cfg.run_dir).mark_rank_error(int(os.environ.get("RANK", "0")), e, trace, is_lost_peer(e))
        code = EXIT_BAD_INPUT if isinstance(e, ConfigError) else EXIT_FAILED
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C before the loop's own SIGINT handler: as the CLI says it
            code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> NoReturn:
    path = sys.argv[1]
    serve(lambda: load_config(path, check_paths=False), preempted_code=EXIT_OK)


if __name__ == "__main__":
    main()
