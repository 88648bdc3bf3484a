"""The chat record format: a conversation -> a unit of one sequence (token ids and a target mask) of the
store of units (data/units.py: packing, sampling, --show and the dropped-records gate are its), built and
opened by the one pipeline (data/prepare.py).

Each record is rendered with the tokenizer's chat template (template.kwargs baked into it as defaults,
system messages folded where the template refuses them: template.py), each message found in the rendering
by structure (layout.py) and masked (encode.py), a batch of records at a time. A record that cannot be used
is dropped and counted with its reason (data/counts.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from phalanx.core.config import Config, ConfigError
from phalanx.data import counts, encoder, readers, store, units
from phalanx.data.chat import formats, template
from phalanx.data.chat.encode import ChatEncoder, ChatSettings, Encoded, TiktokenTokens
from phalanx.data.sample import sample_rows
from phalanx.data.sources import Split

SMALL = 1 << 20  # inputs up to this size are tokenized by `tokenizers` directly (no tiktoken check)


@dataclass(frozen=True)
class ChatJob:
    """What a pool worker needs to encode a piece of conversations (picklable)."""
    tokenizer_dir: str
    fields: tuple        # ((format, ChatFields), ...) for the formats a record may have
    chat_format: str     # 'auto' or one of formats.FORMATS
    settings: ChatSettings
    tokens: str          # 'tiktoken' or 'tokenizers' (encoder.py)


@lru_cache(maxsize=2)
def load_tokenizer(tokenizer_dir: str):
    from phalanx.data.tokenizer import load_saved  # transformers: ~0.5 s, only where chat data is encoded

    return load_saved(tokenizer_dir)


@lru_cache(maxsize=2)
def chat_encoder(tokenizer_dir: str, settings: ChatSettings, tokens: str) -> ChatEncoder:
    """One encoder per process (a pool worker encodes many pieces; its skeletons are reused across them)."""
    fast = encoder.cached(tokenizer_dir, "tiktoken").fast if tokens == "tiktoken" else None
    return ChatEncoder(load_tokenizer(tokenizer_dir), settings, TiktokenTokens(fast) if fast else None)


def field_overrides(cfg: Config) -> dict[str, str]:
    c = cfg.chat
    return {"messages": c.messages_field, "prompt": c.prompt_field, "input": c.input_field,
            "completion": c.completion_field, "system": c.system_field}


def _messages(record, fields: dict, chat_format: str, where: str) -> list[dict]:
    fmt = chat_format if chat_format != "auto" else formats.detect(record, where)
    return formats.to_messages(record, fields[fmt], where)


def chat_settings(cfg: Config, tok, train_on: str, truncation: str) -> ChatSettings:
    """How sequences are rendered and cut, with template.system_message resolved for the tokenizer's template
    (keep with a template that refuses a system role is exit 2 here, before any worker)."""
    kwargs = cfg.template.kwargs or {}
    policy = template.system_policy(tok, cfg.template.system_message, kwargs)
    return ChatSettings(train_on, truncation, cfg.model.block_size, policy, json.dumps(kwargs, sort_keys=True))


class TemplateUnits(units.UnitFormat):
    """Units rendered with a chat template (chat, preference): the tokenizer gets phalanx's ChatML template
    where it has none, and template.kwargs baked in as defaults (RUN/final renders as training did)."""
    tokenizer, needs = "bpe", "eos_token"

    def tokenizer_variant(self, cfg: Config) -> str:
        """The template with its kwargs is part of the tokenizer, so the kwargs name its folder (checked here:
        their first use)."""
        kwargs = cfg.template.kwargs or {}
        template.check_kwargs(kwargs)
        return "chat-v2" + (f":{json.dumps(kwargs, sort_keys=True)}" if kwargs else "")

    def adapt_tokenizer(self, cfg: Config, folder: Path) -> None:
        from phalanx.data.tokenizer import load_saved

        tok, kwargs = load_saved(folder), cfg.template.kwargs or {}
        if template.ensure_template(tok) or kwargs:
            template.bake_defaults(tok, kwargs)
            for stale in folder.iterdir():
                stale.unlink()
            tok.save_pretrained(folder)


class ChatFormat(TemplateUnits):
    prefix, version = "chat", "chat-store-v3"  # v3: the store of units (truncated.npy)

    def fields(self, cfg: Config) -> readers.Fields:
        return (("", "record"),)

    def settings(self, cfg: Config) -> tuple:
        d, c = cfg.data, cfg.chat
        return (c.format, tuple(sorted(field_overrides(cfg).items())), c.train_on, c.truncation,
                cfg.template.system_message, cfg.model.block_size, d.packing,
                d.val_fraction if not d.validation else None)

    def job(self, cfg: Config, split: Split, tok_dir: Path, total: int) -> tuple[ChatJob, dict]:
        """The settings and the tokenizer implementation."""
        c, tok = cfg.chat, load_tokenizer(str(tok_dir))
        how = chat_settings(cfg, tok, c.train_on, c.truncation)
        fields = tuple((f, formats.chat_fields(f, field_overrides(cfg))) for f in formats.FORMATS)
        if 0 < total <= SMALL:  # nothing to gain from a faster tokenizer; skip its check
            kind, why = "tokenizers", f"input under {SMALL >> 20} MB"
        else:
            kind, why = encoder.choose(tok_dir, self._sample_texts(cfg, dict(fields), how, tok))
        return ChatJob(str(tok_dir), fields, c.format, how, kind), {"encoder": kind, "encoder_check": why}

    def _sample_texts(self, cfg: Config, fields: dict, how: ChatSettings, tok) -> list[str]:
        """Rendered conversations from a sample of the training records (the tiktoken check's sample)."""
        shown = []
        for (record,) in sample_rows(cfg, self.fields(cfg), 256 << 10):
            try:
                messages = _messages(record, fields, cfg.chat.format, "")
            except ConfigError:  # said with its place when its piece is encoded
                continue
            shown.append(template.fold_system(messages) if how.system == "fold" else messages)
        renderer = template.Renderer(tok, json.loads(how.template_kwargs))
        return [t for t in renderer.many(shown) if isinstance(t, str)]

    def encode(self, job: ChatJob, piece: readers.Piece, writer: store.ShardWriter, progress) -> dict:
        enc, fields = chat_encoder(job.tokenizer_dir, job.settings, job.tokens), dict(job.fields)
        tally, written, k = counts.Tally(), [], 0
        for rows, n in readers.rows(piece, self.fields(None)):
            batch = []
            for (record,) in rows:
                try:
                    batch.append(_messages(record, fields, job.chat_format, ""))
                except ConfigError as e:  # located only now: counting lines is slow, errors are rare
                    raise ConfigError(f"{readers.locate(piece.source, piece.kind, piece.start, k + len(batch))}"
                                      f"{e}") from None
            try:
                results = enc.encode_batch(batch)
            except ConfigError as e:  # the template writes no end-of-turn token: every record would fail
                raise ConfigError(f"{readers.locate(piece.source, piece.kind, piece.start, k)}: {e}") from None
            kept = []
            for got in results:
                tally.add(k, got)
                k += 1
                if isinstance(got, Encoded):
                    kept.append(got)
            self.write(writer, kept)
            written += kept
            progress(n)
        return {**tally.record(), "end_of_turn": sorted({g.end_of_turn for g in written} - {-1}),
                "template_tokens": sorted(enc.template_tokens([g.ids for g in written]))}


def dropped_error(cfg: Config) -> str | None:
    """data.max_dropped_fraction over the chat stores of `cfg`."""
    return units.dropped_error(cfg, CHAT, cfg.chat.truncation)


CHAT = ChatFormat()
