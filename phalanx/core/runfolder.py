"""The run folder's contract, in one place: its paths, the marker files that say how a run ended, the
launcher's outcome.json, and the exit codes. Outside scripts rely on these names (README "Run folder").
Torch-free, so `phalanx report` and `phalanx sweep` can use it.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from phalanx.core.errors import redact

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_HANG, EXIT_PREEMPTED = 0, 1, 2, 3, 75


def write_text(path: Path, text: str, fsync: bool = False) -> None:
    """Write-then-rename: a reader sees the old file, the whole new one, or nothing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj, fsync: bool = False) -> None:
    write_text(path, json.dumps(obj, indent=1), fsync)


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class RunFolder:
    """runs/<name>/: what a run writes, and the markers of how it ended."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.config = self.root / "config.yaml"           # the resolved config the workers read
        self.metrics = self.root / "metrics.jsonl"        # one JSON object per logged step/eval/event
        self.summary = self.root / "summary.json"         # what the run achieved and cost
        self.checkpoints = self.root / "checkpoints"      # step_NNNNNN/ + latest
        self.final = self.root / "final"                  # Hugging Face model + tokenizer
        self.final_tmp = self.root / ".final.tmp"         # final/ while it is written (publish_final)
        self.preempted = self.root / "PREEMPTED"          # stopped cleanly on a signal; resumable
        self.error = self.root / "error.json"             # why the run stopped with an error
        self.hang = self.root / "hang"                    # rank<r>.txt stacks + summary.txt
        self.hang_summary = self.hang / "summary.txt"
        self.errors = self.root / "errors"                # rank<r>.json: a worker's own error, any exception
        self.logs = self.root / "logs"                    # workers' stderr and the elastic agent's log
        self.outcome_file = self.root / "outcome.json"    # the launcher's account of how the run ended

    def publish_final(self) -> None:
        """The export into final_tmp is complete: it becomes final/, replacing an older one."""
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.final_tmp, self.final)

    def clear_outcome(self) -> None:
        """A new attempt starts: forget how the previous one ended."""
        self.preempted.unlink(missing_ok=True)
        self.error.unlink(missing_ok=True)
        shutil.rmtree(self.hang, ignore_errors=True)
        shutil.rmtree(self.errors, ignore_errors=True)
        self.outcome_file.unlink(missing_ok=True)

    def mark_preempted(self, step: int, signal_name: str | None) -> None:
        write_json(self.preempted, {"step": step, "signal": signal_name})

    def mark_error(self, message: str, step: int | None) -> None:
        write_json(self.error, {"error": redact(message), "step": step})

    def mark_rank_error(self, rank: int, error: BaseException, trace: str, lost_peer: bool) -> None:
        """A worker's own account of why it failed, read by the launcher's failure account. `lost_peer`:
        the error is the group's, not this rank's (a peer vanished under a collective)."""
        self.errors.mkdir(parents=True, exist_ok=True)
        first = (str(error).strip().splitlines() or [""])[0]
        kind = type(error)
        write_json(self.errors / f"rank{rank}.json", {
            "rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
            "error": redact(f"{kind.__name__}: {first}".rstrip(": ")),
            "type": kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}",
            "lost_peer": lost_peer, "traceback": redact(trace)})

    def rank_record(self, pid: int) -> dict | None:
        """The error record of this machine's worker with this pid, if it wrote one (several nodes share
        the folder, and a pid is unique only on its machine)."""
        host = socket.gethostname()
        for path in sorted(self.errors.glob("rank*.json")):
            record = read_json(path)
            if isinstance(record, dict) and record.get("pid") == pid and record.get("host", host) == host:
                return record
        return None

    def write_outcome(self, status: str, exit_code: int, line: str, step: int | None, **extra) -> None:
        """How the run ended, in the launcher's words (README "Run folder": the keys)."""
        write_json(self.outcome_file, {"status": status, "exit_code": exit_code, "line": line, "step": step,
                                       "time": round(time.time(), 3), **extra})

    def outcome(self) -> dict | None:
        """outcome.json, or None: a run still going, one whose launcher was killed, or an older run."""
        data = read_json(self.outcome_file)
        return data if isinstance(data, dict) and isinstance(data.get("status"), str) else None

    def last_step(self) -> int | None:
        """The last step metrics.jsonl logged (read from its end; torn lines are skipped)."""
        try:
            with open(self.metrics, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
                tail = f.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(tail):
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int):
                return step
        return None
