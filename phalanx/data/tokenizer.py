"""Tokenizers: trained on a sample of the training data with `tokenizers`, or loaded pretrained.

A tokenizer lives in a folder of the cache: `tokenizer.json` (the `tokenizers` backend) plus
`phalanx-tokenizer.json` (its special tokens) for one trained here, or a `save_pretrained` copy of a
pretrained one. Preparation reads only `tokenizer.json` (no `transformers` import in the launcher);
workers load a `transformers.PreTrainedTokenizerFast`, so the run's `final/` folder loads with
`AutoTokenizer.from_pretrained`.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from phalanx.core.config import hub_name

EOS = "<|endoftext|>"
WORDPIECE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SPECIALS_FILE = "phalanx-tokenizer.json"
# transformers keyword arguments naming each trained kind's special tokens
SPECIALS = {"bpe": {"eos_token": EOS, "bos_token": EOS, "unk_token": EOS},
            "wordpiece": {"unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                          "sep_token": "[SEP]", "mask_token": "[MASK]"}}


def train_bpe(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) with one end-of-text token; a `tokenizers.Tokenizer`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_wordpiece(texts: Iterable[str], vocab_size: int):
    """BERT-style WordPiece with [CLS] a [SEP] b [SEP] post-processing; a `tokenizers.Tokenizer`."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=WORDPIECE_SPECIALS,
                                        show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def save_trained(tok, kind: str, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / SPECIALS_FILE).write_text(json.dumps(SPECIALS[kind]), encoding="utf-8")


def load_pretrained(spec: str, **options):
    from transformers import (
        AutoTokenizer,  # lazy: transformers costs ~2 s, preparation never needs it
    )

    return AutoTokenizer.from_pretrained(hub_name(spec), **options)


def load_saved(folder: str | Path):
    """The cached tokenizer as a transformers tokenizer (workers, export)."""
    from transformers import PreTrainedTokenizerFast  # lazy: ~2 s; preparation in the launcher never needs it

    folder = Path(folder)
    if (folder / SPECIALS_FILE).is_file():
        specials = json.loads((folder / SPECIALS_FILE).read_text(encoding="utf-8"))
        return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **specials)
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def backend(folder: str | Path):
    """The `tokenizers` backend of a cached tokenizer (preparation: no transformers import)."""
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def special_id(folder: str | Path, name: str) -> int | None:
    """Id of the special token `name` ('eos_token', 'pad_token', ...) of a cached tokenizer."""
    folder = Path(folder)
    specials = folder / SPECIALS_FILE
    if specials.is_file():
        token = json.loads(specials.read_text(encoding="utf-8")).get(name)
    else:  # saved by transformers: older versions write special_tokens_map.json, newer tokenizer_config.json
        token = None
        for file in ("special_tokens_map.json", "tokenizer_config.json"):
            if token is None and (folder / file).is_file():
                token = json.loads((folder / file).read_text(encoding="utf-8")).get(name)
        token = token.get("content") if isinstance(token, dict) else token
    return backend(folder).token_to_id(token) if token else None
