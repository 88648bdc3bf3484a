"""`phalanx sweep SWEEP.yaml`: a study in Optuna whose trials are ordinary multi-process `phalanx train` runs.

The sweep process alone talks to Optuna: it asks for a trial, decides its parameters, and starts
`phalanx train BASE OVERRIDES --run-dir SWEEP/trials/NNNN --nproc-per-node N` as a child in its own
session, so ranks never sample anything. It follows each trial's metrics.jsonl, reports the eval metric
to Optuna, and stops a pruned trial with SIGTERM (the run checkpoints and exits 75). Ctrl-C or SIGTERM
stops every trial the same way and leaves it RUNNING and marked interrupted in the storage; the same
command later resumes those trials in their folders (from their checkpoints) before starting new ones.

Several sweep processes (on several machines) may share one storage. Each keeps a heartbeat (a user
attribute, refreshed while its trial runs): a RUNNING trial is taken over only when it was interrupted or
its heartbeat is older than `heartbeat_grace_s`. (Optuna's own heartbeat exists only for SQL storages and
fails stale trials instead of resuming them.) Grid samplers may hand the same point to two processes at
once; the storage decides: of two trials with the same parameters and seed the later one is dropped
(recorded FAIL with `duplicate_of`, not counted, never run).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from phalanx.core.config import ConfigError
from phalanx.core.host import cores as available_cores
from phalanx.core.host import gpu_ids
from phalanx.core.runfolder import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, RunFolder, read_json, write_text
from phalanx.tools.sweepspec import Sweep, load_sweep, override

POLL_S = 0.5
HEARTBEAT_S = 10.0
STOP_WAIT_S = 180.0  # a trial's checkpoint on SIGTERM; then it is killed


@dataclass
class Slot:
    """Where one trial runs: its CPU cores (affinity) or GPUs, and threads per worker."""
    cores: list[int]
    gpus: list[str]     # CUDA_VISIBLE_DEVICES entries
    threads: int


@dataclass
class Running:
    number: int
    trial_id: int
    folder: Path
    proc: subprocess.Popen
    slot: Slot
    started: float
    offset: int = 0           # bytes of metrics.jsonl read so far
    step: int = 0             # last training step seen
    pruned: bool = False
    beat: float = 0.0
    reported: set = field(default_factory=set)


def plan_slots(sweep: Sweep, gpus: list[str], oversubscribe: bool, cpus: list[int] | None = None) -> list[Slot]:
    """Split this machine between `parallel` trials of `nproc_per_trial` processes each. `gpus` are the
    devices this sweep may use, as CUDA_VISIBLE_DEVICES entries (host.gpu_ids: the scheduler's own list,
    UUIDs and MIG names included); a trial gets its own sub-list, its processes distinct GPUs."""
    k, n = sweep.parallel, sweep.nproc_per_trial
    cpus = cpus if cpus is not None else sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(available_cores()))
    if gpus:
        if n > len(gpus) or (k * n > len(gpus) and not oversubscribe):
            raise ConfigError(f"parallel {k} x nproc_per_trial {n} = {k * n} processes but {len(gpus)} GPU(s) here; "
                              f"lower them" + ("" if n > len(gpus) else " or pass --oversubscribe"))
        # oversubscribed: trials share GPUs, but the n processes of one trial never do (NCCL refuses it)
        threads = max(1, len(cpus) // (k * n))  # the trials' workers share the host's cores
        return [Slot(cores=[], gpus=[gpus[(i * n + j) % len(gpus)] for j in range(n)], threads=threads)
                for i in range(k)]
    if k * n > len(cpus) and not oversubscribe:
        raise ConfigError(f"parallel {k} x nproc_per_trial {n} = {k * n} processes but {len(cpus)} CPU core(s) "
                          f"here; lower them or pass --oversubscribe")
    per = max(1, len(cpus) // k)
    return [Slot(cores=cpus[i * per:(i + 1) * per] if len(cpus) >= k else cpus, gpus=[],
                 threads=max(1, per // n)) for i in range(k)]


def open_storage(spec: str | None, out: Path):
    """Default: Optuna's journal file in the sweep folder. A URL with '://' is SQLAlchemy (e.g.
    postgresql://..., sqlite:///...); anything else is a journal file path (shared file systems: NFS too)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    if spec and "://" in spec:
        return optuna.storages.RDBStorage(spec)
    path = Path(spec) if spec else out / "study.journal"
    path.parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))


class SweepRunner:
    def __init__(self, sweep: Sweep, out: Path, storage, slots: list[Slot], quiet: bool = False):
        import optuna

        self.optuna, self.sweep, self.out, self.slots, self.quiet = optuna, sweep, out, slots, quiet
        self.storage = storage  # trial attributes are read and written through it by trial id
        self.study = optuna.create_study(storage=storage, study_name=sweep.name, sampler=sweep.make_sampler(),
                                         pruner=sweep.make_pruner(), direction=sweep.direction, load_if_exists=True)
        self.me = f"{os.uname().nodename}:{os.getpid()}"
        self.running: dict[int, Running] = {}  # slot index -> trial
        self.stop: str | None = None

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            while True:
                self._poll()
                if self.stop:
                    self._stop_all()
                    break
                for index in [i for i in range(len(self.slots)) if i not in self.running]:
                    started = self._start_next(index)
                    if not started:
                        break
                if not self.running:
                    break
                time.sleep(POLL_S)
        finally:
            self.write_results()
        counts = self._counts()
        if self.stop:
            self._say(f"sweep: interrupted ({self.stop}); {counts['RUNNING']} trial(s) saved a checkpoint and "
                      f"resume when the same command runs again")
            return EXIT_PREEMPTED
        self._say(f"sweep: done: {self._progress_text(counts)}; results in {self.out}/trials.jsonl, "
                  f"summary.json, best.yaml; next: phalanx report {self.out}")
        return EXIT_OK if counts["COMPLETE"] else EXIT_FAILED

    def _on_signal(self, signum, frame) -> None:
        self.stop = signal.Signals(signum).name

    # ---- choosing the next trial -------------------------------------------------------------
    def _trials(self):
        return [t for t in self.study.get_trials(deepcopy=False) if "duplicate_of" not in t.user_attrs]

    def _start_next(self, index: int) -> bool:
        trial = self._take_over() or self._new_trial()
        if trial is None:
            return False
        self._launch(index, trial)
        return True

    def _take_over(self):
        """An interrupted trial, or one whose sweep process stopped beating: run it again in its folder."""
        mine = {r.number for r in self.running.values()}
        now = time.time()
        for t in self._trials():
            if t.state != self.optuna.trial.TrialState.RUNNING or t.number in mine or "overrides" not in t.user_attrs:
                continue
            stale = now - t.user_attrs.get("heartbeat", 0) > self.sweep.heartbeat_grace_s
            if not (t.user_attrs.get("interrupted") or stale):
                continue
            claim = f"{self.me}:{now}"
            self.storage.set_trial_user_attr(t._trial_id, "owner", claim)
            time.sleep(1.0)  # two processes claiming at once: the last writer wins, the other backs off
            if self.storage.get_trial(t._trial_id).user_attrs.get("owner") == claim:
                return t
        return None

    def _new_trial(self):
        trials = self._trials()
        counted = [t for t in trials if t.state != self.optuna.trial.TrialState.WAITING]
        if len(counted) >= self.sweep.trials:
            return None
        trial = self.study.ask()
        seed = trial.user_attrs.get("seed")
        if self.sweep.seeds and seed is None:  # a new configuration: its other seeds follow as queued trials
            seed = self.sweep.seeds[0]
            trial.set_user_attr("seed", seed)
        params = {p.key: p.suggest(trial) for p in self.sweep.space}
        trial.set_user_attr("ready", True)
        duplicate = self._duplicate_of(trial.number, params, seed)
        if duplicate is not None:
            trial.set_user_attr("duplicate_of", duplicate)
            self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
            return self._new_trial()
        if self.sweep.seeds and seed == self.sweep.seeds[0]:
            for other in self.sweep.seeds[1:]:
                self.study.enqueue_trial(params, user_attrs={"seed": other})
        trial.set_user_attr("overrides", self.sweep.trial_overrides(params, seed))
        trial.set_user_attr("run_dir", str(self.out / "trials" / f"{trial.number:04d}"))
        trial.set_user_attr("owner", self.me)
        return self.storage.get_trial(trial._trial_id)

    def _duplicate_of(self, number: int, params: dict, seed) -> int | None:
        """The lower-numbered live trial with the same point, if any (waiting a moment for one still being
        written by another process)."""
        deadline = time.time() + 5.0
        while True:
            pending = False
            for t in self.study.get_trials(deepcopy=False):
                if t.number >= number or "duplicate_of" in t.user_attrs or t.state.name == "FAIL":
                    continue
                if t.state.name == "RUNNING" and not t.user_attrs.get("ready"):
                    pending = True
                    continue
                if t.params == params and t.user_attrs.get("seed") == seed and t.state.name != "WAITING":
                    return t.number
            if not pending or time.time() > deadline:
                return None
            time.sleep(0.2)

    # ---- running trials ----------------------------------------------------------------------
    def _launch(self, index: int, trial) -> None:
        slot = self.slots[index]
        folder = Path(trial.user_attrs["run_dir"])
        folder.mkdir(parents=True, exist_ok=True)
        self.storage.set_trial_user_attr(trial._trial_id, "interrupted", False)
        self.storage.set_trial_user_attr(trial._trial_id, "heartbeat", time.time())
        overrides = [*trial.user_attrs["overrides"], override("name", f"{self.sweep.name}-{trial.number:04d}")]
        env = dict(os.environ)
        if slot.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slot.gpus)
        # not a training-relevant key: a trial resumes under another packing
        overrides.append(override("dist.threads_per_worker", slot.threads))
        env["OMP_NUM_THREADS"] = str(slot.threads)
        cmd = [sys.executable, "-m", "phalanx", "train", *([self.sweep.config] if self.sweep.config else []),
               *overrides, "--run-dir", str(folder), "--nproc-per-node", str(self.sweep.nproc_per_trial)]
        log = open(folder / "sweep-trial.log", "a")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, slot.cores)) if slot.cores else None)
        log.close()
        self.running[index] = Running(trial.number, trial._trial_id, folder, proc, slot, time.time(), beat=time.time(),
                                      reported=set(trial.intermediate_values))
        where = f"GPUs {slot.gpus}" if slot.gpus else f"cores {slot.cores[0]}-{slot.cores[-1]}" if slot.cores else ""
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
        seed = f", seed {trial.user_attrs['seed']}" if "seed" in trial.user_attrs else ""
        resumed = " (resumed)" if (folder / "checkpoints").is_dir() else ""
        self._say(f"sweep: trial {trial.number}{resumed}: {params}{seed}; {where} -> {folder}")

    def _poll(self) -> None:
        for index, r in list(self.running.items()):
            self._follow(r)
            if time.time() - r.beat > HEARTBEAT_S:
                self.storage.set_trial_user_attr(r.trial_id, "heartbeat", time.time())
                r.beat = time.time()
            if r.proc.poll() is not None:
                del self.running[index]
                self._finish(r)
                self.write_results()

    def _follow(self, r: Running) -> None:
        """Report new eval values to Optuna; SIGTERM the trial when the pruner says so."""
        path = RunFolder(r.folder).metrics
        if not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(r.offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        r.offset += len(complete)
        trial = None
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                m = json.loads(line)
            except ValueError:
                continue
            step = m.get("step")
            if not isinstance(step, int):
                continue
            r.step = max(r.step, step)
            value = m.get(self.sweep.metric)
            if isinstance(value, (int, float)) and step not in r.reported and not r.pruned:
                trial = trial or self.optuna.trial.Trial(self.study, r.trial_id)
                trial.report(float(value), step)
                r.reported.add(step)
                if trial.should_prune():
                    r.pruned = True
                    self._say(f"sweep: trial {r.number} pruned at step {step} ({self.sweep.metric} {value:.4g})")
                    r.proc.send_signal(signal.SIGTERM)

    def _finish(self, r: Running) -> None:
        storage, state = self.storage, self.optuna.trial.TrialState
        storage.set_trial_user_attr(r.trial_id, "steps", r.step)
        storage.set_trial_user_attr(r.trial_id, "wall_time_s",
                                    round(storage.get_trial(r.trial_id).user_attrs.get("wall_time_s", 0)
                                          + time.time() - r.started, 3))
        code = r.proc.returncode
        if r.pruned and code != EXIT_OK:  # (a trial that finished before the SIGTERM landed is COMPLETE)
            storage.set_trial_user_attr(r.trial_id, "pruned_at_step", r.step)
            self.study.tell(r.number, state=state.PRUNED)
        elif code == EXIT_PREEMPTED or (self.stop and code != EXIT_OK):  # stopped by us (or preempted)
            storage.set_trial_user_attr(r.trial_id, "interrupted", True)  # resumes on the next run
        elif code == EXIT_OK:
            value = (read_json(RunFolder(r.folder).summary) or {}).get(self.sweep.metric)
            if isinstance(value, (int, float)):
                self.study.tell(r.number, float(value))  # NaN -> FAIL (Optuna)
            else:
                self._fail(r, f"no {self.sweep.metric} in {RunFolder(r.folder).summary}")
        else:
            self._fail(r, _reason(r.folder, code, since=r.started))
        self._say(f"sweep: trial {r.number} {self._state_word(r)}; {self._progress_text(self._counts())}")

    def _fail(self, r: Running, reason: str) -> None:
        self.storage.set_trial_user_attr(r.trial_id, "reason", reason)
        self.study.tell(r.number, state=self.optuna.trial.TrialState.FAIL)

    def _state_word(self, r: Running) -> str:
        t = self.storage.get_trial(r.trial_id)
        if t.state.name == "COMPLETE":
            return f"complete: {self.sweep.metric} {t.value:.4g}"
        if t.state.name == "FAIL":
            return f"failed: {t.user_attrs.get('reason', 'non-finite metric')}"
        if t.state.name == "PRUNED":
            return f"pruned (stopped cleanly at step {r.step})"
        return f"interrupted at step {r.step}"

    def _stop_all(self) -> None:
        for r in self.running.values():
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + STOP_WAIT_S
        for index, r in list(self.running.items()):
            try:
                r.proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
            self._follow(r)
            del self.running[index]
            self._finish(r)

    # ---- results -----------------------------------------------------------------------------
    def _counts(self) -> dict:
        counts = dict.fromkeys(("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING"), 0)
        for t in self._trials():
            counts[t.state.name] = counts.get(t.state.name, 0) + 1
        return counts

    def _progress_text(self, counts: dict) -> str:
        done = counts["COMPLETE"] + counts["PRUNED"] + counts["FAIL"]
        best = best_trial(self.rows(), self.sweep.direction)
        tail = f"; best {self.sweep.metric} {best['value']:.4g} (trial {best['number']})" if best else ""
        return (f"{done}/{self.sweep.trials} done ({counts['COMPLETE']} complete, {counts['PRUNED']} pruned, "
                f"{counts['FAIL']} failed), {counts['RUNNING']} running{tail}")

    def rows(self) -> list[dict]:
        rows = []
        for t in self._trials():
            if t.state.name == "WAITING":
                continue
            a = t.user_attrs
            rows.append({"number": t.number, "params": t.params, "seed": a.get("seed"), "state": t.state.name,
                         "value": t.value if t.state.name == "COMPLETE" else None,
                         "steps": a.get("steps", max(t.intermediate_values, default=0)),
                         "wall_time_s": a.get("wall_time_s"), "run_dir": a.get("run_dir"),
                         "reason": a.get("reason"), "pruned_at_step": a.get("pruned_at_step"),
                         "interrupted": bool(a.get("interrupted")) if t.state.name == "RUNNING" else None,
                         "evals": {str(k): v for k, v in sorted(t.intermediate_values.items())}})
        return rows

    def write_results(self) -> None:
        rows = self.rows()
        write_text(self.out / "trials.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        configs = group_by_config(rows, self.sweep.direction)
        best = best_trial(rows, self.sweep.direction)
        summary = {"study": self.sweep.name, "metric": self.sweep.metric, "direction": self.sweep.direction,
                   "sampler": self.sweep.sampler, "pruner": self.sweep.pruner, "trials_planned": self.sweep.trials,
                   "counts": self._counts(), "best": best, "configs": configs}
        write_text(self.out / "summary.json", json.dumps(summary, indent=1) + "\n")
        best_config = Path(best["run_dir"]) / "config.yaml" if best else None
        if best_config and best_config.exists():  # (a trial of another machine may live elsewhere)
            cfg = yaml.safe_load(best_config.read_text())
            cfg.update(name=f"{self.sweep.name}-best", run_dir="", resume="auto")
            write_text(self.out / "best.yaml", f"# best trial {best['number']} of sweep {self.sweep.name}: "
                       f"{self.sweep.metric} {best['value']:.6g}\n" + yaml.safe_dump(cfg, sort_keys=False))

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)


def group_by_config(rows: list[dict], direction: str) -> list[dict]:
    """Completed trials grouped by parameters (seeds together): mean, spread, n; best mean first."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["state"] == "COMPLETE":
            groups.setdefault(json.dumps(r["params"], sort_keys=True), []).append(r)
    out = [{"params": g[0]["params"], "mean": statistics.fmean(r["value"] for r in g),
            "std": statistics.stdev([r["value"] for r in g]) if len(g) > 1 else 0.0, "n": len(g),
            "trials": [r["number"] for r in g]} for g in groups.values()]
    return sorted(out, key=lambda c: c["mean"], reverse=direction == "maximize")


def best_trial(rows: list[dict], direction: str) -> dict | None:
    """The best configuration's (by mean over seeds) best trial."""
    configs = group_by_config(rows, direction)
    if not configs:
        return None
    members = [r for r in rows if r["number"] in configs[0]["trials"]]
    best = sorted(members, key=lambda r: r["value"], reverse=direction == "maximize")[0]
    return {"number": best["number"], "value": best["value"], "params": best["params"], "seed": best["seed"],
            "mean_over_seeds": configs[0]["mean"], "run_dir": best["run_dir"]}


def _reason(folder: Path, code: int, since: float) -> str:
    """The trial's one-line account: its launcher's RUN/outcome.json `line` (written after `since`, when
    the trial started). Without one — a command refused before it started (exit 2 writes nothing in the
    run folder, so its one line is the console's last), or a launcher that was itself killed — the
    console's last line."""
    outcome = RunFolder(folder).outcome()
    if outcome and outcome.get("line") and outcome.get("time", 0) >= since:
        return outcome["line"]
    log = folder / "sweep-trial.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    if lines and lines[-1].startswith("phalanx: "):
        return lines[-1][len("phalanx: "):]
    return f"exit code {code}" + (f": {lines[-1]}" if lines else "")


def _visible_gpus() -> list[str]:
    try:
        import torch  # only here: the rest of the sweep needs no torch
        count = torch.cuda.device_count()
    except ImportError:
        count = 0
    return gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), count) if count else []


def add_arguments(p) -> None:
    p.add_argument("sweep", metavar="SWEEP.yaml", help="the sweep file (see docs/training.md, Sweeps)")
    p.add_argument("--parallel", type=int, default=None, help="trials at once (default: the file's parallel)")
    p.add_argument("--trials", type=int, default=None, help="trials in all (default: the file's trials)")
    p.add_argument("--out", default=None, help="sweep folder (default sweeps/<sweep file name>)")
    p.add_argument("--storage", default=None,
                   help="Optuna storage shared by several sweep processes: a SQLAlchemy URL (postgresql://..., "
                        "sqlite:///...) or a journal file path (default: SWEEP/study.journal)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow parallel x nproc_per_trial beyond this machine's cores or GPUs")


def run(args) -> int:
    sweep = load_sweep(args.sweep, parallel=args.parallel, trials=args.trials)
    out = Path(args.out) if args.out else Path("sweeps") / sweep.name
    slots = plan_slots(sweep, _visible_gpus(), args.oversubscribe)
    _check_same_sweep(sweep, out)
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    runner = SweepRunner(sweep, out, open_storage(args.storage, out), slots)
    return runner.run()


def _check_same_sweep(sweep: Sweep, out: Path) -> None:
    """A sweep folder belongs to one search: refuse a changed space/metric/base (parallel, trials may change)."""
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = {"config": sweep.config, "overrides": sweep.overrides, "metric": sweep.metric,
                   "direction": sweep.direction, "sampler": sweep.sampler, "seeds": sweep.seeds,
                   "space": [vars(p) for p in sweep.space]}
    saved = read_json(out / "sweep.json")
    if saved and saved != fingerprint:
        changed = sorted(k for k in fingerprint if saved.get(k) != fingerprint[k])
        raise ConfigError(f"sweep folder '{out}' holds a different sweep (changed: {', '.join(changed)}); "
                          f"use another --out")
    write_text(out / "sweep.json", json.dumps(fingerprint, indent=1) + "\n")
    write_text(out / "sweep.yaml", sweep.path.read_text())
