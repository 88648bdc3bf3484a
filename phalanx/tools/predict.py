"""`phalanx predict`: classify texts with a finished classification run (RUN/final), on N processes.

One JSON line per input, in input order. With --nproc-per-node N the same command is started N times
through the launcher (launch.run_workers); each worker takes a contiguous share and rank 0 writes all.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from phalanx.core import dist
from phalanx.core.config import Config, ConfigError, load_config
from phalanx.core.registry import check_command
from phalanx.core.runfolder import EXIT_FAILED, EXIT_OK, RunFolder, write_text
from phalanx.data.classify import inputs as classify_inputs
from phalanx.model.build import load_classifier
from phalanx.run.evaluate import eval_shard
from phalanx.tasks.classify import predict_probs
from phalanx.tools.failures import failure_line_of
from phalanx.tools.launch import run_workers


def add_arguments(p) -> None:
    """Flags of `phalanx predict` (cli.py dispatches here)."""
    p.description = ("Classify texts (classify) or tag each word of sentences (token_classify) with RUN/final; "
                     "one JSON line per input, in input order (token_classify: CoNLL for an --output ending in .conll)")
    p.add_argument("run", help="run folder of a finished classify or token_classify run (uses RUN/final and "
                   "RUN/config.yaml)")
    p.add_argument("--input", required=True, help="classify: JSONL/CSV/Parquet with the run's text field(s), or a .txt "
                   "file with one text per line; token_classify: a CoNLL file (a word per line, its tag column "
                   "optional, blank lines between sentences; .conll or data.format=conll in the run) or JSONL/Parquet "
                   "with the run's token_classify.tokens_field")
    p.add_argument("--output", default="", help="JSONL file to write (default: standard output); token_classify: a "
                   "name ending in .conll writes CoNLL (word TAB tag)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="worker processes (each takes a contiguous share)")
    p.add_argument("--batch-size", type=int, default=64, help="texts per forward pass")


def _run_config(run: str) -> Config:
    folder = RunFolder(run)
    if not (folder.final / "config.json").is_file() or not folder.config.is_file():
        raise ConfigError(f"run '{run}': no final/ model or config.yaml (has the run finished?)")
    cfg = load_config(str(folder.config), check_paths=False)
    check_command(cfg.task, "predict", run)
    return cfg


def run(args) -> int:
    """Check everything here, then predict in this process or launch N workers."""
    if args.nproc_per_node < 1 or args.batch_size < 1:
        raise ConfigError("--nproc-per-node and --batch-size must be >= 1")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise ConfigError(f"--output: folder of '{args.output}' does not exist")
    cfg = _run_config(args.run)
    if not Path(args.input).is_file():
        raise ConfigError(f"--input: file '{args.input}' not found")
    if cfg.task == "token_classify":
        from phalanx.tools import predict_tokens  # lazy: the tagger's own input, windows and outputs

        return predict_tokens.run(args, cfg)
    examples = classify_inputs.read_inputs(args.input, cfg.data.text_field, cfg.classify.text_pair_field)
    if args.nproc_per_node > 1 and not dist.under_torchrun():
        return launch(args)
    return _predict_worker(args, cfg, examples)


def launch(args) -> int:
    """The same command started N times through the launcher; each worker takes its share."""
    argv = ["phalanx", "predict", str(args.run), "--input", str(args.input), "--batch-size", str(args.batch_size),
            "--nproc-per-node", str(args.nproc_per_node), *(["--output", str(args.output)] if args.output else [])]
    failure = run_workers(argv, args.nproc_per_node, dist.default_threads(args.nproc_per_node))
    if failure is not None:
        print(f"phalanx: predict failed: {failure_line_of(failure)}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK


@dataclass
class Share:
    """This process's part of a predict command: its process group (None: one process), device, the run's
    model and tokenizer, and the contiguous share of the inputs it predicts."""
    info: dist.DistInfo | None
    device: torch.device
    model: torch.nn.Module
    tokenizer: object
    shard: range

    def gather(self, part) -> list | None:
        """Every rank's part in rank order on rank 0 (contiguous shares: the input order); None elsewhere."""
        if self.info is None or self.info.world_size == 1:
            return [part]
        gathered = [None] * self.info.world_size if self.info.rank == 0 else None
        torch.distributed.gather_object(part, gathered, dst=0)
        return gathered

    def close(self) -> None:
        if self.info:
            dist.teardown()


def open_share(cfg: Config, run: str, n: int, load) -> Share:
    """Join the launcher's group where started by it, load RUN/final with `load`, take this rank's share of n."""
    info = dist.setup(cfg.dist.backend, timeout_s=cfg.dist.timeout_s) if dist.under_torchrun() else None
    rank, world = (info.rank, info.world_size) if info else (0, 1)
    device = info.device if info else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load(RunFolder(run).final)
    return Share(info, device, model.to(device), tokenizer, eval_shard(n, rank, world))


def _predict_worker(args, cfg: Config, examples: classify_inputs.Examples) -> int:
    share = open_share(cfg, args.run, len(examples), load_classifier)
    probs = predict_probs(share.model, share.tokenizer, examples.take(share.shard.start, share.shard.stop),
                          cfg.classify.max_length, args.batch_size, share.device)
    parts = share.gather(probs)
    if parts is not None:
        names = [share.model.config.id2label[i] for i in range(probs.shape[1])]
        _write_predictions(np.concatenate(parts), names, args.output)
    share.close()
    return EXIT_OK


def _write_predictions(probs: np.ndarray, names: list[str], output: str) -> None:
    lines = [json.dumps({"label": names[int(row.argmax())],
                         "probabilities": {n: round(float(p), 6) for n, p in zip(names, row)}})
             for row in probs]
    emit("".join(line + "\n" for line in lines), output)


def emit(text: str, output: str) -> None:
    """The predictions to --output (written whole, through a temporary name), or standard output."""
    if not output:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    write_text(Path(output), text)
