"""The `token_classify` training task (named entities, tags: one prediction per word), and tagging sentences
with a trained model (`phalanx predict`).

Words arrive split; each is labelled on its first subword (-100 on the rest, or every subword with
token_classify.label_all_subwords). A sentence longer than token_classify.max_length is cut into overlapping
windows (data/tokcls/windows.py), each word predicted by one of them, in training, evaluation and prediction
alike. The loss is the sum over labelled subwords divided by their count in the whole global batch. Entity
precision/recall/F1 are corpus figures: evaluation gathers every window's word predictions in order across the
ranks and seqeval scores the whole validation set once.
"""
from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F

from phalanx.core.config import Config, ConfigError, base_config, group_by_length
from phalanx.data import prepare
from phalanx.data.samplers import length_grouped_order, shuffled_order
from phalanx.data.tokcls import labels as tag_names
from phalanx.data.tokcls import windows as win
from phalanx.data.tokcls.store import TOKCLS, TaggedSet
from phalanx.tasks.classify import MODEL_INPUTS, EncoderTask, encoder_tokenizer, uses_token_types

IGNORE = -100  # the label cross-entropy skips (transformers' convention)


class TokenClassifyTask(EncoderTask):
    name = "token_classify"
    SECTION, HEAD, DEFAULT_LABELS = "token_classify", "TokenClassification", ("O", "B-X", "I-X")
    AUTO_MODEL = "AutoModelForTokenClassification"
    MISMATCHED = "init"  # a pretrained model's head (or none: a bare encoder) is initialised anew for these labels
    FORMAT = TOKCLS
    EVAL_OUTPUTS = True  # eval_sums also returns each window's word predictions (run/evaluate.py gathers them)

    def __init__(self, cfg: Config, info):
        super().__init__(cfg, info)
        self.names: list[str] = []
        self.gold_names: list[str] = []
        self.scheme = ""
        self.use_types = False
        self.continued = np.zeros(0, dtype=np.int64)

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """A window longer than the pretrained encoder's positions is exit 2 in the launcher, not an index error in
        every worker."""
        super().check_config(cfg)
        positions, length = encoder_positions(cfg), cfg.token_classify.max_length
        if positions and length > positions:
            raise ConfigError(f"config key 'token_classify.max_length': {length} is more than the {positions} "
                              f"positions of '{cfg.model.pretrained}'; lower it to {positions} or less (longer "
                              f"sentences are cut into windows anyway)")

    # ---- data -------------------------------------------------------------------------------
    def open_data(self) -> None:
        cfg = self.cfg
        data = prepare.open_or_prepare(cfg, TOKCLS, self.info.is_local_main, cfg.dist.startup_timeout_s)
        self.tokenizer, self.use_types = encoder_tokenizer(cfg, data.tokenizer_dir, cfg.token_classify.max_length)
        self.names, self.gold_names, self.scheme = data.names, data.gold_names, data.scheme
        self.train_set, self.val_set = data.train, data.validation
        self.continued = np.asarray(tag_names.continuation(self.names) + [IGNORE] * (len(self.gold_names)
                                                                                     - len(self.names)))

    def train_order(self, data_order: int):
        if not group_by_length(self.cfg):
            return shuffled_order(len(self.train_set), lazy=data_order >= 3)
        t = self.cfg.train
        return length_grouped_order(self.train_set.lengths, t.micro_batch_size, unit=t.global_batch_size)

    def next_commands(self, run_dir) -> list[str]:
        return [*super().next_commands(run_dir),
                f"phalanx predict {run_dir} --input SENTENCES.conll --output tagged.conll"]

    # ---- model and steps --------------------------------------------------------------------
    def collate(self, dataset: TaggedSet, indices) -> dict:
        """Padded windows; labels on each owned word's first subword (every subword with label_all_subwords),
        IGNORE elsewhere and on a validation tag the model has no label for; `owned` marks the subwords whose
        predictions are the words'."""
        rows = [dataset.example(int(i)) for i in indices]
        width = max(len(ids) for ids, _, _ in rows)
        ids = np.full((len(rows), width), self.tokenizer.pad_token_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
        owned = np.zeros((len(rows), width), dtype=bool)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        every = self.cfg.token_classify.label_all_subwords
        for r, (seq, words, tags) in enumerate(rows):
            n, words = len(seq), np.asarray(words)
            ids[r, :n], mask[r, :n], owned[r, :n] = seq, 1, words >= 0
            first = words >= 0
            labels[r, :n][first] = tags[first]
            if every:
                later = words == win.CONTINUED
                labels[r, :n][later] = self.continued[tags[later]]
        labels[labels >= len(self.names)] = IGNORE
        batch = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                 "labels": torch.from_numpy(labels), "owned": torch.from_numpy(owned)}
        if self.use_types:
            batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
        return batch

    def target_count(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE).sum())

    def useful_tokens(self, batch: dict) -> int:
        return int(batch["attention_mask"].sum())

    def _logits(self, model, batch: dict) -> torch.Tensor:
        return model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}).logits.float()

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        logits = self._logits(model, batch)
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum")

    # ---- evaluation -------------------------------------------------------------------------
    def eval_sums(self, model, batch: dict) -> tuple[list[float], list[np.ndarray]]:
        """[loss sum, labelled subwords, windows] (additive), and each window's predicted label ids of the words
        it owns, in word order (gathered in window order by the evaluator)."""
        logits = self._logits(model, batch)
        labels = batch["labels"]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        pred, owned = logits.argmax(-1).cpu().numpy(), batch["owned"].cpu().numpy()
        words = [pred[r][owned[r]].astype(np.int16) for r in range(len(pred))]
        return [float(loss), float((labels != IGNORE).sum()), float(len(pred))], words

    def eval_metrics(self, sums: list[float], predictions: list[np.ndarray] | None = None) -> dict:
        """seqeval's figures on every validation word: entity P/R/F1 (its default mode; micro, and per type),
        strict IOB2 (BIOES: IOBES) F1, word accuracy."""
        predictions = predictions or []
        gold = self.val_set.gold(len(predictions))
        starts = np.asarray(self.val_set.window[:len(predictions)]) == 0
        return {"eval/loss": sums[0] / max(sums[1], 1), "eval/samples": int(sums[2]),
                **entity_metrics(sentences(gold, starts), sentences(predictions, starts), self.gold_names,
                                 self.names, self.scheme)}

    # ---- outputs ----------------------------------------------------------------------------
    def summary_extra(self) -> dict:
        lengths = self.train_set.lengths
        t = self.cfg.token_classify
        return {"labels": self.names, "num_labels": len(self.names), "scheme": self.scheme,
                "train_windows": len(self.train_set), "val_windows": len(self.val_set),
                "train_sentences": int((np.asarray(self.train_set.window) == 0).sum()),
                "vocab_size": len(self.tokenizer), "max_length": t.max_length,
                "train_mean_tokens": float(np.mean(lengths)),
                "train_sentences_in_windows": int((np.asarray(self.train_set.window) == 1).sum())}


def encoder_positions(cfg: Config) -> int | None:
    """Tokens a pretrained encoder (a local folder) takes: its position embeddings, less RoBERTa's offset (its
    positions start after the padding id); None from scratch or for a hub name (read when it is built)."""
    raw = base_config(cfg) or {}
    positions = raw.get("max_position_embeddings")
    if not positions:
        return None
    offset = raw.get("pad_token_id", 1) + 1 if raw.get("model_type") in ("roberta", "xlm-roberta", "camembert") else 0
    return positions - offset


def sentences(per_window: list[np.ndarray], starts: np.ndarray) -> list[np.ndarray]:
    """Windows' word arrays joined into sentences (a sentence starts at each window 0)."""
    out: list[list[np.ndarray]] = []
    for words, first in zip(per_window, starts):
        if first or not out:
            out.append([])
        out[-1].append(np.asarray(words, dtype=np.int64))
    return [np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64) for parts in out]


def entity_metrics(gold: list[np.ndarray], pred: list[np.ndarray], gold_names: list[str], names: list[str],
                   scheme: str) -> dict:
    """seqeval (https://github.com/chakki-works/seqeval) on whole sentences of label ids."""
    from seqeval import metrics as sq  # lazy: scikit-learn comes with it
    from seqeval.scheme import IOB2, IOBES

    plain = scheme == "plain"
    g_names, p_names = tag_names.for_seqeval(gold_names, plain), tag_names.for_seqeval(names, plain)
    y_true = [[g_names[i] for i in s] for s in gold]
    y_pred = [[p_names[i] for i in s] for s in pred]
    words = sum(len(s) for s in y_true)
    if not words:
        return {"eval/words": 0}
    report = sq.classification_report(y_true, y_pred, output_dict=True, zero_division=0)
    micro = report.pop("micro avg")
    out = {"eval/precision": float(micro["precision"]), "eval/recall": float(micro["recall"]),
           "eval/f1": float(micro["f1-score"]), "eval/accuracy": float(sq.accuracy_score(y_true, y_pred)),
           "eval/entities": int(micro["support"]), "eval/words": words, "eval/sentences": len(y_true),
           "eval/per_type": {k: {"precision": float(v["precision"]), "recall": float(v["recall"]),
                                 "f1": float(v["f1-score"]), "support": int(v["support"])}
                             for k, v in report.items() if not k.endswith(" avg")}}
    if not plain:
        strict = IOBES if scheme == "BIOES" else IOB2
        out["eval/strict_f1"] = float(sq.f1_score(y_true, y_pred, mode="strict", scheme=strict, zero_division=0))
    return out


# ---- tagging sentences with a trained model (phalanx predict) ------------------------------------------
@torch.no_grad()
def tag_sentences(model, tokenizer, sentences_: list[list[str]], max_length: int, stride: int, batch_size: int,
                  device: torch.device) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each sentence's predicted label id and its probability per word, through the same windows as training."""
    backend = win.unpadded(tokenizer.backend_tokenizer)
    specials = win.specials_of(backend)
    made, where = [], []  # every window, and (sentence, its words' indices) for each
    for s, subwords in enumerate(win.word_pieces(backend, sentences_, specials.unk)):
        for w in win.windows(subwords, None, specials, max_length, stride):
            made.append(w)
            where.append((s, w.words[w.words >= 0]))
    out = [(np.zeros(len(s), dtype=np.int64), np.zeros(len(s), dtype=np.float32)) for s in sentences_]
    use_types = uses_token_types(model.config)
    order = np.argsort([-len(w.ids) for w in made], kind="stable")  # batches of similar lengths: less padding
    for lo in range(0, len(order), batch_size):
        chunk = [made[i] for i in order[lo:lo + batch_size]]
        width = max(len(w.ids) for w in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, w in enumerate(chunk):
            ids[r, :len(w.ids)], mask[r, :len(w.ids)] = torch.from_numpy(w.ids), 1
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        if use_types:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        probs = torch.softmax(model(**inputs).logits.float(), -1).cpu().numpy()
        for r, i in enumerate(order[lo:lo + batch_size]):
            s, words = where[i]
            first = made[i].words >= 0
            out[s][0][words] = probs[r, :len(first)][first].argmax(-1)
            out[s][1][words] = probs[r, :len(first)][first].max(-1)
    return out
