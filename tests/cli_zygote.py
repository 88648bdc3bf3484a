"""The `phalanx` CLI for the tests' `phalanx(...)` helper, started from a pre-imported process.

A `phalanx` command spends ~8 s of CPU importing torch and transformers before it reads its arguments; the suite
runs ~150 of them. This process imports them once (one per pytest worker and environment), then forks a child per
request: the child takes the request's working folder, environment and argv, writes stdout/stderr to the
request's files, and runs `phalanx.cli.entry()` as `python -m phalanx` does. Workers are still started by the
launcher through torchrun, as fresh processes. Requests: one JSON line each on stdin. Replies on stdout: {"pid"}
once the child runs, then {"rc"}. The child has its own process group, which a timeout kills; torchrun starts
each worker in a session of its own, so a worker blocked in a collective outlives that, as it outlived
subprocess.run's kill. tests/conftest.py keeps one such process per environment, since variables read at import
time would otherwise be stale.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

PRELOAD = ("phalanx.cli", "phalanx.tools.launch", "phalanx.tools.memplan", "transformers",
           "transformers.models.gpt2.modeling_gpt2")


def child(request: dict) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        sys.argv = ["phalanx", *request["argv"]]
        from phalanx.cli import entry

        entry()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def reply(message: dict) -> None:
    sys.__stdout__.write(json.dumps(message) + "\n")
    sys.__stdout__.flush()


def serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"rc": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
