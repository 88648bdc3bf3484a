"""Command-line interface: argument parsing and subcommand dispatch only."""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import threading
from pathlib import Path

from phalanx.core.config import ConfigError
from phalanx.core.runfolder import EXIT_BAD_INPUT

# Subcommands implemented in their own modules: each has add_arguments(parser) and run(args) -> int.
# Only the chosen one is imported, so e.g. `phalanx report` never pays for (or needs) torch.
EXTRA_COMMANDS = {"report": ("phalanx.tools.report", "plots and a Markdown summary of one or more runs"),
                  "bench": ("phalanx.tools.bench", "scaling study: the same config at several world sizes"),
                  "doctor": ("phalanx.tools.doctor", "pre-flight checks of the distributed set-up"),
                  "predict": ("phalanx.tools.predict", "predict with a trained classifier or tagger (RUN/final)"),
                  "generate": ("phalanx.tools.generate", "sample text from a trained language model (RUN/final)"),
                  "chat": ("phalanx.tools.chat", "talk to a trained chat model (RUN/final), or answer one --message"),
                  "sweep": ("phalanx.tools.sweep", "hyperparameter search whose trials are multi-process runs "
                            "(Optuna)")}


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    config, overrides = None, []
    for item in items:
        if "=" in item or config is not None:
            overrides.append(item)
        else:
            config = item
    return config, overrides


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                   help="a YAML config (default: the built-in one) and dotted overrides such as train.lr=3e-4")
    p.add_argument("--nproc-per-node", default="auto", help="worker processes on this node; auto = one per "
                   "visible GPU with NCCL, else 1")
    p.add_argument("--nnodes", default="1", help="nodes, N or MIN:MAX for elastic membership")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default="", help="job id shared by all nodes of a run (multi-node)")
    p.add_argument("--run-dir", default=None, help="run folder (default runs/<name>)")
    p.add_argument("--max-restarts", type=int, default=0, help="elastic restarts after a worker failure")
    p.add_argument("--resume", default=None, metavar="PATH", help="resume from this checkpoint folder")
    p.add_argument("--fresh", action="store_true", help="start over; the old run folder is moved aside")
    p.add_argument("--force-resume", action="store_true",
                   help="resume even if training-relevant settings changed")


def cmd_train(args) -> int:
    from phalanx.core.config import load_config

    config, overrides = _split_config_and_overrides(args.items)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    if args.resume:
        if not Path(args.resume).is_dir():
            raise ConfigError(f"--resume: checkpoint folder '{args.resume}' not found")
        overrides.append(f"resume={args.resume}")
    if args.fresh:
        overrides.append("resume=auto")
    cfg = load_config(config, overrides)
    nproc = None if args.nproc_per_node == "auto" else nproc_per_node(args.nproc_per_node, cfg.dist.backend)
    # torch only now: a bad key or flag is refused in a fraction of a second
    from phalanx.core import dist
    from phalanx.tools.launch import launch, run_as_worker

    # Started by torchrun/srun as one worker: be it. Launcher flags mean "start my own workers", which
    # a Slurm job with one task per node or a Kubernetes pod (whose operator sets RANK/WORLD_SIZE) asks for.
    launcher_flags = args.nnodes != "1" or args.rdzv_endpoint or args.nproc_per_node != "auto"
    if (dist.under_torchrun() or dist.under_srun()) and not launcher_flags:
        return run_as_worker(cfg)
    nproc = nproc or nproc_per_node(args.nproc_per_node, cfg.dist.backend)
    return launch(cfg, nproc, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint,
                  rdzv_id=args.rdzv_id, max_restarts=args.max_restarts, fresh=args.fresh,
                  force_resume=args.force_resume)


def nproc_per_node(value: str, backend: str) -> int:
    """--nproc-per-node: a whole number, or auto (one per visible GPU with NCCL, else 1; said on stdout)."""
    if value == "auto":
        from phalanx.core import dist

        n, why = dist.auto_nproc(dist.pick_backend(backend))
        print(f"phalanx: --nproc-per-node auto = {n} ({why})", flush=True)
        return n
    if not value.isdigit():
        raise ConfigError(f"--nproc-per-node: expected a whole number >= 1 or auto, got {value!r}")
    if int(value) < 1:
        raise ConfigError(f"--nproc-per-node: expected a whole number >= 1, got {value}")
    return int(value)


def cmd_prepare(args) -> int:
    from phalanx.core.config import (
        load_config,  # lazy, like every command's modules: only the chosen one loads
    )
    from phalanx.core.registry import TASKS
    from phalanx.data import units
    from phalanx.data.prepare import describe
    from phalanx.tasks import get_task, prepare_data
    from phalanx.tools.launch import resolve_pretrained

    if args.workers < 0 or args.show < 0:
        raise ConfigError(f"--workers and --show: expected >= 0, got {args.workers} and {args.show}")
    config, overrides = _split_config_and_overrides(args.items)
    cfg = resolve_pretrained(load_config(config, overrides))  # a GGUF base: its tokenizer is in its folder
    shows = {t.name: t.shows for t in TASKS.values() if t.shows}
    if args.show and cfg.task not in shows:
        raise ConfigError(f"--show: prints {' or '.join(f'{v} (task {k})' for k, v in shows.items())}; this "
                          f"config's task is '{cfg.task}'")
    for summary in prepare_data(cfg, args.workers, progress=not args.quiet).values():
        if summary.get("reused"):  # a split prepared now was said by the pipeline as it finished (the launcher's
            print(f"phalanx: {describe(summary)}")  # log line): once each, in one summary shape for every task
    if args.show:
        fmt = get_task(cfg.task).FORMAT  # a format that shows its own rows (token_classify), or a store of units
        print(fmt.show(cfg, args.show) if hasattr(fmt, "show") else units.show(cfg, fmt, args.show))
    return 0


def cmd_config(args) -> int:
    import yaml

    from phalanx.core.config import describe, describe_markdown, load_config, shown_dict

    config, overrides = _split_config_and_overrides(args.items)
    if args.show:  # with a config or task=...: what that task reads; else every key
        task = load_config(config, overrides, check_paths=False).task if args.items else None
        print("\n".join(describe_markdown() if args.markdown else describe(task=task)).lstrip())
        return 0
    print(yaml.safe_dump(shown_dict(load_config(config, overrides)), sort_keys=False), end="")  # a URL's secret hidden
    return 0


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx", description="Distributed data-parallel NLP training.",
                                     epilog="'phalanx COMMAND --help' lists a command's options.")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    p = sub.add_parser("train", help="train (launches workers through torch.distributed.run)")
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("prepare", help="only the data step: tokenizer + token stores (train runs it when missing)")
    p.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]")
    p.add_argument("--workers", type=int, default=0, help="encoding processes (default data.prepare_workers, "
                   "0 = the available cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--show", type=int, default=0, metavar="N", help="chat, preference: print N rendered training "
                   "conversations (pairs: the prompt and both replies) with the supervised tokens marked [[like "
                   "this]], to check a template before a long run; token_classify: N training sentences, each word "
                   "beside its subwords and label, per window")
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("config", help="print the resolved config, or every field with its doc (--show)")
    p.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]")
    p.add_argument("--show", action="store_true", help="list every config key with type, default and doc (with a "
                   "config or task=NAME: the keys that task reads)")
    p.add_argument("--markdown", action="store_true", help="with --show: as a Markdown table (as in docs/config.md)")
    p.set_defaults(func=cmd_config)
    for name, (module, help_text) in EXTRA_COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == selected:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    if command is None and not {"-h", "--help"} & set(argv):  # a bare `phalanx`: the commands, not argparse's
        print(parser.format_help(), end="", file=sys.stderr)  # "arguments are required"
        return EXIT_BAD_INPUT
    args, rest = parser.parse_known_args(argv)
    # key=value overrides may come after flags (argparse stops filling `items` at the first flag)
    stray = [r for r in rest if r.startswith("-")]
    if stray or (rest and not hasattr(args, "items")):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.items = list(args.items) + rest
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"phalanx: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The `phalanx` command (and `python -m phalanx`): main(), then a quick exit. Tearing the interpreter
    down once torch and transformers are imported took 1.3-2.6 s of CPU here (freeing their modules and
    objects; nothing of ours), paid by every command. When no thread of ours is still running, the atexit
    callbacks (logging's flush, temporary folders) run and the process ends without that teardown; otherwise
    the normal exit, which waits for the threads."""
    code = main()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    if not isinstance(code, int):  # as sys.exit reads it: None is success, anything else is said and fails
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()  # what the normal exit runs after joining threads; CPython has no public name for it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
