"""Conversations for chat fine-tuning: records in the formats users have, turned into messages; rendered
with the tokenizer's chat template; the loss mask from character offsets; truncation to the context.

Formats (`data.chat_format`, auto = detected from a record's keys):
    messages            {"messages": [{"role": "system|user|assistant", "content": "..."}]}   (OpenAI)
    sharegpt            {"conversations": [{"from": "system|human|gpt", "value": "..."}]}
    alpaca              {"instruction": "...", "input": "... (optional)", "output": "..."}
    prompt_completion   {"prompt": "...", "completion": "..."}
The mask is computed from the rendered text, not from marker strings in ids, so it is right for any
template: a token is supervised when its character span overlaps the content of a message being trained
on, or when it is that message's end-of-turn token (the first special token the template writes after the
content). The ids are exactly `apply_chat_template(messages, tokenize=True)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phalanx.core.errors import ConfigError

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# The record keys each format is read from, unless the config names others (data.*_field).
DEFAULT_FIELDS = {"messages": {"messages": "messages"}, "sharegpt": {"messages": "conversations"},
                  "alpaca": {"prompt": "instruction", "input": "input", "completion": "output", "system": "system"},
                  "prompt_completion": {"prompt": "prompt", "completion": "completion", "system": "system"}}

# phalanx's template for tokenizers without one (ChatML). The {% generation %} markers let transformers'
# `return_assistant_tokens_mask` and TRL's `assistant_only_loss` find the same tokens phalanx trains on.
START, END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclass(frozen=True)
class ChatFields:
    """A resolved format and the record keys it reads (names of data.messages_field etc.)."""
    format: str
    names: tuple  # ((role of the key, key), ...) e.g. (("messages", "messages"),)

    def key(self, part: str) -> str:
        return dict(self.names)[part]


def chat_fields(fmt: str, overrides: dict[str, str]) -> ChatFields:
    """The keys of format `fmt`, with non-empty `overrides` (part -> key) from the config."""
    names = {**DEFAULT_FIELDS[fmt], **{k: v for k, v in overrides.items() if v and k in DEFAULT_FIELDS[fmt]}}
    return ChatFields(fmt, tuple(sorted(names.items())))


def detect(row, where: str) -> str:
    """The format of a record from its keys (data.chat_format=auto)."""
    if isinstance(row, dict):
        for fmt, probe in (("messages", "messages"), ("sharegpt", "conversations"), ("alpaca", "instruction"),
                           ("prompt_completion", "prompt")):
            if probe in row:
                return fmt
    keys = ", ".join(sorted(map(str, row)))[:200] if isinstance(row, dict) else type(row).__name__
    raise ConfigError(f"{where}: not a conversation in a known format (expected a key 'messages', "
                      f"'conversations', 'instruction' or 'prompt'; got {keys}); set data.chat_format")


def _text(value, where: str, field: str) -> str:
    if isinstance(value, str):
        return value
    # OpenAI content parts, text only
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ConfigError(f"{where}: field '{field}' should be text, got {type(value).__name__}")


def to_messages(row, fields: ChatFields, where: str) -> list[dict]:
    """A record as [{"role", "content"}], checked: known roles, text content, at least one assistant turn."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    fmt = fields.format
    if fmt in ("messages", "sharegpt"):
        key = fields.key("messages")
        turns = row.get(key)
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            got = "missing" if key not in row else type(turns).__name__
            raise ConfigError(f"{where}: field '{key}' should be a list of objects, got {got}")
        role_key, content_key = ("role", "content") if fmt == "messages" else ("from", "value")
        messages = []
        for i, turn in enumerate(turns):
            at = f"{key}[{i}]"
            raw = turn.get(role_key)
            role = raw if fmt == "messages" else SHAREGPT_ROLES.get(raw)
            if role not in ROLES:
                known = ROLES if fmt == "messages" else tuple(SHAREGPT_ROLES)
                raise ConfigError(f"{where}: field '{at}.{role_key}': unknown role {raw!r}, expected one of {known}")
            if content_key not in turn:
                raise ConfigError(f"{where}: field '{at}': missing '{content_key}'")
            messages.append({"role": role, "content": _text(turn[content_key], where, f"{at}.{content_key}")})
    else:
        for part in ("prompt", "completion"):
            if fields.key(part) not in row:
                raise ConfigError(f"{where}: missing field '{fields.key(part)}' (fields: "
                                  f"{', '.join(sorted(map(str, row)))[:200]})")
        prompt = _text(row[fields.key("prompt")], where, fields.key("prompt"))
        extra = row.get(fields.key("input")) if fmt == "alpaca" else None
        if extra:
            prompt = f"{prompt}\n\n{_text(extra, where, fields.key('input'))}"
        system = row.get(fields.key("system"))
        messages = ([{"role": "system", "content": _text(system, where, fields.key("system"))}] if system else []) + [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": _text(row[fields.key("completion")], where, fields.key("completion"))}]
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: conversation has no assistant turn (nothing to learn from)")
    return messages


# ---- templates ----------------------------------------------------------------------------------
def ensure_template(tokenizer) -> bool:
    """Give a tokenizer without a chat template phalanx's ChatML one, with <|im_start|>/<|im_end|> as
    special tokens. Returns True when tokens were added (the model's embeddings must grow)."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.add_special_tokens({"additional_special_tokens": [START, END]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return True


def special_ids(tokenizer) -> set[int]:
    """Every special token id: the named ones and added tokens marked special (e.g. Llama 3's <|eot_id|>)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False))
    return ids


def render(tokenizer, messages: list[dict], where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # a template's own raise_exception (e.g. roles must alternate) or a jinja error
        raise ConfigError(f"{where}: the chat template refused this conversation "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


def content_spans(tokenizer, messages: list[dict], text: str, where: str) -> list[tuple[int, int, int]]:
    """(content start, content end, region end) of every message in the rendered `text`. A message's
    region runs to where the next message's rendering starts: found from renderings of the prefixes,
    which most templates produce as prefixes of the whole; else the contents are searched in order."""
    try:
        parts = [render(tokenizer, messages[:k], where) for k in range(1, len(messages))]
    except ConfigError:  # a template that refuses a prefix (e.g. one ending with a user turn)
        parts = None
    prefixes = parts is not None and all(text.startswith(p) for p in parts)
    ends = [len(p) for p in parts] + [len(text)] if prefixes else []
    spans, pos = [], 0
    for i, m in enumerate(messages):
        lo, hi = (ends[i - 1] if i else 0, ends[i]) if prefixes else (pos, len(text))
        region = text[lo:hi]
        content = m["content"] if m["content"] in region else m["content"].strip()
        # The content follows its role header, so within its own region it is the last occurrence.
        found = region.rfind(content) if prefixes else region.find(content)
        if found < 0:
            if m["role"] == "assistant":
                raise ConfigError(f"{where}: the chat template does not render message {i}'s content verbatim, "
                                  f"so its tokens cannot be found for the loss mask")
            found = 0
            content = ""
        start = lo + found
        spans.append((start, start + len(content), hi))
        pos = start + len(content)
    if not prefixes:  # regions end where the next message's content begins
        spans = [(s, e, spans[i + 1][0] if i + 1 < len(spans) else len(text)) for i, (s, e, _) in enumerate(spans)]
    return spans


@dataclass
class Encoded:
    ids: np.ndarray      # int64 token ids of the rendered conversation
    mask: np.ndarray     # bool: the token is a training target
    end_of_turn: int     # id of the assistant's end-of-turn token (-1 when no assistant turn is trained)


def _mask(tokenizer, messages, text, train_on: str, where: str) -> tuple[list[int], np.ndarray, int]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = np.zeros(len(ids), dtype=bool)
    if train_on == "all":
        mask[1:] = True
        return ids, mask, -1
    spans = content_spans(tokenizer, messages, text, where)
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last":
        trained = trained[-1:]
    specials, eot = special_ids(tokenizer), -1
    starts = np.asarray([a for a, _ in offsets])
    ends = np.asarray([b for _, b in offsets])
    for i in trained:
        lo, hi, region_end = spans[i]
        mask |= (starts < hi) & (ends > lo) & (ends > starts)
        after = np.nonzero((starts >= hi) & (starts < region_end))[0]
        turn_end = next((int(t) for t in after if ids[t] in specials), None)
        if turn_end is None:
            raise ConfigError(f"{where}: the chat template writes no special end-of-turn token after assistant "
                              f"message {i}, so the model could not learn to stop")
        mask[turn_end] = True
        eot = ids[turn_end]
    return ids, mask, eot


def encode(tokenizer, messages: list[dict], train_on: str, block_size: int, truncation: str,
           where: str) -> Encoded | None:
    """Ids and loss mask of one conversation in at most `block_size` tokens, or None when nothing is left
    to train on. truncation 'turns' drops whole turns from the end (the system message stays; a first
    exchange longer than the block is cut on the right); 'right' cuts on the right."""
    text = render(tokenizer, messages, where)
    ids, mask, eot = _mask(tokenizer, messages, text, train_on, where)
    if len(ids) > block_size and truncation == "turns":
        ends = [k + 1 for k, m in enumerate(messages) if m["role"] == "assistant"]
        for k in reversed(ends[:-1]):  # longest prefix ending at an assistant turn that fits
            shorter = messages[:k]
            s_ids, s_mask, s_eot = _mask(tokenizer, shorter, render(tokenizer, shorter, where), train_on, where)
            if len(s_ids) <= block_size:
                ids, mask, eot = s_ids, s_mask, s_eot
                break
        else:  # not even the first exchange fits: cut it on the right
            first = messages[:ends[0]]
            ids, mask, eot = _mask(tokenizer, first, render(tokenizer, first, where), train_on, where)
    ids, mask = np.asarray(ids[:block_size], dtype=np.int64), mask[:block_size]
    if not mask[1:].any():  # the first token is never a target: nothing precedes it
        return None
    return Encoded(ids, mask, eot)
