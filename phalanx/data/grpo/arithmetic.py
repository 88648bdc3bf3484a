"""The built-in GRPO task (data.train empty): arithmetic questions with checkable answers, generated from
fixed seeds, so every machine has the same prompts offline. The training set and the held-out set (the
validation split; data.val_fraction does not apply) share no question.

    {"prompt": "What is 47 + 38? Answer with the number only.", "answer": "85"}

One or two operations on numbers up to 99 (products of numbers up to 12): easy enough that a small instruct
model gets some right at the start (a group whose rewards all agree teaches nothing) and can learn the rest.
"""
from __future__ import annotations

import random

TRAIN_SIZE, HELD_OUT_SIZE = 4000, 200
TRAIN_SEED, HELD_OUT_SEED = 20_251_207, 7_021_152


def _question(rng: random.Random) -> tuple[str, int]:
    kind = rng.randrange(4)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 40)
    if kind == 0:
        return f"{a} + {b}", a + b
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{a} - {b}", a - b
    if kind == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"{a} * {b}", a * b
    return f"{a} + {b} - {c}", a + b - c


def _problems(seed: int, n: int, exclude: set[str]) -> list[dict]:
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        text, value = _question(rng)
        if text in seen:
            continue
        seen.add(text)
        out.append({"prompt": f"What is {text}? Answer with the number only.", "answer": str(value)})
    return out


def held_out() -> list[dict]:
    return _problems(HELD_OUT_SEED, HELD_OUT_SIZE, set())


def train() -> list[dict]:
    """The training questions: none of them is held out."""
    held = {r["prompt"].removeprefix("What is ").removesuffix("? Answer with the number only.") for r in held_out()}
    return _problems(TRAIN_SEED, TRAIN_SIZE, held)
