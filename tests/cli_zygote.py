"""The `phalanx` CLI for the tests' `phalanx(...)` helper, and its workers, started from pre-imported processes.

A `phalanx` command spends ~8 s of CPU importing torch and transformers before it reads its arguments, and each
worker it starts spends as long again; the suite runs ~150 commands with 2-3 workers each. This process imports
the CLI's modules once (one per pytest worker and environment), then forks a child per request: the child takes
the request's working folder, environment and argv, writes stdout/stderr to the request's files, and runs
`phalanx.cli.entry()` as `python -m phalanx` does. Requests: one JSON line each on stdin. Replies on stdout:
{"pid"} once the child runs, then {"rc"}. The child has its own process group, which a timeout kills.

Workers: the launcher still starts them through torchrun, which runs `$PYTHON_EXEC -u -m phalanx.run.worker
CONFIG` (torchrun's documented override of the interpreter). Here PYTHON_EXEC is a small client (`client`,
no site, no torch) that hands its argv, environment, working folder and stdin/stdout/stderr over a Unix socket to a
second pre-imported process (`serve_workers`, forked from this one after the CLI's imports, with the workers'
own modules imported too); that process forks the worker, which runs the module as `python -m` would. The client
stays the process torchrun watches: it passes on the signals torchrun or a test sends it, and ends as the worker
ended (its exit code, or killed by the same signal); when the client dies first (SIGKILL), the worker is killed.
The worker's error record names the client's pid, the one torchrun knows, as a worker's own pid would be.
A command's own `sys.executable -m phalanx ...` children (a sweep's trial launchers, bench's runs) go through the
same client, so they too start pre-imported; the client gives the worker its CPU affinity (a sweep slot's cores).
Commands run with an `env` of their own (tests/conftest.py) start everything fresh, as users do.

tests/conftest.py keeps one such process per environment, since variables read at import time would otherwise
be stale; torchrun starts each worker in a session of its own, so a worker blocked in a collective outlives a
timeout's kill, as it outlived subprocess.run's.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

PRELOAD = ("phalanx.cli", "phalanx.tools.launch", "phalanx.tools.memplan", "transformers",
           "transformers.models.gpt2.modeling_gpt2")
# What workers import as they go (importing all of phalanx's run, tasks, model and data packages covers phalanx)
WORKER_PRELOAD = ("phalanx.run", "phalanx.tasks", "phalanx.model", "phalanx.data", "ctypes", "runpy", "peft",
                  "transformers.masking_utils", "transformers.modeling_layers", "transformers.activations",
                  "transformers.convert_slow_tokenizer", "transformers.generation",
                  "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama",
                  "transformers.models.qwen2.modeling_qwen2", "transformers.models.bert.modeling_bert",
                  "torch.distributed.fsdp", "torch.distributed.checkpoint")
FORWARDED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


def redirect_std() -> None:
    """sys.stdout/stderr on fds 1 and 2 as `python -u` makes them (unbuffered, written through)."""
    import io

    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")


def end(run) -> None:
    """Run `run()` as the interpreter runs a program, then end this forked process with its exit code."""
    code = 1
    try:
        run()
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


def child(request: dict, python_exec: str) -> None:
    def run() -> None:
        os.setpgid(0, 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["PYTHON_EXEC"] = python_exec  # torchrun starts the workers through the worker zygote
        stdin = os.open(request.get("in") or os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        sys.argv = ["phalanx", *request["argv"]]
        # the interpreter of the processes the command starts as `sys.executable -m phalanx ...` (a sweep's
        # trials, bench's runs): they come from the worker zygote too
        sys.executable = python_exec
        from phalanx.cli import entry

        entry()
    end(run)


def reply(message: dict) -> None:
    sys.__stdout__.write(json.dumps(message) + "\n")
    sys.__stdout__.flush()


def serve() -> None:
    import atexit
    import shutil
    import socket
    import tempfile

    for name in PRELOAD:
        importlib.import_module(name)
    folder = tempfile.mkdtemp(prefix="phalanx-zygote-")
    owner = os.getpid()  # a forked child that ends through atexit must not remove it
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, True))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(folder, "workers.sock"))
    listener.listen(64)  # clients queue here while the worker zygote still imports
    python_exec = os.path.join(folder, "python")
    with open(python_exec, "w", encoding="utf-8") as f:
        f.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                f"from cli_zygote import client\nclient({listener.getsockname()!r})\n")
    os.chmod(python_exec, 0o755)
    if os.fork() == 0:
        end(lambda: serve_workers(listener))
    listener.close()
    reply({"ready": True, "python_exec": python_exec})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request, python_exec)
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"rc": os.waitstatus_to_exitcode(status)})


def die_with_parent() -> None:
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve_workers(listener) -> None:
    """Fork a worker per client connection; tell each client its worker's pid, then how the worker ended; kill
    a worker whose client went away. One thread (forking a multi-threaded process is not safe)."""
    import selectors
    import signal
    import socket
    import threading

    die_with_parent()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # this process's stdout is the CLI zygote's reply stream
    for name in WORKER_PRELOAD:
        module = importlib.import_module(name)
        if name.startswith("phalanx.") and hasattr(module, "__path__"):
            import pkgutil

            for info in pkgutil.walk_packages(module.__path__, name + "."):
                importlib.import_module(info.name)
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, "forking needs one thread"
    threads = __import__("torch").get_num_threads()  # a fresh worker's default, unless OMP_NUM_THREADS says
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    conns: dict[int, socket.socket] = {}  # worker pid -> its client's connection
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                request, fds = receive(conn)
                pid = os.fork()
                if pid == 0:
                    inherited = [listener, conn, *conns.values(), selector]
                    end(lambda: worker(request, fds, threads, inherited, wake_r, wake_w))  # noqa: B023 - runs now
                for fd in fds:
                    os.close(fd)
                conns[pid] = conn
                conn.sendall(f"{pid}\n".encode())
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
            elif not key.fileobj.recv(1):  # the client died: so does its worker
                selector.unregister(key.fileobj)
                try:
                    os.kill(key.data, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while conns:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = conns.pop(pid)
            if any(key.fileobj is conn for key in selector.get_map().values()):
                selector.unregister(conn)
            try:
                conn.sendall(f"{status}\n".encode())
            except OSError:  # the client went first
                pass
            conn.close()


def receive(conn) -> tuple[dict, list[int]]:
    import socket
    import struct

    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    size, body = struct.unpack("!Q", head)[0], b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), fds


def worker(request: dict, fds: list[int], threads: int, inherited: list, wake_r: int, wake_w: int) -> None:
    """Become the process the client was asked to be: `[-u] -m MODULE ARGS` or `-u SCRIPT ARGS`, run as python
    runs them (the client starts anything else as a fresh interpreter)."""
    import runpy
    import signal
    import types

    os.setsid()
    die_with_parent()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for each in inherited:  # the sockets and the selector of the worker zygote
        each.close()
    os.close(wake_r)
    os.close(wake_w)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.sched_setaffinity(0, request["cpus"])  # what the client's starter (a sweep's slot) gave it
    kind, argv = routable(request["argv"])
    redirect_std()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads)))
    import phalanx.core.runfolder as runfolder

    client_pid = request["pid"]  # the error record names the pid torchrun started and knows
    runfolder.os = types.SimpleNamespace(**{**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")},
                                            "getpid": lambda: client_pid})
    if kind == "module":  # a worker, or a launcher (a sweep's trial: `python -m phalanx train ...`)
        sys.argv = argv
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:  # a script (tests/lora_worker.py)
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def routable(argv: list[str]) -> tuple[str | None, list[str]]:
    """("module", [MODULE, *ARGS]) for `[-u] -m MODULE ARGS`, ("script", [SCRIPT, *ARGS]) for `-u SCRIPT ARGS`,
    else (None, argv): a command the worker zygote does not run (the client execs a fresh interpreter)."""
    rest = argv[1:] if argv[:1] == ["-u"] else argv
    if len(rest) >= 2 and rest[0] == "-m":
        return "module", rest[1:]
    if argv[:1] == ["-u"] and rest and not rest[0].startswith("-"):
        return "script", rest
    return None, argv


def client(path: str) -> None:
    """PYTHON_EXEC: have the worker zygote at `path` run this command, and end as that worker ends."""
    import signal
    import socket
    import struct

    if routable(sys.argv[1:])[0] is None:  # e.g. multiprocessing's spawn: its inherited fds stay as they are
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    body = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid(),
                       "cpus": sorted(os.sched_getaffinity(0))}).encode()
    socket.send_fds(sock, [struct.pack("!Q", len(body))], [0, 1, 2])
    sock.sendall(body)
    replies = sock.makefile("rb")
    pid = int(replies.readline())

    def forward(signum, frame) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    line = replies.readline()
    if not line:  # the worker zygote died
        os._exit(1)
    status = int(line)
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) != signal.SIGKILL:  # (its handler cannot be set)
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    serve()
