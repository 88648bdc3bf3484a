"""Classify texts with a trained classification run (`phalanx predict`); the `classify` training task.

Each micro-batch is padded only to its longest sequence; with `data.group_by_length` the sampler puts
samples of similar length together so that padding stays small. Evaluation sums a confusion matrix on
every rank and all-reduces it, so accuracy and F1 are exactly the single-process values.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from phalanx.core.config import Config, ConfigError, group_by_length, hub_name
from phalanx.data import prepare
from phalanx.data.classify import inputs as classify_inputs
from phalanx.data import tokenizer as toks
from phalanx.data.classify.store import CLASSIFY, EncodedSet
from phalanx.data.samplers import length_grouped_order, shuffled_order
from phalanx.model.build import classifier
from phalanx.tasks.base import TaskBase

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def uses_token_types(hf_config) -> bool:
    """Segment ids only for models with a segment embedding (BERT); RoBERTa has one row, DistilBERT none."""
    return getattr(hf_config, "type_vocab_size", 0) > 1


def encoder_tokenizer(cfg: Config, folder, max_length: int) -> tuple:
    """The prepared data's tokenizer as final/ saves it, and whether the model takes segment ids. Saved so,
    transformers users truncate the same way and get segment ids exactly when the model has a segment embedding
    (a tokenizer trained here would otherwise omit them)."""
    if cfg.model.pretrained:
        from transformers import AutoConfig
        use_types = uses_token_types(AutoConfig.from_pretrained(hub_name(cfg.model.pretrained)))
    else:
        use_types = cfg.model.arch == "bert"
    tok = toks.load_saved(folder)
    tok.model_max_length = max_length
    names = ["input_ids", "token_type_ids", "attention_mask"] if use_types else ["input_ids", "attention_mask"]
    tok.model_input_names = tok.init_kwargs["model_input_names"] = names
    return tok, use_types


def _check_has_data(cfg: Config) -> None:
    if not cfg.data.train:
        raise ConfigError("config key 'data.train': task 'classify' needs labelled training data "
                          "(a JSONL/CSV/Parquet file, a folder of them, or hf:NAME)")


class EncoderTask(TaskBase):
    """What the encoder tasks share: their own config section (its max_length and labels) and the head."""
    ARCHS = ("bert", "roberta", "distilbert")
    SECTION = ""                       # the task's config section
    HEAD = "SequenceClassification"    # transformers' AutoModelFor<HEAD>
    DEFAULT_LABELS: tuple[str, ...] = ()  # the labels of a model built before any data is read (memory plan)

    @classmethod
    def sequence_length(cls, cfg: Config) -> int:
        return getattr(cfg, cls.SECTION).max_length

    @classmethod
    def model_for(cls, cfg: Config, vocab_size: int, special_id: int, names: list[str] | None = None):
        """The architecture, on the current default device (no weights are loaded)."""
        section = getattr(cfg, cls.SECTION)
        names = names or section.labels or list(cls.DEFAULT_LABELS)
        return classifier(cfg.model, vocab_size, special_id, section.max_length, dict(enumerate(names)), head=cls.HEAD)

    def define_model(self):
        return self.model_for(self.cfg, len(self.tokenizer), self.tokenizer.pad_token_id, self.names)


class ClassifyTask(EncoderTask):
    name = "classify"
    SECTION, DEFAULT_LABELS = "classify", ("0", "1")
    AUTO_MODEL = "AutoModelForSequenceClassification"
    MISMATCHED = "init"  # a pretrained model's head for another number of labels is initialised anew
    FORMAT = CLASSIFY

    def __init__(self, cfg: Config, info):
        super().__init__(cfg, info)
        self.names: list[str] = []
        self.use_types = False

    # ---- data -------------------------------------------------------------------------------
    @classmethod
    def preflight(cls, cfg: Config) -> None:
        _check_has_data(cfg)
        super().preflight(cfg)

    @classmethod
    def prepare_data(cls, cfg: Config, workers: int = 0, progress: bool = True) -> dict:
        _check_has_data(cfg)
        return super().prepare_data(cfg, workers, progress)

    def open_data(self) -> None:
        """Open the prepared splits; started by an outside torchrun/srun, the node's first process
        prepares them and the others wait for the index files."""
        cfg = self.cfg
        data = prepare.open_or_prepare(cfg, CLASSIFY, self.info.is_local_main, cfg.dist.startup_timeout_s)
        self.tokenizer, self.use_types = encoder_tokenizer(cfg, data.tokenizer_dir, cfg.classify.max_length)
        self.names, self.train_set, self.val_set = data.names, data.train, data.validation

    def train_order(self, data_order: int):
        """Length-grouped: whole global batches of similar lengths (data order 2), so every rank's share of
        a step takes about as long; data order 1 (older checkpoints) grouped single micro-batches."""
        if not group_by_length(self.cfg):
            return shuffled_order(len(self.train_set), lazy=data_order >= 3)
        t = self.cfg.train
        return length_grouped_order(self.train_set.lengths, t.micro_batch_size,
                                    unit=t.global_batch_size if data_order >= 2 else t.micro_batch_size)

    # ---- model and steps --------------------------------------------------------------------
    def next_commands(self, run_dir) -> list[str]:
        return [*super().next_commands(run_dir),
                f"phalanx predict {run_dir} --input TEXTS.jsonl --output predictions.jsonl"]

    def collate(self, dataset: EncodedSet, indices) -> dict:
        batch = pad_batch([dataset.example(int(i)) for i in indices], self.tokenizer.pad_token_id,
                          self.use_types)
        batch["labels"] = torch.from_numpy(np.asarray(dataset.labels[np.asarray(indices, dtype=np.int64)],
                                                      dtype=np.int64))
        return batch

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
                "max_length": self.cfg.classify.max_length, "train_mean_tokens": float(np.mean(lengths)),
                "train_at_max_length": int((lengths >= self.cfg.classify.max_length).sum())}


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


@torch.no_grad()
def predict_probs(model, tokenizer, ex: classify_inputs.Examples, max_length: int, batch_size: int,
                  device: torch.device) -> np.ndarray:
    """Class probabilities of every example, in the order given (batches sorted by length for padding)."""
    k = model.config.num_labels
    if len(ex) == 0:
        return np.zeros((0, k), dtype=np.float32)
    enc = classify_inputs.encode(tokenizer, ex, max_length)
    order = np.argsort(-enc.lengths, kind="stable")
    out = np.zeros((len(ex), k), dtype=np.float32)
    use_types = uses_token_types(model.config)
    for lo in range(0, len(order), batch_size):
        ids = order[lo:lo + batch_size]
        batch = pad_batch([enc.example(int(i)) for i in ids], tokenizer.pad_token_id, use_types)
        logits = model(**{k2: v.to(device) for k2, v in batch.items()}).logits.float()
        out[ids] = torch.softmax(logits, -1).cpu().numpy()
    return out
