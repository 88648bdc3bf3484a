"""GRPO's reward functions: the built-in ones and a user's own, named by import path, called as TRL calls them.

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **fields) -> list[float | None]

`prompts` and `completions` are text, or (a record whose prompt was a list of messages) message lists, the
completion as [{"role": "assistant", "content": text}]; every other field of the records comes as a keyword
list (one value per completion), as TRL passes a dataset's columns. None means "not applicable" (NaN: left out
of the sums; a completion no function scores gets advantage 0, as in TRL). A function that raises or returns a
list of the wrong length stops the run with an error naming it.

Built in:
    math_answer  1.0 when the completion's answer (the last \\boxed{...}, else its last number) equals the
                 reference (grpo.answer_field: the number after '####' where there is one, as in GSM8K; commas,
                 signs and decimals handled), else 0.0; None when the reference holds no number
    format       1.0 when grpo.format_pattern is found in the completion (re.search, re.DOTALL), else 0.0
"""
from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from phalanx.core.config import Config, ConfigError

NUMBER = re.compile(r"[-+\u2212]?\$?\d[\d,]*(?:\.\d+)?|[-+\u2212]?\.\d+")
BOXED = "\\boxed{"


def parse_number(text: str) -> float | None:
    """The last number in `text` ('1,234' = 1234; '-5' and '\u22125' negative; '$12' = 12), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    raw = found[-1].replace(",", "").replace("$", "").replace("\u2212", "-")
    try:
        return float(raw)
    except ValueError:
        return None


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (braces nested), or None."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def reference_number(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        return None
    return parse_number(value.rsplit("####", 1)[-1] if "####" in value else value)


def answer_number(completion: str) -> float | None:
    boxed = last_boxed(completion)
    got = parse_number(boxed) if boxed is not None else None
    return got if got is not None else parse_number(completion)


def text_of(completion) -> str:
    """A completion as text (a conversational one is [{"role": "assistant", "content": ...}])."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def math_answer(answer_field: str) -> Callable:
    def math_answer(prompts, completions, completion_ids, **fields):
        out = []
        for completion, ref in zip(completions, fields.get(answer_field) or [None] * len(completions)):
            want = reference_number(ref)
            got = answer_number(text_of(completion))
            out.append(None if want is None else float(got is not None and math.isclose(got, want, abs_tol=1e-6)))
        return out
    return math_answer


def format_reward(pattern: str) -> Callable:
    rx = re.compile(pattern, re.DOTALL)

    def format_reward(prompts, completions, completion_ids, **fields):
        return [float(rx.search(text_of(c)) is not None) for c in completions]
    return format_reward


@dataclass
class Reward:
    name: str
    fn: Callable


def _imported(name: str) -> Callable:
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, AttributeError, or the module's own error
        raise ConfigError(f"config key 'grpo.reward_funcs': cannot import '{name}' ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ConfigError(f"config key 'grpo.reward_funcs': '{name}' is not callable")
    return fn


def load_rewards(cfg: Config) -> list[Reward]:
    """grpo.reward_funcs as callables (a ConfigError naming the bad entry, in the launcher)."""
    g = cfg.grpo
    if not g.reward_funcs:
        raise ConfigError("config key 'grpo.reward_funcs': empty; name at least one (math_answer, format, "
                          "module:function)")
    if g.reward_weights and len(g.reward_weights) != len(g.reward_funcs):
        raise ConfigError(f"config key 'grpo.reward_weights': {len(g.reward_weights)} weights for "
                          f"{len(g.reward_funcs)} reward functions")
    out = []
    for name in g.reward_funcs:
        if not isinstance(name, str):
            raise ConfigError(f"config key 'grpo.reward_funcs': expected names, got {name!r}")
        if name == "math_answer":
            out.append(Reward(name, math_answer(g.answer_field)))
        elif name == "format":
            if not g.format_pattern:
                raise ConfigError("config key 'grpo.format_pattern': empty, but grpo.reward_funcs has format; set "
                                  "the regular expression a completion must contain")
            try:
                out.append(Reward(name, format_reward(g.format_pattern)))
            except re.error as e:
                raise ConfigError(f"config key 'grpo.format_pattern': not a regular expression ({e})") from None
        elif ":" in name:
            out.append(Reward(name, _imported(name)))
        else:
            raise ConfigError(f"config key 'grpo.reward_funcs': unknown reward {name!r}; built in: math_answer, "
                              f"format; or 'module:function'")
    return out


def weights_of(cfg: Config) -> np.ndarray:
    g = cfg.grpo
    return np.asarray(g.reward_weights or [1.0] * len(g.reward_funcs), dtype=np.float64)


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          fields: list[dict]) -> np.ndarray:
    """(completions, functions) float64 rewards, NaN where a function returned None."""
    keys = sorted({k for f in fields for k in f})
    columns = {k: [f.get(k) for f in fields] for k in keys}
    out = np.full((len(completions), len(rewards)), np.nan)
    for j, r in enumerate(rewards):
        try:
            got = r.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:
            raise RuntimeError(f"reward function '{r.name}' raised {type(e).__name__}: {e}") from e
        if not hasattr(got, "__len__") or len(got) != len(completions):
            size = len(got) if hasattr(got, "__len__") else type(got).__name__
            raise RuntimeError(f"reward function '{r.name}' returned {size} values for {len(completions)} "
                               f"completions (one float or None per completion)")
        for i, v in enumerate(got):
            if v is None:
                continue
            try:
                out[i, j] = float(v)
            except (TypeError, ValueError):
                raise RuntimeError(f"reward function '{r.name}' returned {v!r} for completion {i}; expected a "
                                   f"float or None") from None
    return out
