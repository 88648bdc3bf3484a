"""Text -> token ids for the token store: the tokenizer's own `tokenizers` backend, or tiktoken where
it gives the same ids.

tiktoken runs the same byte-level BPE several times faster. It is used only for a GPT-2-style tokenizer
(byte-level pre-tokenizer with the GPT-2 split pattern, no normalizer, plain BPE whose token ids follow
the merge order) and only after it produced exactly the ids of `tokenizers` on a sample of the corpus;
otherwise `tokenizers` encodes. The store never depends on which one ran.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import tiktoken
from tokenizers import Tokenizer

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for bytes (what byte-level BPE vocabularies are written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def _tiktoken_for(spec: dict):
    """A tiktoken Encoding with this tokenizer's merges, or None when the tokenizer is of another kind."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if (model.get("type") != "BPE" or model.get("dropout") or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix") or model.get("byte_fallback") or spec.get("normalizer")
            or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space")):
        return None
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    ranks = {}
    for token, idx in model["vocab"].items():
        if token in specials:
            continue
        if not all(c in byte_of for c in token):
            return None
        ranks[bytes(byte_of[c] for c in token)] = idx
    if len(ranks) != len(set(ranks.values())) or sum(len(b) == 1 for b in ranks) != 256:
        return None
    # tiktoken merges the pair whose result has the lowest id; that is BPE's merge order only when
    # every merge's result has a larger id than the merges before it.
    merged = [model["vocab"].get("".join(m.split(" ")) if isinstance(m, str) else "".join(m))
              for m in model.get("merges", [])]
    if None in merged or any(a >= b for a, b in zip(merged, merged[1:])):
        return None
    return tiktoken.Encoding("phalanx-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


class Encoder:
    """Encodes documents into flat id arrays; `kind` is 'tiktoken' or 'tokenizers'."""

    def __init__(self, tokenizer_dir: str | Path, kind: str = "tokenizers"):
        path = Path(tokenizer_dir) / "tokenizer.json"
        self.hf = Tokenizer.from_file(str(path))
        self.fast = _tiktoken_for(json.loads(path.read_text(encoding="utf-8"))) if kind == "tiktoken" else None
        self.kind = "tiktoken" if self.fast is not None else "tokenizers"

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.fast is not None:
            return [self.fast.encode(t, allowed_special="all") for t in texts]
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def flat(self, texts: list[str], eos: int | None) -> np.ndarray:
        """Ids of `texts` concatenated, each followed by `eos` when given."""
        if self.fast is not None:  # straight into numpy: no Python list of ints on the way
            arrays = [self.fast.encode_to_numpy(t, allowed_special="all") for t in texts]
        else:
            arrays = [np.array(e.ids, dtype=np.uint32) for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        if eos is not None:
            end = np.array([eos], dtype=np.uint32)
            arrays = [part for a in arrays for part in (a, end)]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)


def choose(tokenizer_dir: str | Path, sample: list[str]) -> tuple[str, str]:
    """'tiktoken' when it can stand in for this tokenizer and gives identical ids on `sample`, else
    'tokenizers'; with the reason."""
    fast = Encoder(tokenizer_dir, "tiktoken")
    if fast.fast is None:
        return "tokenizers", "tiktoken cannot express this tokenizer"
    slow = Encoder(tokenizer_dir, "tokenizers")
    n = sum(len(t) for t in sample)
    if fast.encode(sample) != slow.encode(sample):
        return "tokenizers", f"tiktoken gave other ids on a {n / 1e6:.1f} MB sample"
    return "tiktoken", f"same ids as tokenizers on a {n / 1e6:.1f} MB sample"


@lru_cache(maxsize=4)
def cached(tokenizer_dir: str, kind: str) -> Encoder:
    """One encoder per process and tokenizer (pool workers encode many pieces)."""
    return Encoder(tokenizer_dir, kind)
