"""Conversations -> token ids and a loss mask in at most `model.block_size` tokens, many at once.

The ids are exactly `apply_chat_template(messages, tokenize=True, **template.kwargs)`. The targets of
an assistant turn are the tokens from where its output starts (the end of the generation prompt, or its
first text field: layout.py) through its end-of-turn token, the first special token the template
writes after the turn's last text field. Characters map to tokens by offsets only: the tokenizer's
(`tokenizers`), or token byte lengths (tiktoken, used for GPT-2-style BPE where it gives the same ids).

A record that cannot be used is dropped and counted with its reason (`Dropped`): too long even after
truncation, refused by the template (its own raise_exception, e.g. roles must alternate), its text changed
by the template beyond trimming (no mask can be trusted), or nothing left to learn.
Truncation (chat.truncation): keep_end drops the oldest exchanges (the system message stays), then cuts the
remaining prompt from its start at token boundaries, never a reply; turns drops whole turns from the end (a
first exchange that is too long is cut on the right); right cuts on the right.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from phalanx.core.errors import ConfigError
from phalanx.data.chat.layout import Layouts, Placement, Skeleton
from phalanx.data.chat.template import Renderer, fold, split_reasoning
from phalanx.data.counts import Dropped


@dataclass(frozen=True)
class ChatSettings:
    train_on: str               # assistant | last | all
    truncation: str             # keep_end | turns | right
    block_size: int
    system: str = "keep"        # keep | fold (template.system_message resolved for the template)
    template_kwargs: str = "{}"  # template.kwargs as JSON (sorted keys: hashable, picklable)


@dataclass
class Encoded:
    """A kept conversation: one sequence of a unit (units.py)."""
    ids: np.ndarray       # int64 token ids of the rendered conversation
    mask: np.ndarray      # bool: the token is a training target
    end_of_turn: int      # id of the assistant's end-of-turn token (-1: no assistant turn rendered)
    truncated: bool = False

    @property
    def supervised(self) -> int:
        return int(self.mask.sum())

    @property
    def sequences(self) -> tuple[Encoded]:
        return (self,)


class Tokens:
    """A text's token ids with each token's [start, end) in units: characters, or UTF-8 bytes (`in_bytes`).
    Starts and ends never decrease (as both tokenizers give them)."""

    def __init__(self, text: str, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, in_bytes: bool):
        self.text, self.ids, self.starts, self.ends = text, ids, starts, ends
        self.in_bytes = in_bytes and not text.isascii()  # ASCII: a byte is a character
        self._at = (0, 0)  # the last (character, byte) looked up: lookups mostly go forward

    def unit(self, char: int) -> int:
        if not self.in_bytes:
            return char
        c, b = self._at if char >= self._at[0] else (0, 0)
        self._at = (char, b + len(self.text[c:char].encode("utf-8")))
        return self._at[1]

    def char(self, unit: int) -> int:
        """The first character boundary at or after `unit`."""
        if not self.in_bytes:
            return unit
        chars = len(self.text.encode("utf-8")[:unit].decode("utf-8", "ignore"))
        return chars + (len(self.text[:chars].encode("utf-8")) < unit)


class HFTokens:
    """`tokenizers`' own offsets (any tokenizer)."""

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, texts: list[str]) -> list[Tokens]:
        out = []
        for text, enc in zip(texts, self.backend.encode_batch(texts, add_special_tokens=False)):
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            out.append(Tokens(text, np.asarray(enc.ids, dtype=np.int64), offsets[:, 0], offsets[:, 1], False))
        return out


class TiktokenTokens:
    """tiktoken with this tokenizer's merges (encoder.py checked it gives the same ids); offsets from each
    token's byte length."""

    def __init__(self, encoding):
        self.encoding = encoding
        self.sizes = np.array([_size(encoding, i) for i in range(encoding.max_token_value + 1)], dtype=np.int64)

    def __call__(self, texts: list[str]) -> list[Tokens]:
        out = []
        for text in texts:
            ids = self.encoding.encode_to_numpy(text, allowed_special="all").astype(np.int64)
            ends = np.cumsum(self.sizes[ids])
            out.append(Tokens(text, ids, ends - self.sizes[ids], ends, True))
        return out


def _size(encoding, token: int) -> int:
    try:
        return len(encoding.decode_single_token_bytes(token))
    except KeyError:  # an id the vocabulary skips
        return 0


def special_ids(tokenizer) -> set[int]:
    """Every special token id: the named ones and added tokens marked special (e.g. Llama 3's <|eot_id|>)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False))
    return ids


@dataclass
class _Full:
    """One conversation rendered, tokenized, located and masked (before truncation)."""
    messages: list[dict]   # as in the record (system messages where they were)
    shown: list[dict]      # as rendered (system folded where the template refuses one)
    origin: list | None    # record message -> (rendered message, offset of its text there); None: the same
    tokens: Tokens
    layout: tuple[Skeleton, Placement] | None
    mask: np.ndarray = field(default=None)
    ends: list[int] = field(default_factory=list)


class ChatEncoder:
    """Encodes conversations for one tokenizer and settings; `encode_batch` renders and tokenizes a batch
    at once (the common case: one render per conversation), truncation re-renders one at a time."""

    def __init__(self, tokenizer, settings: ChatSettings, tokens=None):
        self.settings = settings
        self.renderer = Renderer(tokenizer, json.loads(settings.template_kwargs))
        self.layouts = Layouts(lambda messages, generation: self.renderer.one(messages, generation))
        self.tokens = tokens or HFTokens(tokenizer.backend_tokenizer)
        specials, added = special_ids(tokenizer), set(tokenizer.added_tokens_decoder)
        size = max(len(tokenizer), max(specials | added, default=0) + 1)
        self.is_special, self.is_added = np.zeros(size, dtype=bool), np.zeros(size, dtype=bool)
        self.is_special[list(specials)] = True
        self.is_added[list(specials | added)] = True  # the template's vocabulary: also Qwen3's <think>

    # ---- whole batches ------------------------------------------------------------------------------
    def encode_batch(self, conversations: list[list[dict]]) -> list[Encoded | Dropped]:
        shown = [self._show(m) for m in conversations]
        texts = self.renderer.many([s for s, _ in shown])
        good = [i for i, t in enumerate(texts) if isinstance(t, str)]
        tokens = dict(zip(good, self.tokens([texts[i] for i in good])))
        out = []
        for i, messages in enumerate(conversations):
            if i not in tokens:
                out.append(Dropped("template_refused", str(texts[i])))
                continue
            full = self._located(messages, *shown[i], tokens[i])
            out.append(full if isinstance(full, Dropped) else self._fit(full))
        return out

    def encode(self, messages: list[dict]) -> Encoded | Dropped:
        return self.encode_batch([messages])[0]

    def template_tokens(self, ids: list[np.ndarray]) -> set[int]:
        """The special and added tokens among `ids`: what the template writes (headers, end-of-turn, BOS,
        `<think>`), whose embedding rows a base model may never have trained (LoRA trains them)."""
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        return set(np.unique(flat[self.is_added[flat]]).tolist())

    # ---- one conversation -----------------------------------------------------------------------------
    def _show(self, messages: list[dict]) -> tuple[list[dict], list | None]:
        if self.settings.system == "fold" and any(m["role"] == "system" for m in messages):
            return fold(messages)
        return messages, None  # nothing folded: each message is where it was

    def full(self, messages: list[dict]) -> _Full | Dropped:
        """One conversation rendered, tokenized, located and masked, before truncation."""
        shown, origin = self._show(messages)
        try:
            text = self.renderer.one(shown)
        except ConfigError as e:
            return Dropped("template_refused", str(e))
        return self._located(messages, shown, origin, self.tokens([text])[0])

    def _located(self, messages, shown, origin, tokens: Tokens) -> _Full | Dropped:
        layout = self.layouts.locate(shown, tokens.text)
        inline = split_reasoning(shown) if layout is None else None
        if inline is not None and self._renders_as(inline, tokens.text):  # the template splits <think> itself
            shown, layout = inline, self.layouts.locate(inline, tokens.text)
        if layout is None and self.settings.train_on != "all":
            return Dropped("template_changed", "the chat template changes a message's text (beyond trimming "
                           "whitespace), so its tokens cannot be told from the template's", len(tokens.ids))
        full = _Full(messages, shown, origin, tokens, layout)
        full.mask, full.ends = self._mask(full)
        return full

    def prompt_ids(self, messages: list[dict]) -> np.ndarray | Dropped:
        """The ids of `messages` with the generation prompt: what the model reads before it writes a reply
        (preference pairs check that they prefix prompt + reply)."""
        try:
            text = self.renderer.one(self._show(messages)[0], generation=True)
        except ConfigError as e:
            return Dropped("template_refused", str(e))
        return self.tokens([text])[0].ids

    def _renders_as(self, messages: list[dict], text: str) -> bool:
        try:
            return self.renderer.one(messages) == text
        except ConfigError:
            return False

    def _mask(self, full: _Full) -> tuple[np.ndarray, list[int]]:
        """The targets of the trained assistant turns, and every assistant turn's end-of-turn id."""
        t, n = full.tokens, len(full.tokens.ids)
        mask = np.zeros(n, dtype=bool)
        if self.settings.train_on == "all":
            mask[1:] = True
        if full.layout is None:
            return mask, []
        sk, pl = full.layout
        replies = [i for i, m in enumerate(full.shown) if m["role"] == "assistant" and i in sk.spread]
        trained = replies[-1:] if self.settings.train_on == "last" else replies
        ends = []
        for i in replies:  # one without a field (empty, or left out by the template) has nothing to train
            first, last = sk.spread[i]
            lit, offset = sk.output.get(i, (None, 0))
            begin = pl.literal_starts[lit] + offset if lit is not None else pl.spans[first][0]
            after = pl.spans[last + 1][0] if last + 1 < len(pl.spans) else len(t.text)
            stop = t.unit(after)
            j = int(np.searchsorted(t.starts, t.unit(pl.spans[last][1])))
            while j < n and t.starts[j] < stop and not self.is_special[t.ids[j]]:
                j += 1
            if j == n or t.starts[j] >= stop:
                raise ConfigError(f"the chat template writes no special end-of-turn token after assistant message "
                                  f"{i}, so the model could not learn to stop")
            if i in trained:
                mask[int(np.searchsorted(t.ends, t.unit(begin), side="right")):j + 1] = True
            ends.append(int(t.ids[j]))
        return mask, ends

    def _result(self, full: _Full, truncated: bool, cut: int | None = None) -> Encoded | Dropped:
        ids, mask = full.tokens.ids[:cut], full.mask[:cut]
        if not mask[1:].any():  # the first token is never a target: nothing precedes it
            why = f"no reply token left after the cut to model.block_size={cut}" if cut else "no reply to train on"
            return Dropped("nothing_to_learn", why, len(full.tokens.ids))
        return Encoded(ids, mask, full.ends[0] if full.ends else -1, truncated)

    # ---- truncation ---------------------------------------------------------------------------------
    def _fit(self, full: _Full) -> Encoded | Dropped:
        block, how = self.settings.block_size, self.settings.truncation
        if len(full.tokens.ids) <= block:
            return self._result(full, False)
        if how == "right":
            return self._result(full, True, block)
        got = self.keep_end(full) if how == "keep_end" else self._turns(full)
        if isinstance(got, _Full):
            return self._result(got, True)
        if isinstance(got, Dropped) and not got.tokens:
            got.tokens = len(full.tokens.ids)
        return got

    def _turns(self, full: _Full) -> Encoded | Dropped:
        """The longest prefix that ends at an assistant turn and fits; else the first exchange cut on the right."""
        block, messages = self.settings.block_size, full.messages
        ends = [k + 1 for k, m in enumerate(messages) if m["role"] == "assistant"]
        for k in reversed(ends[:-1]):
            shorter = self.full(messages[:k])
            if isinstance(shorter, Dropped) or len(shorter.tokens.ids) <= block:
                return shorter if isinstance(shorter, Dropped) else self._result(shorter, True)
        first = self.full(messages[:ends[0]]) if ends else full
        return first if isinstance(first, Dropped) else self._result(first, True, block)

    def keep_end(self, full: _Full) -> _Full | Dropped:
        """Oldest exchanges dropped first (the system messages before the first one stay), then the prompt
        of the one left cut from its start; a reply is never cut. The conversation that fits (its `messages`
        are the ones kept), or why none does."""
        messages = full.messages
        system = next((k for k, m in enumerate(messages) if m["role"] != "system"), len(messages))
        last = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if last < system:
            return Dropped("nothing_to_learn", "no assistant turn", len(full.tokens.ids))
        rest = messages[system:last + 1]  # what follows the last reply teaches nothing
        starts = [k for k in range(len(rest))  # each exchange starts at a user turn
                  if k == 0 or (rest[k]["role"] == "user" and rest[k - 1]["role"] != "user")]
        for s in starts:
            candidate = self.full(messages[:system] + rest[s:])
            if isinstance(candidate, Dropped) or len(candidate.tokens.ids) <= self.settings.block_size:
                return candidate
        return self._cut_prompt(candidate, system)

    def _cut_prompt(self, full: _Full, system: int) -> _Full | Dropped:
        """Cut the prompt before the first reply from its start, at the token boundaries of the rendering,
        re-rendered until it fits (a cut can change how the text left tokenizes)."""
        block = self.settings.block_size
        reply = next(k for k, m in enumerate(full.messages) if m["role"] == "assistant")
        while len(full.tokens.ids) > block:
            k = next((k for k in range(system, reply) if full.messages[k]["content"]), None)
            cut = None if k is None else self._cut_point(full, k, len(full.tokens.ids) - block)
            if cut is None:
                return Dropped("too_long", f"the system message and the last exchange's reply alone take more than "
                               f"model.block_size={block} tokens")
            messages = [dict(m) for m in full.messages]
            messages[k]["content"] = messages[k]["content"][cut:]
            full = self.full(messages)
            if isinstance(full, Dropped):
                return full
        return full

    def _cut_point(self, full: _Full, k: int, excess: int) -> int | None:
        """How many characters to cut from the start of record message k's text to lose about `excess`
        tokens: the start of the token `excess` tokens into it (all of it when it has fewer)."""
        if full.layout is None:
            return None
        sk, pl = full.layout
        shown, offset = full.origin[k] if full.origin else (k, 0)
        content = full.messages[k]["content"]
        where = [j for j, f in enumerate(sk.fields) if f == 2 * shown]
        if not where:
            return len(content)
        start, end, trimmed = pl.spans[where[0]]
        begin = start + max(offset - trimmed, 0)  # where the message's own text starts in the rendering
        t = full.tokens
        inside = np.flatnonzero((t.starts >= t.unit(begin)) & (t.starts < t.unit(end)))
        if len(inside) <= excess:
            return len(content)
        cut = t.char(int(t.starts[inside[excess]])) - begin
        return min(max(cut, 1), len(content))
