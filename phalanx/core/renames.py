"""Config keys that moved in 0.2: a task's own keys left the flat `data` section for the task's section
(core/task_sections.py), so that no key means two things. The old names keep working for one release: in
config files, overrides and saved run configs (nested), and in the settings a checkpoint recorded (flat),
with one line naming the new keys.
"""
from __future__ import annotations

from phalanx.core.errors import ConfigError

UNTIL = "0.3"  # the release that drops the old names
MOVED = {"data.chat_format": "chat.format", "data.messages_field": "chat.messages_field",
         "data.input_field": "chat.input_field", "data.completion_field": "chat.completion_field",
         "data.train_on": "chat.train_on", "data.truncation": "chat.truncation",
         "data.template_kwargs": "template.kwargs", "data.system_message": "template.system_message",
         "data.pair_format": "preference.format", "data.chosen_field": "preference.chosen_field",
         "data.rejected_field": "preference.rejected_field", "data.text_pair_field": "classify.text_pair_field",
         "data.label_field": "classify.label_field", "data.labels": "classify.labels",
         "data.max_length": "classify.max_length", "data.val_max_tokens": "lm.val_max_tokens"}
# keys that meant one thing for chat and another for preference: each task's own section now
BY_TASK = {"data.prompt_field": "prompt_field", "data.system_field": "system_field"}


def new_name(old: str, task: str) -> str | None:
    """The key `old` is now, for `task`; None when it did not move."""
    if old in BY_TASK:
        return f"{'preference' if task == 'preference' else 'chat'}.{BY_TASK[old]}"
    return MOVED.get(old)


def migrate(raw: dict, task: str) -> list[str]:
    """Move the old keys of a nested config mapping to their new places, in place; returns 'old -> new' for
    each. An old and a new key both given with different values is an error naming both."""
    data, moved = raw.get("data"), []
    if not isinstance(data, dict):
        return moved
    for name in [k for k in data if new_name(f"data.{k}", task)]:
        old, new = f"data.{name}", new_name(f"data.{name}", task)
        section, key = new.split(".")
        target = raw.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"config key '{section}': expected a mapping, got {type(target).__name__}")
        value = data.pop(name)
        if key in target and target[key] != value:
            raise ConfigError(f"config keys '{old}' and '{new}' are one key (renamed) given two values, {value!r} "
                              f"and {target[key]!r}; keep '{new}'")
        target[key] = value
        moved.append(f"{old} -> {new}")
    return moved


def note(moved: list[str]) -> str:
    return f"phalanx: note: config keys renamed (the old names work until {UNTIL}): {', '.join(moved)}"


def migrate_flat(flat: dict) -> dict:
    """A checkpoint's recorded settings (dotted keys) under today's names."""
    task = flat.get("task", "lm")
    return {new_name(k, task) or k: v for k, v in flat.items()}
