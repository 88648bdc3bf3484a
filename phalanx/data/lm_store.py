"""The language-modelling record format: a byte-level BPE tokenizer and one stream of token ids per split,
with an end-of-text token after each document (a plain text file, or a row). Built and opened by the one
pipeline (prepare.py); the shards are memory-mapped as they are (store.TokenStore).

Without `data.validation`, the last `data.val_fraction` of the training stream (at most
`lm.val_max_tokens`) is held out for validation when the store is opened, so nothing is read twice and
no text is kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from phalanx.core.config import Config
from phalanx.data import encoder, prepare, readers, store
from phalanx.data import tokenizer as toks
from phalanx.data.sample import sample_rows
from phalanx.data.sources import Split

SMALL = 8 << 20  # inputs up to this size are encoded by `tokenizers` directly


@dataclass(frozen=True)
class EncodeJob:
    """What a pool worker needs to encode a piece (picklable)."""
    tokenizer_dir: str
    encoder: str
    eos: int
    fields: tuple


@dataclass
class LMData:
    tokenizer_dir: Path
    train: store.TokenStore
    validation: store.TokenStore | None   # None: held out from the end of the training store
    val_tokens: int                       # tokens held out when validation is None


class LMFormat(prepare.RecordFormat):
    prefix, version = "store", "lm-store-v1"
    tokenizer, needs = "bpe", "eos_token"
    token_arrays = {"ids": None}

    def fields(self, cfg: Config) -> readers.Fields:
        return ((cfg.data.text_field, "text"),)

    def job(self, cfg: Config, split: Split, tok_dir: Path, total: int) -> tuple[EncodeJob, dict]:
        if 0 < total <= SMALL:  # nothing to gain from a faster encoder; skip its check
            kind, why = "tokenizers", f"input under {SMALL >> 20} MB"
        else:
            kind, why = encoder.choose(tok_dir, [row[0] for row in sample_rows(cfg, self.fields(cfg), 1 << 20)])
        eos = toks.special_id(tok_dir, self.needs)
        return EncodeJob(str(tok_dir), kind, eos, self.fields(cfg)), {"encoder": kind, "encoder_check": why}

    def encode(self, job: EncodeJob, piece: readers.Piece, writer: store.ShardWriter, progress) -> dict:
        enc = encoder.cached(job.tokenizer_dir, job.encoder)
        if piece.kind == "text":  # a byte range of one document
            for text, n in readers.text_chunks(piece):
                writer.tokens(ids=enc.flat([text], None))
                progress(n)
            if piece.ends_document:
                writer.tokens(ids=[job.eos])
            return {"documents": int(piece.ends_document)}
        documents = 0
        for rows, n in readers.rows(piece, job.fields):
            writer.tokens(ids=enc.flat([r[0] for r in rows], job.eos))
            documents += len(rows)
            progress(n)
        return {"documents": documents}

    def open(self, cfg: Config, tok_dir: Path, folders: dict[str, Path]) -> LMData:
        opened = {split: store.TokenStore(folder) for split, folder in folders.items()}
        train, d = opened["train"], cfg.data
        held = min(int(round(len(train) * d.val_fraction)), cfg.lm.val_max_tokens)
        val_tokens = 0 if "validation" in opened else held
        return LMData(tok_dir, train, opened.get("validation"), val_tokens)


LM = LMFormat()
