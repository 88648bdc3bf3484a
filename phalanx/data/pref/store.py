"""The preference record format: a pair -> a unit of two sequences (prompt + chosen, prompt + rejected), each
with its targets, of the store of units (data/units.py: a pair is the unit of packing and sampling, so its two
replies are always in one micro-batch on one rank), built and opened by the one pipeline (data/prepare.py).

The tokenizer and its chat template are chat's (chat/store.py TemplateUnits: a template added where the
tokenizer has none, template.kwargs baked in), so a preference run on a chat run's final/ renders as that run
did. A pair that cannot be used is dropped and counted with its reason (data/counts.py; the gate of
data.max_dropped_fraction counts pairs).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from phalanx.core.config import Config, ConfigError
from phalanx.data import counts, readers, store, units
from phalanx.data.chat.encode import ChatSettings
from phalanx.data.chat.store import TemplateUnits, chat_settings, load_tokenizer
from phalanx.data.pref.encode import EncodedPair, PairEncoder
from phalanx.data.pref.records import PairFields, pair_fields, to_pair
from phalanx.data.sources import Split


@dataclass(frozen=True)
class PairJob:
    """What a pool worker needs to encode a piece of pairs (picklable)."""
    tokenizer_dir: str
    fields: PairFields
    pair_format: str
    settings: ChatSettings


@lru_cache(maxsize=2)
def pair_encoder(tokenizer_dir: str, settings: ChatSettings) -> PairEncoder:
    return PairEncoder(load_tokenizer(tokenizer_dir), settings)


class PreferenceFormat(TemplateUnits):
    prefix, version = "pref", "pref-store-v1"
    sequences, unit, names = 2, "pair", ("chosen", "rejected")

    def fields(self, cfg: Config):
        return (("pair", "record"),)  # the whole record (built-in data: builtin.stdlib_preference_pairs)

    def settings(self, cfg: Config) -> tuple:
        d, p = cfg.data, cfg.preference
        return (p.format, pair_fields(p), "keep_end", cfg.template.system_message, cfg.model.block_size, d.packing,
                d.val_fraction if not d.validation else None)

    def job(self, cfg: Config, split: Split, tok_dir: Path, total: int) -> tuple[PairJob, dict]:
        """The prompt is cut from the left (keep_end), the same for both replies: a reply is never cut."""
        how = chat_settings(cfg, load_tokenizer(str(tok_dir)), "assistant", "keep_end")
        return PairJob(str(tok_dir), pair_fields(cfg.preference), cfg.preference.format, how), {}

    def encode(self, job: PairJob, piece: readers.Piece, writer: store.ShardWriter, progress) -> dict:
        enc = pair_encoder(job.tokenizer_dir, job.settings)
        tally, eot, template_tokens, k = counts.Tally(), set(), set(), 0
        for rows, n in readers.rows(piece, self.fields(None)):
            kept = []
            for (record,) in rows:
                try:
                    pair = to_pair(record, job.fields, job.pair_format, "")
                except ConfigError as e:  # located only now: counting lines is slow, errors are rare
                    raise ConfigError(f"{readers.locate(piece.source, piece.kind, piece.start, k)}{e}") from None
                try:
                    got = enc.encode(pair)
                except ConfigError as e:  # the template writes no end-of-turn token: every pair would fail
                    raise ConfigError(f"{readers.locate(piece.source, piece.kind, piece.start, k)}: {e}") from None
                tally.add(k, got)
                k += 1
                if isinstance(got, EncodedPair):
                    kept.append(got)
            self.write(writer, kept)
            seqs = [s for g in kept for s in g.sequences]
            eot.update(s.end_of_turn for s in seqs)
            template_tokens.update(enc.chat.template_tokens([s.ids for s in seqs]))
            progress(n)
        return {**tally.record(), "end_of_turn": sorted(eot - {-1}), "template_tokens": sorted(template_tokens)}


PREFERENCE = PreferenceFormat()


def dropped_error(cfg: Config) -> str | None:
    """data.max_dropped_fraction over the preference stores of `cfg` (pairs)."""
    return units.dropped_error(cfg, PREFERENCE)
