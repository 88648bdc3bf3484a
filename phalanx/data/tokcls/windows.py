"""Words -> subwords -> windows: the alignment shared by preparation and `phalanx predict`.

A sentence's words are tokenized as already split (the tokenizer's pre-tokenizer sees each word alone; a
byte-level one has add_prefix_space, so a word is encoded as it is inside a sentence). A word that gives no
subword (a control character the normalizer removes) gets the unknown token: no word is dropped. A sentence
longer than the window is cut into windows of whole words that overlap by at least `stride` subwords; each
word belongs to the one window where it has the most context (the fewer subwords on its shorter side is the
larger), ties to the earlier window, so every word is predicted exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# per token of a window: the owned word's index in its sentence (>= 0) at its first subword, or one of these
CONTINUED = -2      # a later subword of a word the window owns
OUTSIDE = -1        # a special token, or a subword of a word another window owns


@dataclass(frozen=True)
class Specials:
    """The special tokens around one sequence: [CLS] ... [SEP], <s> ... </s>, or none."""
    before: tuple[int, ...]
    after: tuple[int, ...]
    unk: int


def unpadded(tok):
    """A copy of a `tokenizers.Tokenizer` that neither pads nor truncates (a saved tokenizer.json may do both:
    all-MiniLM-L6-v2's pads to 128): windows cut long sentences, never the tokenizer."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tok.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy


def _check(tok) -> None:
    if tok.padding is not None or tok.truncation is not None:
        raise ValueError("the tokenizer pads or truncates; use windows.unpadded(tok)")


def specials_of(tok) -> Specials:
    """From a `tokenizers.Tokenizer`: the ids its post-processor puts around a single sequence."""
    _check(tok)
    enc = tok.encode(["a"], is_pretokenized=True, add_special_tokens=True)
    words = [w is not None for w in enc.word_ids]
    first, last = words.index(True), len(words) - 1 - words[::-1].index(True)
    unk = tok.token_to_id(tok.model.unk_token) if getattr(tok.model, "unk_token", None) else None
    return Specials(tuple(enc.ids[:first]), tuple(enc.ids[last + 1:]), unk if unk is not None else enc.ids[first])


def word_pieces(tok, sentences: list[list[str]], unk: int) -> list[list[np.ndarray]]:
    """Each word's subword ids, per sentence (one encode_batch call)."""
    _check(tok)
    out = []
    for enc in tok.encode_batch(sentences, is_pretokenized=True, add_special_tokens=False):
        n = max((w for w in enc.word_ids if w is not None), default=-1) + 1
        per = [[] for _ in range(len(sentences[len(out)]))]
        for token, w in zip(enc.ids, enc.word_ids):
            if w is not None:
                per[w].append(token)
        assert n <= len(per)
        out.append([np.asarray(p or [unk], dtype=np.int64) for p in per])
    return out


def plan(counts: list[int], budget: int, stride: int) -> list[tuple[int, int, int, int]]:
    """Windows of a sentence whose words have `counts` subwords: (first word, end word, first owned, end owned),
    each window at most `budget` subwords (a single longer word is cut to it), consecutive windows sharing at
    least `stride` subwords where the budget allows."""
    n = len(counts)
    pos = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if pos[-1] <= budget:
        return [(0, n, 0, n)]
    stride = min(stride, budget // 2)
    spans, a = [], 0
    while True:
        b = int(np.searchsorted(pos, pos[a] + budget, side="right")) - 1  # the most words from a that fit
        b = max(b, a + 1)
        spans.append((a, b))
        if b >= n:
            break
        nxt = b
        while nxt - 1 > a and pos[b] - pos[nxt] < stride:  # back until the overlap is at least stride
            nxt -= 1
        while nxt < b and pos[b + 1] - pos[nxt] > budget:  # but the next window must take word b
            nxt += 1
        a = nxt
    owner = np.zeros(n, dtype=np.int64)
    best = np.full(n, -1, dtype=np.int64)
    for k, (a, b) in enumerate(spans):
        i = np.arange(a, b)
        context = np.minimum(pos[i] - pos[a], pos[b] - pos[i + 1])
        better = context > best[a:b]
        owner[a:b][better], best[a:b][better] = k, context[better]
    out = []
    for k, (a, b) in enumerate(spans):
        owned = np.flatnonzero(owner == k)
        lo, hi = (int(owned[0]), int(owned[-1]) + 1) if len(owned) else (a, a)
        assert hi - lo == len(owned), "owned words are contiguous"
        out.append((a, b, lo, hi))
    return out


@dataclass
class Window:
    ids: np.ndarray     # token ids, special tokens included
    words: np.ndarray   # per token: the owned word's index in its sentence at its first subword, CONTINUED, OUTSIDE
    tags: np.ndarray    # per token: the word's tag (any code) on every subword of an owned word, -1 elsewhere
    window: int         # its index among its sentence's windows
    owned: int          # words it predicts


def windows(pieces: list[np.ndarray], tags: list[int] | None, specials: Specials, max_length: int,
            stride: int) -> list[Window]:
    """A sentence (each word's subword ids `pieces`, its tag codes `tags` or None) as its windows."""
    budget = max_length - len(specials.before) - len(specials.after)
    out = []
    for k, (a, b, lo, hi) in enumerate(plan([len(p) for p in pieces], budget, stride)):
        ids, words, codes = [], [], []
        for w in range(a, b):
            p, own = pieces[w], lo <= w < hi
            ids.append(p)
            words.append(np.full(len(p), CONTINUED if own else OUTSIDE, dtype=np.int64))
            if own:
                words[-1][0] = w
            codes.append(np.full(len(p), tags[w] if own and tags is not None else -1, dtype=np.int64))
        body = np.concatenate(ids)[:budget]
        pad_b, pad_a = np.full(len(specials.before), OUTSIDE), np.full(len(specials.after), OUTSIDE)
        out.append(Window(np.concatenate([specials.before, body, specials.after]).astype(np.int64),
                          np.concatenate([pad_b, np.concatenate(words)[:budget], pad_a]).astype(np.int64),
                          np.concatenate([pad_b, np.concatenate(codes)[:budget], pad_a]).astype(np.int64),
                          k, hi - lo))
    return out
