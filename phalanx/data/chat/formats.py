"""Chat records in the formats users have, turned into messages; a record's format detected from its keys.

Formats (`chat.format`, auto = detected from a record's keys):
    messages            {"messages": [{"role": "system|user|assistant", "content": "...",
                                       "reasoning_content": "... (optional, assistant)"}]}   (OpenAI)
    sharegpt            {"conversations": [{"from": "system|human|gpt", "value": "..."}]}
    alpaca              {"instruction": "...", "input": "... (optional)", "output": "..."}
    prompt_completion   {"prompt": "...", "completion": "..."}
Rendering, where each message sits in the rendering (by structure) and the loss mask are template.py,
layout.py and encode.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from phalanx.core.errors import ConfigError

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# The record keys each format is read from, unless the config names others (chat.*_field).
DEFAULT_FIELDS = {"messages": {"messages": "messages"}, "sharegpt": {"messages": "conversations"},
                  "alpaca": {"prompt": "instruction", "input": "input", "completion": "output", "system": "system"},
                  "prompt_completion": {"prompt": "prompt", "completion": "completion", "system": "system"}}
REASONING = "reasoning_content"  # an assistant turn's reasoning (Qwen3's template renders it in <think>)


@dataclass(frozen=True)
class ChatFields:
    """A resolved format and the record keys it reads (names of chat.messages_field etc.)."""
    format: str
    names: tuple  # ((role of the key, key), ...) e.g. (("messages", "messages"),)

    def key(self, part: str) -> str:
        return dict(self.names)[part]


def chat_fields(fmt: str, overrides: dict[str, str]) -> ChatFields:
    """The keys of format `fmt`, with non-empty `overrides` (part -> key) from the config."""
    names = {**DEFAULT_FIELDS[fmt], **{k: v for k, v in overrides.items() if v and k in DEFAULT_FIELDS[fmt]}}
    return ChatFields(fmt, tuple(sorted(names.items())))


def detect(row, where: str) -> str:
    """The format of a record from its keys (chat.format=auto)."""
    if isinstance(row, dict):
        for fmt, probe in (("messages", "messages"), ("sharegpt", "conversations"), ("alpaca", "instruction"),
                           ("prompt_completion", "prompt")):
            if probe in row:
                return fmt
    keys = ", ".join(sorted(map(str, row)))[:200] if isinstance(row, dict) else type(row).__name__
    raise ConfigError(f"{where}: not a conversation in a known format (expected a key 'messages', "
                      f"'conversations', 'instruction' or 'prompt'; got {keys}); set chat.format")


def _text(value, where: str, field: str) -> str:
    if isinstance(value, str):
        return value
    # OpenAI content parts, text only
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ConfigError(f"{where}: field '{field}' should be text, got {type(value).__name__}")


def to_messages(row, fields: ChatFields, where: str) -> list[dict]:
    """A record as [{"role", "content"(, "reasoning_content")}], checked: known roles, text fields."""
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
            message = {"role": role, "content": _text(turn[content_key], where, f"{at}.{content_key}")}
            if turn.get(REASONING) is not None and role == "assistant":
                message[REASONING] = _text(turn[REASONING], where, f"{at}.{REASONING}")
            messages.append(message)
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
    return messages  # one without an assistant turn is dropped and counted (nothing to learn)
