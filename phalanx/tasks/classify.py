"""Classify texts with a trained classification run (`phalanx predict`); the `classify` training task.

Each micro-batch is padded only to its longest sequence; with `data.group_by_length` the sampler puts
samples of similar length together so that padding stays small. Evaluation sums a confusion matrix on
every rank and all-reduces it, so accuracy and F1 are exactly the single-process values.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import Config, ConfigError
from ..data import labelled, labelled_store, prepare, tokenizer as toks
from ..data.samplers import eval_shard, length_grouped_order
from ..model import build_classifier

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def uses_token_types(hf_config) -> bool:
    """Segment ids only for models with a segment embedding (BERT); RoBERTa has one row, DistilBERT none."""
    return getattr(hf_config, "type_vocab_size", 0) > 1


def _check_has_data(cfg: Config) -> None:
    if not cfg.data.train:
        raise ConfigError("config key 'data.train': task 'classify' needs labelled training data "
                          "(a JSONL/CSV/Parquet file, a folder of them, or hf:NAME)")


class ClassifyTask:
    name = "classify"

    def __init__(self, cfg: Config, info):
        self.cfg, self.info = cfg, info
        self.train_set = self.val_set = self.tokenizer = None
        self.names: list[str] = []
        self.use_types = False

    # ---- data -------------------------------------------------------------------------------
    @staticmethod
    def preflight(cfg: Config) -> None:
        """Bounded checks in the launcher (files exist, UTF-8, JSON, fields on a sample)."""
        _check_has_data(cfg)
        prepare.check_sample(cfg, labelled_store.fields_of(cfg))

    @staticmethod
    def prepare_data(cfg: Config, workers: int = 0, progress: bool = True) -> dict:
        """The data step (`phalanx prepare`, or the launcher before workers start)."""
        _check_has_data(cfg)
        summary = labelled_store.prepare_classify(cfg, workers, progress)
        return {"train": summary}

    def prepare(self) -> None:
        """Open the prepared splits; started by an outside torchrun/srun, the node's first process
        prepares them and the others wait for the index file."""
        cfg = self.cfg
        prepare.ensure_ready(lambda: labelled_store.ready(cfg), lambda: labelled_store.prepare_classify(cfg, progress=False),
                             self.info.is_local_main, cfg.dist.startup_timeout_s)
        data = labelled_store.open_classify(cfg)
        if cfg.model.pretrained:
            from transformers import AutoConfig
            self.use_types = uses_token_types(AutoConfig.from_pretrained(_hub_name(cfg.model.pretrained)))
        else:
            self.use_types = cfg.model.arch == "bert"
        self.tokenizer = self._load_tokenizer(data.tokenizer_dir)
        self.names, self.train_set, self.val_set = data.names, data.train, data.validation

    def _load_tokenizer(self, folder):
        tok = toks.load_saved(folder)
        # Saved with final/, so transformers users truncate the same way and get segment ids exactly when
        # the model has a segment embedding (a tokenizer trained here would otherwise omit them).
        tok.model_max_length = self.cfg.data.max_length
        names = ["input_ids", "token_type_ids", "attention_mask"] if self.use_types else \
            ["input_ids", "attention_mask"]
        tok.model_input_names = tok.init_kwargs["model_input_names"] = names
        return tok

    def train_order(self):
        if not self.cfg.data.group_by_length:
            return None
        return length_grouped_order(self.train_set.lengths, self.cfg.train.micro_batch_size)

    # ---- model and steps --------------------------------------------------------------------
    def build_model(self):
        return build_classifier(self.cfg.model, len(self.tokenizer), self.tokenizer.pad_token_id,
                                self.cfg.data.max_length, dict(enumerate(self.names)))

    def collate(self, dataset: labelled.EncodedSet, indices) -> dict:
        batch = pad_batch([dataset.example(int(i)) for i in indices], self.tokenizer.pad_token_id,
                          self.use_types)
        batch["labels"] = torch.from_numpy(np.asarray(dataset.labels[np.asarray(indices, dtype=np.int64)],
                                                      dtype=np.int64))
        return batch

    def target_count(self, batch: dict) -> int:
        return int(batch["labels"].numel())

    def batch_tokens(self, batch: dict) -> int:
        return int(batch["input_ids"].numel())

    def useful_tokens(self, batch: dict) -> int:
        return int(batch["attention_mask"].sum())

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        logits = model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}).logits
        return F.cross_entropy(logits.float(), batch["labels"], reduction="sum")

    # ---- evaluation -------------------------------------------------------------------------
    def eval_sums(self, model, batch: dict) -> list[float]:
        """[loss sum, confusion matrix (true x predicted) flattened]: all additive across ranks."""
        logits = model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}).logits.float()
        loss = F.cross_entropy(logits, batch["labels"], reduction="sum")
        k = len(self.names)
        confusion = torch.bincount(batch["labels"] * k + logits.argmax(-1), minlength=k * k)
        return [float(loss), *map(float, confusion.tolist())]

    def eval_metrics(self, sums: list[float]) -> dict:
        k = len(self.names)
        confusion = np.asarray(sums[1:], dtype=np.float64).reshape(k, k)
        return {"eval/loss": sums[0] / max(confusion.sum(), 1), **classification_metrics(confusion, self.names)}

    # ---- outputs ----------------------------------------------------------------------------
    def summary_extra(self) -> dict:
        lengths = self.train_set.lengths
        return {"labels": self.names, "num_labels": len(self.names), "train_samples": len(self.train_set),
                "val_samples": len(self.val_set), "vocab_size": len(self.tokenizer),
                "max_length": self.cfg.data.max_length, "train_mean_tokens": float(np.mean(lengths)),
                "train_at_max_length": int((lengths >= self.cfg.data.max_length).sum())}


def _hub_name(spec: str) -> str:
    return spec[3:] if spec.startswith("hf:") else spec


def pad_batch(examples: list[tuple[np.ndarray, np.ndarray]], pad_id: int, use_types: bool) -> dict:
    """Right-pad to the longest example of this batch (dynamic padding), with the attention mask."""
    width = max((len(ids) for ids, _ in examples), default=1)
    ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(examples), width), dtype=np.int64)
    types = np.zeros((len(examples), width), dtype=np.int64)
    for r, (seq, typ) in enumerate(examples):
        ids[r, :len(seq)], mask[r, :len(seq)], types[r, :len(seq)] = seq, 1, typ
    batch = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    if use_types:
        batch["token_type_ids"] = torch.from_numpy(types)
    return batch


def classification_metrics(confusion: np.ndarray, names: list[str]) -> dict:
    """Accuracy, macro-F1 (over classes seen in truth or predictions, as scikit-learn), per-class P/R/F1."""
    c = np.asarray(confusion, dtype=np.float64)
    tp, true, pred = np.diag(c), c.sum(1), c.sum(0)
    zeros = np.zeros_like(tp)
    precision = np.divide(tp, pred, out=zeros.copy(), where=pred > 0)
    recall = np.divide(tp, true, out=zeros.copy(), where=true > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=zeros.copy(), where=precision + recall > 0)
    present = (true + pred) > 0
    n = c.sum()
    return {"eval/accuracy": float(tp.sum() / n) if n else 0.0,
            "eval/macro_f1": float(f1[present].mean()) if present.any() else 0.0,
            "eval/samples": int(n),
            "eval/per_class": {name: {"precision": float(precision[i]), "recall": float(recall[i]),
                                      "f1": float(f1[i]), "support": int(true[i])} for i, name in enumerate(names)},
            "eval/confusion_matrix": c.astype(np.int64).tolist()}


# ---- phalanx predict ------------------------------------------------------------------------------
def add_arguments(p) -> None:
    """Flags of `phalanx predict` (cli.py dispatches here)."""
    p.description = "Classify texts with RUN/final; one JSON line per input, in input order."
    p.add_argument("run", help="run folder of a finished classify run (uses RUN/final and RUN/config.yaml)")
    p.add_argument("--input", required=True, help="JSONL/CSV/Parquet with the run's text field(s), or a .txt "
                   "file with one text per line")
    p.add_argument("--output", default="", help="JSONL file to write (default: standard output)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="worker processes (each takes a contiguous share)")
    p.add_argument("--batch-size", type=int, default=64, help="texts per forward pass")


def _run_config(run: str) -> Config:
    from ..config import load_config

    folder = Path(run)
    if not (folder / "final" / "config.json").is_file() or not (folder / "config.yaml").is_file():
        raise ConfigError(f"run '{run}': no final/ model or config.yaml (has the run finished?)")
    cfg = load_config(str(folder / "config.yaml"), check_paths=False)
    if cfg.task != "classify":
        raise ConfigError(f"run '{run}': task is '{cfg.task}', predict needs a 'classify' run")
    return cfg


def _read_inputs(cfg: Config, path: str) -> labelled.Examples:
    if not Path(path).is_file():
        raise ConfigError(f"--input: file '{path}' not found")
    d = cfg.data
    return labelled.read_inputs(path, d.text_field, d.text_pair_field)


def run(args) -> int:
    """`phalanx predict`: check everything here, then predict in this process or launch N workers."""
    from .. import dist

    if args.nproc_per_node < 1 or args.batch_size < 1:
        raise ConfigError("--nproc-per-node and --batch-size must be >= 1")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise ConfigError(f"--output: folder of '{args.output}' does not exist")
    cfg = _run_config(args.run)
    examples = _read_inputs(cfg, args.input)
    if args.nproc_per_node > 1 and not dist.under_torchrun():
        return _launch(args)
    return _predict_worker(args, cfg, examples)


def _launch(args) -> int:
    """Start N copies of this same command under torch.distributed.run (they find themselves workers)."""
    import torch.distributed.run as trun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..dist import default_threads

    argv = ["--standalone", "--nproc-per-node", str(args.nproc_per_node), "--monitor-interval", "0.2",
            "--module", "phalanx", "predict", str(args.run), "--input", str(args.input),
            "--batch-size", str(args.batch_size), "--nproc-per-node", str(args.nproc_per_node)]
    if args.output:
        argv += ["--output", str(args.output)]
    os.environ.setdefault("OMP_NUM_THREADS", str(default_threads(args.nproc_per_node)))
    try:
        trun.run(trun.get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        print(f"phalanx: predict failed: {str(e).strip().splitlines()[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


def _predict_worker(args, cfg: Config, examples: labelled.Examples) -> int:
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from .. import dist

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    info = dist.setup(cfg.dist.backend, timeout_s=cfg.dist.timeout_s) if dist.under_torchrun() else None
    rank, world = (info.rank, info.world_size) if info else (0, 1)
    device = info.device if info else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    final = Path(args.run) / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    shard = eval_shard(len(examples), rank, world)
    part = examples.take(shard.start, shard.stop)
    probs = predict_probs(model, tokenizer, part, cfg.data.max_length, args.batch_size, device)
    if world > 1:  # contiguous shards in rank order: concatenating them restores the input order
        gathered = [None] * world if rank == 0 else None
        torch.distributed.gather_object(probs, gathered, dst=0)
        probs = np.concatenate(gathered) if rank == 0 else None
    if rank == 0:
        names = [model.config.id2label[i] for i in range(probs.shape[1])]
        _write_predictions(probs, names, args.output)
    if info:
        dist.teardown()
    return 0


@torch.no_grad()
def predict_probs(model, tokenizer, ex: labelled.Examples, max_length: int, batch_size: int,
                  device: torch.device) -> np.ndarray:
    """Class probabilities of every example, in the order given (batches sorted by length for padding)."""
    k = model.config.num_labels
    if len(ex) == 0:
        return np.zeros((0, k), dtype=np.float32)
    enc = labelled.encode(tokenizer, ex, max_length, None)
    order = np.argsort(-enc.lengths, kind="stable")
    out = np.zeros((len(ex), k), dtype=np.float32)
    use_types = uses_token_types(model.config)
    for lo in range(0, len(order), batch_size):
        ids = order[lo:lo + batch_size]
        batch = pad_batch([enc.example(int(i)) for i in ids], tokenizer.pad_token_id, use_types)
        logits = model(**{k2: v.to(device) for k2, v in batch.items()}).logits.float()
        out[ids] = torch.softmax(logits, -1).cpu().numpy()
    return out


def _write_predictions(probs: np.ndarray, names: list[str], output: str) -> None:
    lines = [json.dumps({"label": names[int(row.argmax())],
                         "probabilities": {n: round(float(p), 6) for n, p in zip(names, row)}})
             for row in probs]
    text = "".join(line + "\n" for line in lines)
    if not output:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    tmp = Path(output).with_name(Path(output).name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, output)
