"""The one preparation pipeline, the same for every task, parameterised by the store's record format.

    prepare(cfg, fmt)        the data step (`phalanx prepare`, or the launcher before any worker starts):
                             the tokenizer, then for each split whose store is missing or older than its
                             data: plan its pieces (readers.py), encode each into a shard in the pool
                             (pool.py, `fmt.encode`), let `fmt.finish` make what needs every shard, and
                             write the index last. Returns one summary shape per split.
    open_prepared(cfg, fmt)  the workers: the current stores, memory-mapped by `fmt.open`; never builds
                             (a missing or stale store is FileNotFoundError)

A record format (`RecordFormat`) says what a store holds and how it is made: the fields each row must
have, its per-token arrays (ids, and e.g. segment ids or a loss mask) and per-row arrays (e.g. lengths,
labels), how one piece is encoded (in a pool worker), a finish step once every shard of a split exists
(e.g. label names, a packing plan) and how the result is opened: lm_store.py, classify/store.py, and
chat/store.py and pref/store.py over the store of units (units.py).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phalanx.core import host
from phalanx.core.config import Config, ConfigError
from phalanx.core.errors import redact
from phalanx.core.runfolder import write_json
from phalanx.data import cache, layout, pool, readers, samplers, store
from phalanx.data.remote import place as remote
from phalanx.data import tokenizer as toks
from phalanx.data.sample import sample_rows
from phalanx.data.sources import Source, Split, file_identity, open_source, source_identity, splits

# The summary every format gives per split (format-specific entries come after these).
SUMMARY = ("split", "source", "files", "documents", "tokens", "shards", "store_bytes", "input_bytes", "seconds",
           "mb_per_s", "tokens_per_s", "workers", "folder", "reused")


class RecordFormat:
    """What one kind of store holds and how it is made. An instance is stateless and picklable: the pool's
    processes receive it with each piece."""
    prefix = ""            # store folders are CACHE/<prefix>-<fingerprint>
    version = ""           # in the folders' fingerprint and the index
    tokenizer = "bpe"      # the kind trained when no tokenizer is named: 'bpe' or 'wordpiece'
    needs = "eos_token"    # the special token the tokenizer must have; its id goes in the index (eos_id)
    token_arrays: dict = {"ids": None}  # per-token arrays: name -> dtype (None: layout.token_dtype of the vocabulary)
    row_arrays: dict = {}  # per-row arrays: name -> dtype; with 'lengths' the rows are ragged (offsets.npy)

    def tokenizer_variant(self, cfg: Config) -> str:
        """Non-empty: the format changes the tokenizer (adapt_tokenizer) as this says, so it has its own folder."""
        return ""

    def adapt_tokenizer(self, cfg: Config, folder: Path) -> None:
        """Change the tokenizer saved in `folder` before anything encodes with it (chat: add a template)."""

    def fields(self, cfg: Config) -> readers.Fields:
        """The (name, 'text' | 'label') fields each row must have."""
        raise NotImplementedError

    def settings(self, cfg: Config) -> tuple:
        """Other config values the stored arrays depend on (part of the folders' fingerprint)."""
        return ()

    def identity(self, cfg: Config, split: Split) -> list:
        """What a split's store is made from: a store is current when its index lists exactly this."""
        return source_identity(split, cfg.data.format)

    def job(self, cfg: Config, split: Split, tok_dir: Path, total: int) -> tuple[object, dict]:
        """What `encode` needs (picklable), and entries for the split's summary."""
        raise NotImplementedError

    def encode(self, job, piece: readers.Piece, writer: store.ShardWriter, progress: Callable[[int], None]) -> dict:
        """Write one piece's arrays with `writer` (in a pool worker); call `progress(n)` per n input bytes
        done. Returns entries for the shard's record, at least 'documents' (rows)."""
        raise NotImplementedError

    def finish(self, cfg: Config, split: Split, folder: Path, records: list[dict], done: dict[str, dict]) -> dict:
        """After every shard of `split` exists (`done`: the indexes of the splits before it): make the
        split-wide `<name>.npy` arrays. Returns entries for the index and the summary."""
        return {}

    def open(self, cfg: Config, tok_dir: Path, folders: dict[str, Path]):
        """The task's data from the current stores (split name -> folder), memory-mapped."""
        raise NotImplementedError


# ---- tokenizer and folders -----------------------------------------------------------------------
def tokenizer_folder(cfg: Config, fmt: RecordFormat) -> Path:
    d, spec = cfg.data, cfg.data.tokenizer or cfg.model.pretrained
    if spec:
        local = Path(spec)
        files = sorted(f for f in local.iterdir() if f.is_file()) if local.is_dir() else []
        fp = cache.fingerprint("pretrained-tokenizer", spec, [file_identity(f) for f in files])
    else:
        fp = cache.fingerprint("trained-tokenizer-v3", fmt.tokenizer, d.vocab_size, d.tokenizer_sample_mb,
                               d.val_fraction, d.format, fmt.fields(cfg), source_identity(splits(cfg)[0], d.format))
    if fmt.tokenizer_variant(cfg):
        fp = cache.fingerprint(fp, fmt.tokenizer_variant(cfg))
    return cache.cache_root(d.cache_dir) / f"tokenizer-{fp}"


TRAINERS = {"bpe": toks.train_bpe, "wordpiece": toks.train_wordpiece}


def prepare_tokenizer(cfg: Config, fmt: RecordFormat, say) -> Path:
    """The tokenizer as a folder of the cache: one of the format's kind trained on a sample of the training
    rows' text fields, or a copy of `data.tokenizer` / `model.pretrained`; it must have `fmt.needs`."""
    d, spec, fields = cfg.data, cfg.data.tokenizer or cfg.model.pretrained, fmt.fields(cfg)

    def build(tmp: Path) -> None:
        if spec:
            tok = toks.load_pretrained(spec)
            if not getattr(tok, "is_fast", False):
                raise ConfigError(f"tokenizer '{spec}': needs a fast (Rust) tokenizer with a tokenizer.json")
            tok.save_pretrained(tmp)
        else:
            t0 = time.perf_counter()
            rows = sample_rows(cfg, fields, int(d.tokenizer_sample_mb * (1 << 20)))
            texts = [t for row in rows for (_, k), value in zip(fields, row) for t in readers.texts_of(value, k)]
            toks.save_trained(TRAINERS[fmt.tokenizer](texts, d.vocab_size), fmt.tokenizer, tmp)
            say(f"phalanx: trained a {d.vocab_size}-token {fmt.tokenizer} tokenizer on "
                f"{sum(map(len, texts)) / 1e6:.1f} MB of sampled text in {time.perf_counter() - t0:.1f} s")
        fmt.adapt_tokenizer(cfg, tmp)
        if toks.special_id(tmp, fmt.needs) is None:
            raise ConfigError(f"tokenizer '{spec}': has no {fmt.needs.replace('_', ' ')}")

    tok_dir = cache.build_once(tokenizer_folder(cfg, fmt), build)
    if d.store_url:  # beside the stores: every node's workers use this one
        remote.share_folder(tok_dir, f"{d.store_url.rstrip('/')}/{tok_dir.name}")
    return tok_dir


def store_folder(cfg: Config, fmt: RecordFormat, split: Split, tok_dir: Path) -> Path:
    """The store's local folder: the store itself, or (data.store_url) its node-local stage and cache."""
    # The source by name, not by its files' size and time (the index holds those): a changed file is
    # prepared into the same folder, which so never keeps an index of data that is gone.
    d = cfg.data
    fp = cache.fingerprint(fmt.version, tok_dir.name, split.spec or "builtin", split.name, d.format,
                           fmt.fields(cfg), fmt.settings(cfg), d.shard_mb)
    return cache.cache_root(d.cache_dir) / ("remote" if d.store_url else "") / f"{fmt.prefix}-{fp}"


def store_place(cfg: Config, fmt: RecordFormat, split: Split, tok_dir: Path) -> remote.Place:
    folder, url = store_folder(cfg, fmt, split, tok_dir), cfg.data.store_url.rstrip("/")
    return remote.Place(folder, f"{url}/{folder.name}" if url else "")


def is_current(index: dict | None, identity: list) -> bool:
    return index is not None and index.get("sources") == json.loads(json.dumps(identity))


# ---- building ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """How to prepare (never what): encoding processes, a progress bar, where progress lines go."""
    workers: int
    progress: bool
    say: Callable[[str], None]


def _say(text: str) -> None:
    print(text, flush=True)  # stdout: stderr is for errors


def prepare(cfg: Config, fmt: RecordFormat, workers: int = 0, progress: bool = True, say=None) -> dict[str, dict]:
    """Make sure the tokenizer and every split's store of `cfg` exist and are current; a summary per split."""
    how = Options(workers or host.cores(), progress, say or _say)
    tok_dir = prepare_tokenizer(cfg, fmt, how.say)
    summaries, done = {}, {}
    for split in splits(cfg):
        place = store_place(cfg, fmt, split, tok_dir)
        index = place.read_index()
        if is_current(index, fmt.identity(cfg, split)):
            summaries[split.name] = {**index["summary"], "reused": True}
            if place.remote:  # the local copy other steps read (e.g. chat's counts)
                place.local.mkdir(parents=True, exist_ok=True)
                write_json(place.local / layout.INDEX, index)
        else:
            index = build_split(cfg, fmt, split, tok_dir, how, done)
            summaries[split.name] = index["summary"]
            how.say(f"phalanx: {describe(index['summary'])}")
        done[split.name] = index
    check_cache(cfg, done["train"])
    return summaries


def check_cache(cfg: Config, index: dict) -> None:
    """data.cache_limit_gb must hold the lookahead of the training order (and what is kept whole)."""
    d = cfg.data
    if not (d.store_url and d.cache_limit_gb):
        return
    shards = samplers.lookahead_shards(samplers.order_version(d.order, d.store_url), d.order_window,
                                       cfg.train.global_batch_size)
    ahead, kept = remote.lookahead_bytes(index, shards)
    if ahead + kept > d.cache_limit_gb * 1e9:
        raise ConfigError(f"config key 'data.cache_limit_gb': {d.cache_limit_gb:g} GB cannot hold the lookahead of "
                          f"the sample order: {ahead / 1e9:.3g} GB (the {shards} largest shards: the order's next "
                          f"{'windows of data.order_window' if d.order != 'global' else 'two global batches'})"
                          f" + {kept / 1e9:.3g} GB kept whole (row arrays, split-wide files); raise it to at "
                          f"least {(ahead + kept) / 1e9:.3g}" + (" or lower data.order_window" if d.order != "global"
                                                                 else ""))


def build_split(cfg: Config, fmt: RecordFormat, split: Split, tok_dir: Path, how: Options,
                done: dict[str, dict]) -> dict:
    """Encode one split into its folder, finish it and write its index (last); returns the index. `done`:
    the indexes of the splits before it."""
    t0, d = time.perf_counter(), cfg.data
    place, identity = store_place(cfg, fmt, split, tok_dir), fmt.identity(cfg, split)  # before reading
    folder = place.local
    folder.mkdir(parents=True, exist_ok=True)
    if place.read_index() is not None and not is_current(place.read_index(), identity):
        place.remove_index()  # an older data's index: a failure leaves none (a current one is another node's)
    source = open_source(split, d.format)
    vocab, total = toks.backend(tok_dir).get_vocab_size(with_added_tokens=True), source.size
    job, notes = fmt.job(cfg, split, tok_dir, total)
    work = PieceWork(fmt, job, place,
                     {n: np.dtype(dt or layout.token_dtype(vocab)) for n, dt in fmt.token_arrays.items()},
                     {n: np.dtype(dt) for n, dt in fmt.row_arrays.items()})
    size = pool.piece_bytes(d.shard_mb, total)
    workers = pool.pool_size(how.workers, total, size)
    bar = pool.progress_bar(how.progress, total, split.key)
    try:
        encoding = pool.Encoding(work, place, workers, bar)
        records = encoding.run(readers.plan(source, fmt.fields(cfg), size))
    finally:
        bar.close()
    place.localize_rows(records)  # the finish step reads them: those other nodes encoded too
    if not sum(r["tokens"] for r in records):
        raise ConfigError(f"config key '{split.key}': '{split.spec or 'built-in corpus'}' contains no text")
    if "lengths" in fmt.row_arrays:
        store.write_offsets(folder, records)
    extras = fmt.finish(cfg, split, folder, records, done)
    files = place.publish_files(sorted(p.name for p in folder.glob("*.npy")))
    summary = _summary(source, place, records, time.perf_counter() - t0, workers, {**notes, **extras})
    if place.remote:
        summary["encoded_here"] = encoding.encoded  # this node's share of the pieces
    index = {"version": fmt.version, "format": fmt.prefix, "dtype": work.dtypes["ids"].name, "vocab_size": vocab,
             f"{fmt.needs.removesuffix('_token')}_id": toks.special_id(tok_dir, fmt.needs),
             "tokenizer": tok_dir.name, "sources": identity, "tokens": summary["tokens"],
             "documents": summary["documents"], "shards": records, **extras, "files": files, "summary": summary,
             "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    place.write_index(index)
    place.drop_claims()
    remove_unlisted(folder, records)
    return index


@dataclass(frozen=True)
class PieceWork:
    """Turns one piece into its shard, in a pool worker or inline (picklable: sent with each piece)."""
    fmt: RecordFormat
    job: object
    place: remote.Place
    dtypes: dict       # per-token arrays: name -> dtype
    row_dtypes: dict   # per-row arrays: name -> dtype

    def __call__(self, piece: readers.Piece) -> dict:
        writer = store.ShardWriter(self.place.local, piece.fingerprint, self.dtypes, self.row_dtypes)
        done = 0

        def progress(n: int) -> None:
            nonlocal done
            done += n
            pool.report(n)

        try:
            entries = self.fmt.encode(self.job, piece, writer, progress)
        except BaseException:
            writer.abort()
            raise
        pool.report(piece.size - done)
        record = writer.close({**entries, "source": piece.source, "kind": piece.kind,
                               "range": [piece.start, piece.end], "bytes_in": piece.size})
        self.place.publish(record)  # a remote store's shard: uploaded, then its per-token arrays dropped here
        return record


def _summary(source: Source, place: remote.Place, records: list[dict], seconds: float, workers: int,
             extras: dict) -> dict:
    tokens, size, split = sum(r["tokens"] for r in records), sum(r["bytes_in"] for r in records), source.split
    stored = sum(sum(remote.array_sizes(r).values()) for r in records)
    folder = place.url or place.local
    return {"split": split.name, "source": redact(split.spec) or "builtin",  # printed, and in the index
            "files": len(source.files) or 1,
            "documents": sum(r["documents"] for r in records), "tokens": tokens, "shards": len(records),
            "store_bytes": stored, "input_bytes": size, "seconds": round(seconds, 3),
            "mb_per_s": round(size / 1e6 / max(seconds, 1e-9), 2), "tokens_per_s": round(tokens / max(seconds, 1e-9)),
            "workers": workers, "folder": redact(str(folder)), **extras}


def describe(s: dict) -> str:
    """A split's summary on one line (`phalanx prepare`, the launcher's log)."""
    how = "already prepared" if s.get("reused") else f"prepared in {s['seconds']:.1f} s ({s['mb_per_s']:.1f} MB/s)"
    extra = "".join(f"; {k} {_shown(v)}" for k, v in s.items() if k not in SUMMARY)
    return (f"{s['split']}: {s['source']}: {s['files']} file(s), {s['documents']:,} documents, {s['tokens']:,} "
            f"tokens, {s['shards']} shard(s), {s['store_bytes'] / 1e6:.1f} MB; {how}{extra}; {s['folder']}")


def _shown(value) -> str:
    if isinstance(value, dict):  # e.g. chat's dropped_by: "too_long 3, template_refused 1"
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def remove_unlisted(folder: Path, records: list[dict]) -> None:
    """Shards of an older version of the data (a changed file) are dropped once the new index exists;
    every piece is done then, so a temporary file left is one that a killed preparation was writing."""
    keep = {r["fingerprint"] for r in records}
    for path in folder.iterdir():
        stale = path.suffix in (".bin", ".json") and path.name != layout.INDEX and path.name.split(".")[0] not in keep
        if stale or path.name.endswith((".tmp", ".claim")):  # also what a killed preparation left
            path.unlink(missing_ok=True)


# ---- the workers' side ---------------------------------------------------------------------------
def _current(cfg: Config, fmt: RecordFormat) -> tuple[Path, dict[str, Path]]:
    """The tokenizer and stores' local folders; a remote store's (data.store_url) are readied in the
    node-local cache: the tokenizer and what is kept whole fetched, the shards mapped from it later."""
    d, tok_dir = cfg.data, tokenizer_folder(cfg, fmt)
    if not tok_dir.is_dir() and d.store_url:
        cache.build_once(tok_dir, lambda tmp: remote.fetch_folder(f"{d.store_url.rstrip('/')}/{tok_dir.name}", tmp))
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"tokenizer '{tok_dir}' not prepared (run `phalanx prepare` with this config)")
    folders = {}
    for split in splits(cfg):
        place = store_place(cfg, fmt, split, tok_dir)
        index = place.read_index()
        if not is_current(index, fmt.identity(cfg, split)):
            why = "has no index (not prepared, or interrupted)" if index is None else "is older than the data"
            raise FileNotFoundError(f"store for {split.key} in '{place.url or place.local}' {why} (run `phalanx "
                                    f"prepare` with this config)")
        if place.remote:
            remote.open_cached(place, index, int(d.cache_limit_gb * 1e9))
        folders[split.name] = place.local
    return tok_dir, folders


def train_plan(cfg: Config, fmt: RecordFormat) -> str:
    """The shard plan (store.plan_digest) of the prepared training store of `cfg`; '' if it is not prepared."""
    place = store_place(cfg, fmt, splits(cfg)[0], tokenizer_folder(cfg, fmt))
    index = layout.read_index(place.local) or place.read_index()
    return store.plan_digest(index["shards"]) if index else ""


def open_prepared(cfg: Config, fmt: RecordFormat):
    """What `prepare` made for `cfg`, opened by the format (memory-mapped)."""
    return fmt.open(cfg, *_current(cfg, fmt))


def is_prepared(cfg: Config, fmt: RecordFormat) -> bool:
    try:
        _current(cfg, fmt)
        return True
    except FileNotFoundError:
        return False


def open_or_prepare(cfg: Config, fmt: RecordFormat, is_builder: bool, timeout_s: float):
    """Open the prepared data. In a worker started by an outside torchrun/srun with nothing prepared,
    the node's first process prepares it and the others wait for the index (not in a collective that
    could time out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return open_prepared(cfg, fmt)
        except FileNotFoundError:
            if is_builder:
                prepare(cfg, fmt, progress=False)
                return open_prepared(cfg, fmt)
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for the node's first process to prepare the data") \
                    from None
            time.sleep(0.1)
