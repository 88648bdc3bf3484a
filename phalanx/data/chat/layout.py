"""Where each message sits in a rendered conversation, found by structure, never by searching for its text
(a reply "e" or "in" also occurs in the template's markup: `<|im_end|>`, `<think>`).

The conversation is rendered once more with a unique marker in place of each text field (a message's
content, and its `reasoning_content` where it has one): the markers' positions cut that rendering into the
template's own text (`literals`) and the fields between them. Laid over the real rendering, the literals
must match exactly and each field must be its message's text, or that text with whitespace trimmed at
its ends (templates `| trim` content, Qwen3 strips reasoning): `place` checks that, so the positions are
right or the conversation is refused — never guessed. Each assistant turn's output starts where the
generation prompt for the messages before it ends (`add_generation_prompt`), when that prompt is how the
turn begins (Qwen3 without reasoning opens its turn with `<think>\\n\\n</think>\\n\\n`, which the model
writes) and the template writes one at all; else at its first field.

Markup depends on the conversation's shape (roles, which fields are empty or present), rarely on its
text, so a skeleton is made once per shape and reused: one render per conversation. Where a template
does branch on the text, the reused skeleton does not fit (`place` says so) and one is made for that
conversation.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

MARK = "\ue000{}\ue001"  # private-use characters: in no template's markup
_MARK = re.compile("\ue000([0-9]+)\ue001")
FIELDS = ("content", "reasoning_content")  # field id = 2 * message + index here
# How templates change a field's text: not at all, or whitespace trimmed at its ends.
# (characters, from the left, from the right)
_TRIMS = ((None, True, True), (None, True, False), (None, False, True), ("\n", True, True), ("\n", True, False),
          ("\n", False, True))


def values(messages: list[dict]) -> tuple[tuple, dict[int, str]]:
    """The conversation's shape (roles, which text fields are set) and its non-empty text fields by field id."""
    key, vals = [], {}
    for i, m in enumerate(messages):
        content, reasoning = m.get("content"), m.get("reasoning_content")
        key.append((m["role"], bool(content), bool(reasoning)))
        if content and isinstance(content, str):
            vals[2 * i] = content
        if reasoning and isinstance(reasoning, str):
            vals[2 * i + 1] = reasoning
    return tuple(key), vals


def _marked(messages: list[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        marked = dict(m)
        for j, name in enumerate(FIELDS):
            if isinstance(m.get(name), str) and m[name]:  # an empty field stays empty: templates test for it
                marked[name] = MARK.format(2 * i + j)
        out.append(marked)
    return out


@dataclass(frozen=True)
class Skeleton:
    literals: tuple[str, ...]   # the template's text around the fields (one more than fields)
    fields: tuple[int, ...]     # field id of each field in order of appearance
    output: dict                # assistant message -> (literal index, offset): where its output starts
    spread: dict                # message -> (index of its first field, of its last field) in `fields`


def skeleton(render: Callable[[list[dict], bool], str], messages: list[dict]) -> Skeleton:
    """The markup of `messages`' shape; `render(messages, generation_prompt)` may raise (refused)."""
    marked = _marked(messages)
    text = render(marked, False)
    literals, fields, pos = [], [], 0
    for m in _MARK.finditer(text):
        literals.append(text[pos:m.start()])
        fields.append(int(m.group(1)))
        pos = m.end()
    literals.append(text[pos:])
    starts, at = [], 0  # each literal's position in the marked text
    for lit, f in zip(literals, [*fields, None]):
        starts.append(at)
        at += len(lit) + (len(MARK.format(f)) if f is not None else 0)
    output = {}
    for i, m in enumerate(messages):
        first = next((k for k, f in enumerate(fields) if f // 2 == i), None)
        if m["role"] != "assistant" or first is None:
            continue
        try:
            prompt, before = render(marked[:i], True), render(marked[:i], False)
        except Exception:  # a template that refuses a conversation ending before a reply
            continue
        # the prompt counts only where the template writes one (many ignore add_generation_prompt)
        if len(prompt) > len(before) and prompt.startswith(before) and text.startswith(prompt):
            k = max(k for k in range(first + 1) if starts[k] <= len(prompt))
            if len(prompt) - starts[k] <= len(literals[k]):
                output[i] = (k, len(prompt) - starts[k])
    spread = {}
    for k, f in enumerate(fields):
        spread[f // 2] = (spread.get(f // 2, (k, k))[0], k)
    return Skeleton(tuple(literals), tuple(fields), output, spread)


@dataclass
class Placement:
    """A skeleton laid over the real text: where each literal starts, and each field's (start, end) and
    the offset in its message's text where the rendered part begins (templates may trim)."""
    literal_starts: list[int]
    spans: list[tuple[int, int, int]]


def place(sk: Skeleton, vals: dict[int, str], text: str) -> Placement | None:
    """The skeleton over `text`, or None when `text` is not the skeleton with these values (trimmed or not)
    in its fields. Each field's text is tried untrimmed first; trims only when backtracking to it."""
    lits, fields = sk.literals, sk.fields
    if not text.startswith(lits[0]):
        return None
    n = len(fields)
    choices: list = []  # per field: None (untrimmed taken), or an iterator over the trims not yet tried
    lit_starts, spans, pos, k = [0], [], len(lits[0]), 0
    while k < n:
        value, after, last = vals.get(fields[k], ""), lits[k + 1], k + 1 == n
        if len(choices) == k:  # first visit: the text as it is
            end = pos + len(value)
            if text.startswith(value, pos) and text.startswith(after, end) and \
                    (not last or end + len(after) == len(text)):
                choices.append(None)
                found = (0, len(value))
            else:
                choices.append(_candidates(value, text, pos, after, last))
                found = next(choices[k], None)
        else:  # back here: the next trim
            if choices[k] is None:
                choices[k] = _candidates(value, text, pos, after, last)
            found = next(choices[k], None)
        if found is None:  # no candidate left here: back to the previous field's next one
            choices.pop()
            if k == 0:
                return None
            k -= 1
            spans.pop()
            lit_starts.pop()
            pos = lit_starts[-1] + len(lits[k])
            continue
        offset, length = found
        spans.append((pos, pos + length, offset))
        lit_starts.append(pos + length)
        pos += length + len(after)
        k += 1
    return Placement(lit_starts, spans) if pos == len(text) else None


def _candidates(value: str, text: str, pos: int, after: str, last: bool) -> Iterator[tuple[int, int]]:
    """(offset in value, length) of each trim of `value` that `text` has at `pos`, followed by `after`."""
    seen = {(0, len(value))}  # untrimmed: tried first by `place`
    for chars, left, right in _TRIMS:
        lo = len(value) - len(value.lstrip(chars)) if left else 0
        hi = max(len(value.rstrip(chars)) if right else len(value), lo)
        if (lo, hi) in seen:
            continue
        seen.add((lo, hi))
        end = pos + hi - lo
        if text.startswith(value[lo:hi], pos) and text.startswith(after, end) and \
                (not last or end + len(after) == len(text)):
            yield lo, hi - lo


class Layouts:
    """Skeletons by conversation shape, made on first use (bounded: a corpus has few shapes)."""

    def __init__(self, render: Callable[[list[dict], bool], str], limit: int = 4096):
        self.render, self.limit = render, limit
        self.cache: dict[tuple, Skeleton] = {}

    def locate(self, messages: list[dict], text: str) -> tuple[Skeleton, Placement] | None:
        """The skeleton of `messages` and its placement over their rendering `text`, or None when the
        template changes a text field in other ways than trimming (then no mask can be trusted)."""
        key, vals = values(messages)
        sk = self.cache.get(key)
        if sk is not None:
            found = place(sk, vals, text)
            if found is not None:
                return sk, found
        fresh = skeleton(self.render, messages)
        found = place(fresh, vals, text)
        if found is None:
            return None
        if len(self.cache) >= self.limit:
            self.cache.clear()
        self.cache[key] = fresh
        return fresh, found
