"""Preference pairs: records in TRL's formats -> (prompt, chosen, rejected) messages, checked.

    explicit  {"prompt": ..., "chosen": ..., "rejected": ...}: text (the prompt is a user turn, each reply an
              assistant turn; an optional system field as in chat's prompt_completion) or lists of messages
              (the prompt a conversation, each reply a list of assistant messages)
    implicit  {"chosen": [...], "rejected": [...]}: two whole conversations; the messages both start with
              are the prompt, the rest of each (assistant messages) its reply (TRL's extract_prompt)

`preference.format` (auto = explicit where a record has the prompt field) and the field names
(`preference.prompt_field`, `chosen_field`, `rejected_field`, `system_field`) are config keys. A
malformed record is a ConfigError naming the field (the caller adds file and line): a missing field, a
reply that is neither text nor a list of messages, a reply holding a user turn, two replies that are the
same, or (implicit) two conversations that share no prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

from phalanx.core.errors import ConfigError
from phalanx.data.chat.formats import ChatFields, to_messages

FORMATS = ("explicit", "implicit")


@dataclass(frozen=True)
class PairFields:
    """The record keys a pair is read from."""
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    system: str = "system"


def pair_fields(p) -> PairFields:
    """The keys from the config's preference section (empty = the default name)."""
    return PairFields(p.prompt_field or "prompt", p.chosen_field or "chosen", p.rejected_field or "rejected",
                      p.system_field or "system")


@dataclass
class Pair:
    prompt: list[dict]     # the messages before the reply (system, user, earlier turns)
    chosen: list[dict]     # the better reply: assistant messages
    rejected: list[dict]   # the worse one


def detect(row: dict, fields: PairFields, where: str) -> str:
    if fields.prompt in row:
        return "explicit"
    if fields.chosen in row or fields.rejected in row:
        return "implicit"
    keys = ", ".join(sorted(map(str, row)))[:200]
    raise ConfigError(f"{where}: not a preference pair (expected fields '{fields.prompt}', '{fields.chosen}', "
                      f"'{fields.rejected}', or '{fields.chosen}' and '{fields.rejected}' alone; got {keys}); set "
                      f"preference.prompt_field / chosen_field / rejected_field")


def to_pair(row, fields: PairFields, pair_format: str, where: str) -> Pair:
    """A record as a checked Pair; a malformed one is a ConfigError naming the field."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    fmt = pair_format if pair_format != "auto" else detect(row, fields, where)
    for key in (fields.chosen, fields.rejected):
        if key not in row:
            raise ConfigError(f"{where}: missing field '{key}' (fields: {', '.join(sorted(map(str, row)))[:200]})")
    pair = _explicit(row, fields, where) if fmt == "explicit" else _implicit(row, fields, where)
    if pair.chosen == pair.rejected:
        raise ConfigError(f"{where}: field '{fields.rejected}': the same reply as '{fields.chosen}' (a pair needs "
                          f"two different replies)")
    return pair


def _explicit(row: dict, fields: PairFields, where: str) -> Pair:
    if fields.prompt not in row:
        raise ConfigError(f"{where}: missing field '{fields.prompt}' (preference.format=explicit)")
    value = row[fields.prompt]
    if isinstance(value, str):
        system = row.get(fields.system)
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"{where}: field '{fields.system}' should be text, got {type(system).__name__}")
        prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": value}]
    elif isinstance(value, list):
        prompt = _messages(row, fields.prompt, where)
    else:
        raise ConfigError(f"{where}: field '{fields.prompt}' should be text or a list of messages, got "
                          f"{type(value).__name__}")
    return Pair(prompt, _reply(row, fields.chosen, where), _reply(row, fields.rejected, where))


def _reply(row: dict, key: str, where: str, skip: int = 0) -> list[dict]:
    """An explicit reply: text (one assistant turn) or a list of assistant messages."""
    value = row[key]
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list):
        raise ConfigError(f"{where}: field '{key}' should be text or a list of messages, got {type(value).__name__}")
    return _assistant_only(_messages(row, key, where), key, where, skip)


def _assistant_only(messages: list[dict], key: str, where: str, skip: int) -> list[dict]:
    reply = messages[skip:]
    if not reply:
        raise ConfigError(f"{where}: field '{key}': no reply (an empty list, or nothing after the prompt)")
    for i, m in enumerate(reply, start=skip):
        if m["role"] != "assistant":
            raise ConfigError(f"{where}: field '{key}[{i}].role': a reply holds assistant messages, got "
                              f"'{m['role']}'")
    return reply


def _messages(row: dict, key: str, where: str) -> list[dict]:
    """A list of messages (chat's `messages` format, read from `key`)."""
    return to_messages(row, ChatFields("messages", (("messages", key),)), where)


def _implicit(row: dict, fields: PairFields, where: str) -> Pair:
    for key in (fields.chosen, fields.rejected):
        if not isinstance(row[key], list):
            raise ConfigError(f"{where}: field '{key}' should be a list of messages (the implicit format: two whole "
                              f"conversations sharing their prompt), got {type(row[key]).__name__}; text replies "
                              f"need a '{fields.prompt}' field")
    chosen, rejected = _messages(row, fields.chosen, where), _messages(row, fields.rejected, where)
    if chosen == rejected:
        raise ConfigError(f"{where}: field '{fields.rejected}': the same conversation as '{fields.chosen}' (a pair "
                          f"needs two different replies)")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ConfigError(f"{where}: fields '{fields.chosen}' and '{fields.rejected}' share no prompt (the implicit "
                          f"format's prompt is the messages both conversations start with)")
    return Pair(chosen[:shared], _assistant_only(chosen, fields.chosen, where, shared),
                _assistant_only(rejected, fields.rejected, where, shared))
