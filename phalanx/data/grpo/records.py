"""A GRPO record -> its prompt (messages) and the fields the reward functions receive.

A record is a JSON object with `grpo.prompt_field` (text: one user turn, with an optional system message from
`grpo.system_field`; or a list of messages, as chat's `messages` format) and any other fields (a reference
answer, test cases): those are passed to every reward function as keyword lists, as TRL passes a dataset's
columns. A malformed record is a ConfigError naming the field (the caller adds file and line).
"""
from __future__ import annotations

from dataclasses import dataclass

from phalanx.core.errors import ConfigError
from phalanx.data.chat.formats import ChatFields, to_messages


@dataclass
class Prompt:
    messages: list[dict]      # system / user / earlier turns, ending before the reply the model writes
    conversational: bool      # the record gave messages (rewards then see completions as message lists)
    fields: dict              # the record's other fields (for the reward functions)


def to_prompt(row, prompt_field: str, system_field: str, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if prompt_field not in row:
        keys = ", ".join(sorted(map(str, row)))[:200]
        raise ConfigError(f"{where}: missing field '{prompt_field}' (fields: {keys}); set grpo.prompt_field")
    value = row[prompt_field]
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: field '{prompt_field}' is empty")
        system = row.get(system_field)
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"{where}: field '{system_field}' should be text, got {type(system).__name__}")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": value}]
        conversational, skip = False, {prompt_field, system_field}
    elif isinstance(value, list):
        messages = to_messages(row, ChatFields("messages", (("messages", prompt_field),)), where)
        if not messages:
            raise ConfigError(f"{where}: field '{prompt_field}': an empty list of messages")
        if messages[-1]["role"] == "assistant":
            raise ConfigError(f"{where}: field '{prompt_field}[{len(messages) - 1}].role': a prompt ends before the "
                              f"reply the model writes, got a last 'assistant' message")
        conversational, skip = True, {prompt_field}
    else:
        raise ConfigError(f"{where}: field '{prompt_field}' should be text or a list of messages, got "
                          f"{type(value).__name__}")
    return Prompt(messages, conversational, {k: v for k, v in row.items() if k not in skip})
