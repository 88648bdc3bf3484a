"""GRPO's prompt sets: each split's records rendered once (the launcher's data step, before any worker) into a
folder of the cache, which every worker opens.

    CACHE/grpo-<fingerprint>/  ids.npy (the prompts' token ids, flat), offsets.npy, records.jsonl (per prompt:
                               its messages, whether the record gave messages, its other fields), index.json

A prompt is rendered with the tokenizer's chat template and its generation prompt (chat's tokenizer folder:
phalanx's ChatML template added where the tokenizer has none, template.kwargs baked in; system messages
folded where the template refuses them), so `phalanx chat` on the result renders as training did. A prompt
longer than model.block_size - grpo.max_completion_length keeps its end: its oldest turns go first (the system
message stays); one whose last user turn alone does not fit is dropped and counted (data.max_dropped_fraction).

Prompt sets are small (GSM8K's 7,473 prompts: 4 MB of JSON), so a worker reads its records.jsonl whole: the
reward functions need each record's fields as Python values. A malformed record stops the data step naming its
file, line and field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phalanx.core.config import Config, ConfigError
from phalanx.core.runfolder import write_json
from phalanx.data import cache, counts, pool, prepare, readers
from phalanx.data.chat.encode import ChatEncoder, Encoded
from phalanx.data.chat.store import CHAT, chat_settings, load_tokenizer
from phalanx.data.grpo import arithmetic
from phalanx.data.grpo.records import Prompt, to_prompt
from phalanx.data.sources import Split, open_source, source_identity, splits

VERSION = "grpo-prompts-v1"
FIELDS = (("", "record"),)
BUILTIN_HELD_OUT = Split("", "data.validation", "validation")


def prompt_splits(cfg: Config) -> list[Split]:
    """The splits whose prompts are rendered: the configured ones; the built-in task has its own held-out set."""
    out = splits(cfg)
    if not cfg.data.train and not cfg.data.validation:
        out.append(BUILTIN_HELD_OUT)
    return out


def folder_of(cfg: Config, split: Split, tok_dir: Path) -> Path:
    g = cfg.grpo
    identity = ["builtin", split.name] if not split.spec else source_identity(split, cfg.data.format)
    fp = cache.fingerprint(VERSION, tok_dir.name, split.spec, split.name, identity, cfg.data.format, g.prompt_field,
                           g.system_field, cfg.template.system_message, cfg.model.block_size,
                           g.max_completion_length)
    return cache.cache_root(cfg.data.cache_dir) / f"grpo-{fp}"


def is_prepared(cfg: Config) -> bool:
    tok_dir = prepare.tokenizer_folder(cfg, CHAT)
    return tok_dir.is_dir() and all((folder_of(cfg, s, tok_dir) / "index.json").is_file() for s in prompt_splits(cfg))


def prepare_prompts(cfg: Config, say=print) -> dict[str, dict]:
    """The tokenizer (chat's) and every split's prompt folder; a summary per split."""
    tok_dir = prepare.prepare_tokenizer(cfg, CHAT, say)
    out = {}
    for split in prompt_splits(cfg):
        folder = folder_of(cfg, split, tok_dir)
        reused = folder.is_dir()
        cache.build_once(folder, lambda tmp, split=split: _build(cfg, split, tok_dir, tmp))
        summary = json.loads((folder / "index.json").read_text(encoding="utf-8"))["summary"]
        if not reused:
            say(f"phalanx: {split.name} prompts of '{split.spec or 'built-in arithmetic'}': {summary['documents']:,} "
                f"kept of {summary['records']:,} (truncated {summary['truncated']}, dropped {summary['dropped']})")
        out[split.name] = {**summary, "reused": reused}
    return out


def _rows(cfg: Config, split: Split):
    """(record, where) of a split in order; `where` is called only for an error (locating a line is slow)."""
    if not split.spec:
        records = arithmetic.held_out() if split is BUILTIN_HELD_OUT else arithmetic.train()
        for i, record in enumerate(records):
            yield record, (lambda i=i: f"built-in data row {i + 1}")
        return
    source = open_source(split, cfg.data.format)
    for piece in readers.plan(source, FIELDS, pool.piece_bytes(cfg.data.shard_mb, source.size)):
        k = 0
        for rows, _ in readers.rows(piece, FIELDS):
            for (record,) in rows:
                yield record, (lambda p=piece, k=k: readers.locate(p.source, p.kind, p.start, k))
                k += 1


class PromptEncoder:
    """Renders prompts with the generation prompt, keeping their end where they are too long."""

    def __init__(self, cfg: Config, tok_dir: Path):
        tok = load_tokenizer(str(tok_dir))
        self.chat = ChatEncoder(tok, chat_settings(cfg, tok, "assistant", "keep_end"))
        self.limit = cfg.model.block_size - cfg.grpo.max_completion_length

    def encode(self, prompt: Prompt) -> tuple[np.ndarray, list[dict], bool] | counts.Dropped:
        """The prompt's ids, the messages kept, and whether older turns were left out."""
        messages, truncated = prompt.messages, False
        while True:
            ids = self.chat.prompt_ids(messages)
            if isinstance(ids, counts.Dropped) or len(ids) <= self.limit:
                return ids if isinstance(ids, counts.Dropped) else (ids, messages, truncated)
            system = [m for m in messages[:1] if m["role"] == "system"]
            rest = messages[len(system):]
            users = [i for i, m in enumerate(rest) if m["role"] == "user" and i > 0]
            if not users:  # the last user turn alone does not fit
                return counts.Dropped("too_long", f"the prompt's {len(ids)} tokens exceed model.block_size - "
                                      f"grpo.max_completion_length = {self.limit}", len(ids))
            messages, truncated = system + rest[users[0]:], True

    def end_of_turn(self) -> int:
        """The assistant's end-of-turn token (generation stops there)."""
        got = self.chat.encode([{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}])
        if not isinstance(got, Encoded) or got.end_of_turn < 0:
            raise ConfigError("the chat template writes no end-of-turn token after an assistant reply; generation "
                              "would never stop (use a template that ends the assistant's turn)")
        return int(got.end_of_turn)


def _build(cfg: Config, split: Split, tok_dir: Path, out: Path) -> None:
    g, enc = cfg.grpo, PromptEncoder(cfg, tok_dir)
    out.mkdir(parents=True)
    ids, offsets, kept, n = [], [0], [], 0
    dropped: dict[str, int] = {}
    examples: dict[str, str] = {}
    truncated = 0
    with open(out / "records.jsonl", "w", encoding="utf-8") as f:
        for record, where in _rows(cfg, split):
            n += 1
            try:
                prompt = to_prompt(record, g.prompt_field, g.system_field, "")
            except ConfigError as e:
                raise ConfigError(f"{where()}{e}") from None
            got = enc.encode(prompt)
            if isinstance(got, counts.Dropped):
                dropped[got.reason] = dropped.get(got.reason, 0) + 1
                examples.setdefault(got.reason, f"{where()}: {got.detail}")
                continue
            tokens, messages, cut = got
            truncated += cut
            ids.append(np.asarray(tokens, dtype=np.int32))
            offsets.append(offsets[-1] + len(tokens))
            f.write(json.dumps({"messages": messages, "conversational": prompt.conversational,
                                "fields": prompt.fields}, ensure_ascii=False) + "\n")
            kept.append(len(tokens))
    if n == 0:
        raise ConfigError(f"config key '{split.key}': '{split.spec}' holds no records")
    np.save(out / "ids.npy", np.concatenate(ids) if ids else np.zeros(0, np.int32))
    np.save(out / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    summary = {"split": split.name, "source": split.spec or "builtin", "records": n, "documents": len(kept),
               "truncated": truncated, "dropped": sum(dropped.values()), "dropped_by": dropped,
               "dropped_examples": examples, "prompt_tokens": int(sum(kept)),
               "longest_prompt": int(max(kept, default=0))}
    write_json(out / "index.json", {"version": VERSION, "summary": summary, "end_of_turn": enc.end_of_turn()})


def dropped_error(cfg: Config) -> str | None:
    """data.max_dropped_fraction over the prompt sets (too long, refused by the template)."""
    tok_dir = prepare.tokenizer_folder(cfg, CHAT)
    for split in prompt_splits(cfg):
        s = json.loads((folder_of(cfg, split, tok_dir) / "index.json").read_text(encoding="utf-8"))["summary"]
        if s["records"] and s["dropped"] / s["records"] > cfg.data.max_dropped_fraction:
            reasons = ", ".join(f"{counts.WHY[r]} {k}" for r, k in s["dropped_by"].items())
            first = next(iter(s["dropped_examples"].values()))
            return (f"config key 'data.max_dropped_fraction': {s['dropped']:,} of {s['records']:,} prompts of "
                    f"{split.key} ('{split.spec or 'built-in data'}') were dropped ({reasons}; e.g. {first}); raise "
                    f"model.block_size (now {cfg.model.block_size}) or lower grpo.max_completion_length (now "
                    f"{cfg.grpo.max_completion_length}), or raise data.max_dropped_fraction (now "
                    f"{cfg.data.max_dropped_fraction:g})")
    return None


@dataclass
class PromptSet:
    """A split's prompts: token ids (memory-mapped) and records, `lo:hi` of them."""
    ids: np.ndarray
    offsets: np.ndarray
    records: list[dict]
    lo: int = 0
    hi: int | None = None

    def __len__(self) -> int:
        return (len(self.records) if self.hi is None else self.hi) - self.lo

    def prompt(self, i: int) -> tuple[np.ndarray, dict]:
        j = self.lo + i
        return np.asarray(self.ids[self.offsets[j]:self.offsets[j + 1]], dtype=np.int64), self.records[j]


@dataclass
class PromptData:
    train: PromptSet
    validation: PromptSet
    tokenizer_dir: Path
    end_of_turn: int
    summary: dict


def _open(folder: Path) -> tuple[PromptSet, dict]:
    index = json.loads((folder / "index.json").read_text(encoding="utf-8"))
    with open(folder / "records.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return PromptSet(np.load(folder / "ids.npy", mmap_mode="r"), np.load(folder / "offsets.npy"), records), index


def open_prompts(cfg: Config) -> PromptData:
    """The prepared prompt sets (FileNotFoundError when one is missing). Without data.validation (and not the
    built-in task) the last data.val_fraction of the training prompts are held out."""
    tok_dir = prepare.tokenizer_folder(cfg, CHAT)
    got = {s.name: _open(folder_of(cfg, s, tok_dir)) for s in prompt_splits(cfg)}
    train, index = got["train"]
    if "validation" in got:
        validation = got["validation"][0]
    else:
        n = len(train)
        keep = max(1, n - int(round(n * cfg.data.val_fraction)))
        train, validation = (PromptSet(train.ids, train.offsets, train.records, 0, keep),
                             PromptSet(train.ids, train.offsets, train.records, keep, n))
    return PromptData(train, validation, tok_dir, index["end_of_turn"], index["summary"])
