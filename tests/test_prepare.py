"""The token store and its preparation: same ids as encoding everything at once, byte-identical whatever
the number of workers, resumable after a kill, clear errors with nothing half-written, bounded memory."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, SHAKESPEARE, phalanx
from tokenizers import Tokenizer

from phalanx.core.config import load_config
from phalanx.data import layout, prepare, readers, store
from phalanx.data.lm_store import LM
from phalanx.data import tokenizer as toks
from phalanx.data.samplers import GlobalBatchSampler
from phalanx.tasks.lm import blocks

# Indented lines, blank lines, CRLF, tabs, trailing spaces, non-ASCII: every way a cut could change ids.
TRICKY = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n  indented two\n\tTabbed line\n"
          " one space\nend of line with spaces   \nNext\r\nwindows line\r\n\r\n   \n\n\nÉlan vital — ünïcode\n"
          "    deep indent\n x\ny\n") * 40


def tokenizer_dir(tmp_path: Path, text: str) -> Path:
    raw, folder = tmp_path / "tok-raw", tmp_path / "tok"
    toks.save_trained(toks.train_bpe([text], 400), "bpe", raw)
    toks.load_saved(raw).save_pretrained(folder)  # a transformers folder, as data.tokenizer expects
    return folder


def test_safe_cuts_keep_pre_tokens_and_ids(tmp_path):
    tok = Tokenizer.from_file(str(tokenizer_dir(tmp_path, TRICKY + SHAKESPEARE.read_text()[:20000]) / "tokenizer.json"))
    text = TRICKY[:3000]
    data = text.encode()
    words = [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
    whole = tok.encode(text, add_special_tokens=False).ids
    cuts, pos = [], 1
    while (c := readers.safe_cut(data, pos)) != -1:
        cuts.append(c)
        pos = c + 1
    assert len(cuts) > 50
    for c in cuts:
        a, b = data[:c].decode(), data[c:].decode()
        assert [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(a)] + \
            [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(b)] == words, f"cut at {c}: {data[c - 5:c + 5]!r}"
        assert tok.encode(a, add_special_tokens=False).ids + tok.encode(b, add_special_tokens=False).ids == whole
    # The rule matters: a cut after every newline would change the pre-tokens of this text.
    naive = [i + 1 for i, ch in enumerate(data) if ch == 0x0A and i + 1 < len(data)]
    changed = [c for c in naive if c not in cuts and
               [w for s in (data[:c].decode(), data[c:].decode())
                for w, _ in tok.pre_tokenizer.pre_tokenize_str(s)] != words]
    assert changed


def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_bytes((TRICKY + SHAKESPEARE.read_text()[:60000]).encode())  # CRLF kept
    rows = [{"text": line} for line in (TRICKY * 2).splitlines(keepends=True)]
    (folder / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return folder


def cfg_for(data, cache: Path, *extra):
    return load_config(None, [f"data.train={data}", f"data.cache_dir={cache}", "data.vocab_size=400",
                              "data.tokenizer_sample_mb=1", *extra])


def store_bytes(cache: Path) -> tuple[bytes, list]:
    folder = next(cache.glob("store-*"))
    index = layout.read_index(folder)
    return b"".join((folder / s["file"]).read_bytes() for s in index["shards"]), \
        [(s["file"], s["tokens"], s["documents"], s["range"]) for s in index["shards"]]


def test_store_equals_one_array_reference_and_is_identical_for_1_and_2_workers(tmp_path):
    data = corpus(tmp_path)
    for workers in (1, 2):
        prepare.prepare(cfg_for(data, tmp_path / f"c{workers}", "data.shard_mb=0.004"), LM, workers, progress=False)
    (b1, s1), (b2, s2) = store_bytes(tmp_path / "c1"), store_bytes(tmp_path / "c2")
    assert len(s1) > 20 and s1 == s2 and b1 == b2
    # Reference: each file encoded in one call by `tokenizers`, an end-of-text token after each document.
    tok_dir = next((tmp_path / "c1").glob("tokenizer-*"))
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id(toks.EOS)
    ref = tok.encode((data / "a.txt").read_bytes().decode(), add_special_tokens=False).ids + [eos]  # CRLF kept
    for line in (data / "b.jsonl").read_text(encoding="utf-8").splitlines():
        ref += tok.encode(json.loads(line)["text"], add_special_tokens=False).ids + [eos]
    got = store.TokenStore(next((tmp_path / "c1").glob("store-*")))
    assert np.array_equal(got.slice(0, len(got)), np.asarray(ref)) and got.dtype == np.uint16
    index = got.index
    assert index["documents"] == 1 + len((data / "b.jsonl").read_text().splitlines())
    assert {"version", "dtype", "vocab_size", "eos_id", "tokenizer", "sources", "tokens", "shards"} <= index.keys()


def test_blocks_cross_shards_and_every_sample_is_seen_once(tmp_path):
    data = corpus(tmp_path)
    cfg = cfg_for(data, tmp_path / "c", "data.shard_mb=0.004", "data.val_fraction=0.1", "lm.val_max_tokens=900")
    prepare.prepare(cfg, LM, 1, progress=False)
    lm = prepare.open_prepared(cfg, LM)
    everything = lm.train.slice(0, len(lm.train))
    assert lm.val_tokens == 900
    train, val = blocks(lm, 32)
    assert len(val) == (900 - 1) // 32 and len(train) == (len(everything) - 900 - 1) // 32
    for i in (0, 1, len(train) // 2, len(train) - 1):
        assert np.array_equal(train.batch([i])[0], everything[i * 32: i * 32 + 33])
    assert np.array_equal(val.batch([0])[0], everything[len(everything) - 900: len(everything) - 900 + 33])
    sampler = GlobalBatchSampler(len(train), 12, 2, seed=5)
    epoch = np.concatenate([sampler.global_batch(step * 12) for step in range(-(-len(train) // 12))])
    assert sorted(epoch[:len(train)].tolist()) == list(range(len(train)))  # every block once per epoch
    for world in (2, 3):  # and the ranks' micro-batches of a step are exactly the global batch
        for step in range(5):
            batch = sampler.global_batch(step * 12)
            parts = [m for r in range(world) for m in sampler.rank_micro_batches(batch, r, world)]
            assert sorted(np.concatenate(parts).tolist()) == sorted(batch.tolist())


def test_killed_prepare_resumes_from_its_shards_and_gives_the_same_store(tmp_path):
    text = tmp_path / "big.txt"
    text.write_text(SHAKESPEARE.read_text() * 5, encoding="utf-8")  # ~5.6 MB
    args = ["prepare", f"data.train={text}", "data.vocab_size=400", "data.tokenizer_sample_mb=1",
            "data.shard_mb=0.05", "--workers", "1", "--quiet"]
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "phalanx", *args, f"data.cache_dir={cache}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while len(list(cache.glob("store-*/*.json"))) < 10 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    folder = next(cache.glob("store-*"))
    assert not (folder / layout.INDEX).exists()
    done = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.bin")}
    assert 10 <= len(done) < 100
    phalanx(*args, f"data.cache_dir={cache}", check=True, timeout=120)
    assert all((folder / name).stat().st_mtime_ns == t for name, t in done.items())  # reused, not redone
    prepare.prepare(cfg_for(text, tmp_path / "ref", "data.shard_mb=0.05"), LM, 1, progress=False)  # uninterrupted
    assert store_bytes(cache) == store_bytes(tmp_path / "ref")
    assert not list(folder.glob(".*"))  # no temporary or claim files left


def test_malformed_line_deep_in_a_file_is_exit_2_naming_file_and_line_and_leaves_no_index(tmp_path):
    rows = [json.dumps({"text": f"row {i} " + "word " * 10}) for i in range(60000)]
    rows[45000] = '{"text": "broken'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + "\n", encoding="utf-8")
    cache = tmp_path / "cache"
    proc = phalanx("train", f"data.train={bad}", f"data.cache_dir={cache}", "data.shard_mb=0.5",
                   "data.tokenizer_sample_mb=0.5", "data.vocab_size=300", "--run-dir", tmp_path / "run",
                   "--nproc-per-node", 2, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"data file '{bad}' line 45001: malformed JSON" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no worker started
    folder = next(cache.glob("store-*"))
    assert not (folder / layout.INDEX).exists() and list(folder.glob("*.bin"))  # finished shards kept for reuse
    assert not list(folder.glob(".*"))


def test_bad_utf8_is_found_by_the_sample_check_before_preparing(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n" * 100 + b"broken \xff byte\n")
    proc = phalanx("prepare", f"data.train={bad}", f"data.cache_dir={tmp_path / 'c'}", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"phalanx: error: data file '{bad}' line 101: not valid UTF-8 (byte offset 1007)"
    assert not (tmp_path / "c").exists()


def test_changed_file_invalidates_the_store(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(SHAKESPEARE.read_text()[:30000], encoding="utf-8")
    cfg = cfg_for(text, tmp_path / "c")
    prepare.prepare(cfg, LM, 1, progress=False)
    before = len(prepare.open_prepared(cfg, LM).train)
    with open(text, "a", encoding="utf-8") as f:
        f.write("A new line at the end.\n")
    with pytest.raises(FileNotFoundError, match="not prepared|older than the data"):  # (its tokenizer too)
        prepare.open_prepared(cfg, LM)
    prepare.prepare(cfg, LM, 1, progress=False)
    assert len(prepare.open_prepared(cfg, LM).train) > before


def test_hub_dataset_code_path_streams_a_local_dataset_folder(tmp_path, monkeypatch):
    folder = tmp_path / "ds"
    folder.mkdir()
    rows = [{"text": line} for line in TRICKY.splitlines()[:200] if line.strip()]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # a local folder: never the network
    tok = "data.tokenizer=" + str(tokenizer_dir(tmp_path, TRICKY))
    prepare.prepare(cfg_for(f"hf:{folder}", tmp_path / "hub", tok, "data.val_fraction=0"), LM, 1, progress=False)
    prepare.prepare(cfg_for(folder / "train.jsonl", tmp_path / "file", tok, "data.val_fraction=0"), LM, 1,
                    progress=False)
    assert store_bytes(tmp_path / "hub")[0] == store_bytes(tmp_path / "file")[0]


PEAK = """
import subprocess, sys, time
from phalanx.tools.oomwatch import MemoryWatch
watch = MemoryWatch(sources=[]).start()
subprocess.run([sys.executable, "-m", "phalanx", *sys.argv[1:]], check=True, capture_output=True)
watch.stop()
print(watch.peak_total)
"""


@pytest.mark.slow  # ~20 s; a scale check
def test_peak_memory_of_preparing_does_not_grow_with_the_corpus(tmp_path):
    """10 MB and 100 MB: the whole process tree's peak (sampled every 100 ms) stays within 150 MB. Each size
    is prepared twice and the lower peak kept: a transient on a busy machine only ever adds (once a 10 MB run
    peaked 400 MB above its 100 MB one), while memory that grew with the corpus would show in both."""
    line_source = SHAKESPEARE.read_text(encoding="utf-8")
    peaks = {}
    for mb in (10, 100):
        text = tmp_path / f"c{mb}.txt"
        with open(text, "w", encoding="utf-8") as f:
            for _ in range(mb * 1_000_000 // len(line_source) + 1):
                f.write(line_source)
        runs = []
        for rep in range(2):  # a cache folder each: the second run prepares again
            out = subprocess.run([sys.executable, "-c", PEAK, "prepare", f"data.train={text}", "data.vocab_size=400",
                                  "data.tokenizer_sample_mb=2", "data.shard_mb=8", "--workers", "2", "--quiet",
                                  f"data.cache_dir={tmp_path / f'cache{mb}-{rep}'}"],
                                 cwd=REPO, capture_output=True, text=True, check=True, timeout=300)
            runs.append(int(out.stdout.split()[-1]))
        peaks[mb] = min(runs)
        text.unlink()
    assert abs(peaks[100] - peaks[10]) < 150 << 20, {k: v >> 20 for k, v in peaks.items()}
