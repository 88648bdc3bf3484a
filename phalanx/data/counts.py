"""What a store of units (units.py: chat conversations, preference pairs) kept, truncated and dropped, and
why — counted per piece, summed per split, and the gate that stops a run whose data step dropped too much
(data.max_dropped_fraction).

A piece's record (in the store index) holds its counts, the first dropped record of each reason (its row
in the piece and why) and its longest dropped record; locations (file and line) are found only when they
are shown, since counting lines is slow.
"""
from __future__ import annotations

from dataclasses import dataclass

from phalanx.data import readers

# prompt_not_prefix: preference pairs only (pref/encode.py), whose prompt must tokenize as a prefix of each reply's
REASONS = ("too_long", "template_refused", "template_changed", "nothing_to_learn", "prompt_not_prefix")


@dataclass
class Dropped:
    """A record that cannot be used."""
    reason: str           # one of REASONS
    detail: str
    tokens: int = 0       # the whole record's length, where it was tokenized

WHY = {"too_long": "too long for model.block_size", "template_refused": "refused by the chat template",
       "template_changed": "text changed by the chat template", "nothing_to_learn": "nothing to learn",
       "prompt_not_prefix": "prompt tokens not a prefix of prompt + reply"}


class Tally:
    """The counts of one piece (in a pool worker)."""

    def __init__(self):
        self.kept = self.truncated = self.supervised = 0
        self.dropped = dict.fromkeys(REASONS, 0)
        self.examples: dict[str, list] = {}   # reason -> [row in the piece, detail]
        self.longest: list | None = None      # [tokens, row] of the longest record dropped as too long

    def add(self, row: int, got) -> None:
        """`got`: Dropped, or a kept unit (its `truncated` and `supervised` counts)."""
        if not isinstance(got, Dropped):
            self.kept += 1
            self.truncated += got.truncated
            self.supervised += got.supervised
            return
        self.dropped[got.reason] += 1
        self.examples.setdefault(got.reason, [row, got.detail])
        if got.reason == "too_long" and (self.longest is None or got.tokens > self.longest[0]):
            self.longest = [got.tokens, row]

    def record(self) -> dict:
        return {"documents": self.kept, "truncated": self.truncated, "supervised": self.supervised,
                "dropped": sum(self.dropped.values()), "dropped_by": {k: v for k, v in self.dropped.items() if v},
                "dropped_examples": self.examples, "longest_dropped": self.longest}


def _where(record: dict, row: int) -> str:
    return readers.locate(record["source"], record["kind"], record["range"][0], row)


def summary(records: list[dict]) -> dict:
    """A split's counts from its pieces' records (for the index, the summary line and summary.json)."""
    by = {r: sum(rec.get("dropped_by", {}).get(r, 0) for rec in records) for r in REASONS}
    out = {"records": sum(rec["documents"] + rec["dropped"] for rec in records),
           "truncated": sum(rec.get("truncated", 0) for rec in records),
           "dropped": sum(rec["dropped"] for rec in records)}
    if out["dropped"]:
        out["dropped_by"] = {k: v for k, v in by.items() if v}
    longest = max((rec for rec in records if rec.get("longest_dropped")), key=lambda rec: rec["longest_dropped"][0],
                  default=None)
    if longest is not None:
        tokens, row = longest["longest_dropped"]
        out["longest_dropped"] = f"{_where(longest, row)} ({tokens} tokens)"
    return out


def example(records: list[dict], reason: str) -> str:
    """The first record dropped for `reason`: where it is and why."""
    for rec in records:
        if reason in rec.get("dropped_examples", {}):
            row, detail = rec["dropped_examples"][reason]
            return f"{_where(rec, row)}: {detail}"
    return ""


def gate(split_key: str, source: str, index: dict, limit: float, truncation: str, block_size: int) -> str | None:
    """The one-line error when a split's store dropped more than `limit` of its records, else None."""
    s = index["summary"]
    total, dropped = s.get("records", 0), s.get("dropped", 0)
    if not total or dropped / total <= limit:
        return None
    reasons = ", ".join(f"{WHY[r]} {n}" for r, n in s["dropped_by"].items())
    first = max(s["dropped_by"], key=s["dropped_by"].get)
    detail = f"longest: {s['longest_dropped']}" if first == "too_long" and s.get("longest_dropped") else \
        f"e.g. {example(index['shards'], first)}"
    fixes = []
    if {"too_long", "nothing_to_learn"} & set(s["dropped_by"]):
        fixes.append(f"raise model.block_size (now {block_size})")
        if truncation != "keep_end":
            fixes.append("set chat.truncation=keep_end (keeps each record's last exchange)")
    if {"template_refused", "template_changed"} & set(s["dropped_by"]):
        fixes.append("fix those records or use a chat template that takes them")
    if "prompt_not_prefix" in s["dropped_by"]:
        fixes.append("use a chat template that renders a prompt alone as it renders it before a reply, or end "
                     "prompts on a token boundary")
    fixes.append(f"or raise data.max_dropped_fraction (now {limit:g}) to train on what is left")
    return (f"config key 'data.max_dropped_fraction': the data step dropped {dropped:,} of {total:,} records of "
            f"{split_key} ('{source}'), {dropped / total:.1%} (more than {limit:.1%}): {reasons}; {detail}; "
            f"{', '.join(fixes)}")
