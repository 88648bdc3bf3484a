"""Data-preparation benchmark: `phalanx prepare` on synthetic corpora of growing size (not a test; prints
Markdown tables).

    python bench/prepare.py [--sizes-gb 0.1,1] [--recipe-sizes-gb 0.1] [--work DIR] [--out DIR] [--skip-train]

Corpora: the lines of WikiText-2 (validation + test) and Tiny Shakespeare from ../shared/data, shuffled
with a fixed seed and repeated until each size is reached, written streaming into --work (a corpus file of
the right size is reused). With the same seed a smaller corpus is the prefix of a larger one.

For each size:
  * `phalanx prepare examples/shakespeare.yaml data.train=CORPUS data.cache_dir=FRESH --quiet` in a fresh
    cache folder (tokenizer trained, every shard encoded): wall time, peak RSS of the whole process tree
    (sum over the tree, sampled every 50 ms; shared pages count in each process), and from the store's
    index.json the tokens, shards and store bytes; MB/s and tokens/s are over the wall time.
  * the same command again on the complete store (wall time; target < 3 s).
  * unless --skip-train, 20 training steps at 2 processes on that store: time from command start to the
    first step (and the workers' own `startup_s`), and each rank's peak RSS sampled from the process tree
    (phalanx's own `ranks/host_peak_mb` goes to the JSON file).
Side by side, on the first 100 MB (or less) of the corpus whose size is nearest above 100 MB:
  * the raw limit: `tokenizers` `encode_batch` of ~1 MB chunks cut at line ends, on all cores, with the
    tokenizer phalanx trained; and tiktoken with the same merges (phalanx's Encoder) on all cores (cut at
    any line end, so a few ids can differ from phalanx's, which cuts only where pre-tokens cannot change);
  * for each --recipe-sizes-gb: the recipe users write instead (nanoGPT's prepare.py, with a batched map):
    `datasets.load_dataset("text")`, `.map(batched=True, num_proc=cores)` with PreTrainedTokenizerFast and
    an end-of-text token per line, then all ids into a uint16 np.memmap, in a fresh HF_DATASETS_CACHE.
Results: printed, and written to --out as prepare.md and prepare.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
SOURCES = [DATA / "wikitext2" / "validation.txt", DATA / "wikitext2" / "test.txt",
           DATA / "tinyshakespeare" / "input.txt"]
CONFIG = REPO / "examples" / "shakespeare.yaml"
SEED = 20240609
GB, MB = 1e9, 1e6  # decimal, as MB/s
RAW_BYTES = 100 * 10 ** 6
CHUNK = 1 << 20
TRAIN = ["train.max_steps=20", "train.eval_every=0", "train.eval_max_samples=64", "train.log_every=5",
         "train.checkpoint_every=0", "log.progress=off"]


# ---- corpora -------------------------------------------------------------------------------------
def source_lines() -> list[bytes]:
    lines = []
    for path in SOURCES:
        lines += [x if x.endswith(b"\n") else x + b"\n" for x in path.read_bytes().splitlines(keepends=True)]
    return lines


def make_corpus(work: Path, gb: float) -> Path:
    """Shuffled source lines, reshuffled on every pass, until `gb` (exactly); reused when present."""
    size = int(round(gb * GB))
    path = work / f"corpus-{gb:g}gb-seed{SEED}.txt"
    if path.is_file() and path.stat().st_size == size:
        return path
    lines, rng, done = source_lines(), random.Random(SEED), 0
    filler = SOURCES[-1].read_bytes()  # ASCII: a cut anywhere in it stays valid UTF-8
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        while done < size:
            rng.shuffle(lines)
            block = b"".join(lines)
            if done + len(block) > size:  # the last block ends at a line end, then ASCII filler to the byte
                block = block[:block.rfind(b"\n", 0, size - done) + 1]
                rest = size - done - len(block)
                block += filler[:rest - 1] + b"\n" if rest else b""
            f.write(block)
            done += len(block)
    os.replace(tmp, path)
    return path


def text_chunks(path: Path, limit: int) -> list[str]:
    """The first `limit` bytes of `path`, up to a line end, as strings of about 1 MB cut at line ends."""
    with open(path, "rb") as f:
        buf = f.read(limit)
    buf = buf[:buf.rfind(b"\n") + 1] if len(buf) == limit else buf
    out, pos = [], 0
    while pos < len(buf):
        end = buf.find(b"\n", pos + CHUNK)
        end = len(buf) if end == -1 else end + 1
        out.append(buf[pos:end].decode("utf-8"))
        pos = end
    return out


# ---- measuring a process tree --------------------------------------------------------------------
class TreeWatch:
    """Samples the RSS of a process and all its descendants in a thread: the peak of their sum, and each
    process's own peak with its command line and RANK (oomwatch.MemoryWatch leaves out the root, which
    here is the process that trains the tokenizer)."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.root, self.interval = psutil.Process(pid), interval
        self.peak_total = 0
        self.procs: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TreeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0
        for p in procs:
            try:
                rss = p.memory_info().rss
                rec = self.procs.setdefault(p.pid, {"cmd": "", "rank": None, "peak": 0})
                if rec["rank"] is None:  # a new process shows its parent's until it has exec'd
                    rec["cmd"], rec["rank"] = " ".join(p.cmdline()), p.environ().get("RANK")
            except psutil.Error:  # exited between listing and reading
                continue
            total += rss
            rec["peak"] = max(rec["peak"], rss)
        self.peak_total = max(self.peak_total, total)

    def rank_peaks(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for rec in self.procs.values():
            if rec["rank"] is not None and "phalanx.run.worker" in rec["cmd"]:
                out[int(rec["rank"])] = max(out.get(int(rec["rank"]), 0), rec["peak"])
        return dict(sorted(out.items()))


def measure(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run `cmd` (output to `log`); wall time, peak tree RSS, per-process peaks. Exits on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        watch = TreeWatch(proc.pid).start()
        rc = proc.wait()
        wall = time.time() - t0
        watch.stop()
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        sys.exit(f"failed ({rc}): {' '.join(map(str, cmd))}\n--- {log} (tail) ---\n{tail}")
    return {"t0": t0, "wall_s": wall, "peak_tree_bytes": watch.peak_total,
            "peak_one_bytes": max((r["peak"] for r in watch.procs.values()), default=0),
            "processes": len(watch.procs), "rank_peak_bytes": watch.rank_peaks()}


def cores() -> int:
    return len(os.sched_getaffinity(0))


def phalanx(*args) -> list[str]:
    return [sys.executable, "-m", "phalanx", *map(str, args)]


# ---- phalanx -------------------------------------------------------------------------------------
def store_index(cache: Path) -> dict:
    found = sorted(cache.glob("store-*/index.json"))
    if len(found) != 1:
        sys.exit(f"expected one store with an index.json in {cache}, found {len(found)}")
    return json.loads(found[0].read_text())


def run_prepare(corpus: Path, cache: Path, logs: Path) -> dict:
    """Fresh preparation, then the same command on the complete store."""
    shutil.rmtree(cache, ignore_errors=True)
    cmd = phalanx("prepare", CONFIG, f"data.train={corpus}", f"data.cache_dir={cache}", "--quiet")
    first = measure(cmd, logs / "prepare.log")
    index = store_index(cache)
    s = index["summary"]
    again = measure(cmd, logs / "prepare-again.log")
    size = corpus.stat().st_size
    return {"corpus_bytes": size, "wall_s": first["wall_s"], "mb_per_s": size / MB / first["wall_s"],
            "tokens": s["tokens"], "tokens_per_s": s["tokens"] / first["wall_s"], "shards": s["shards"],
            "store_bytes": s["store_bytes"], "peak_tree_bytes": first["peak_tree_bytes"],
            "peak_one_bytes": first["peak_one_bytes"], "processes": first["processes"],
            "encode_s": s["seconds"], "encode_mb_per_s": s["mb_per_s"], "encoder": s["encoder"],
            "encoder_check": s["encoder_check"], "workers": s["workers"], "eos_id": index["eos_id"],
            "rerun_s": again["wall_s"], "tokenizer_dir": str(next(cache.glob("tokenizer-*")))}


def run_train(corpus: Path, cache: Path, run: Path, logs: Path) -> dict:
    """20 steps at 2 processes on the prepared store."""
    shutil.rmtree(run, ignore_errors=True)
    cmd = phalanx("train", CONFIG, f"data.train={corpus}", f"data.cache_dir={cache}", *TRAIN,
                  "--nproc-per-node", 2, "--run-dir", run, "--fresh")
    m = measure(cmd, logs / "train.log")
    summary = json.loads((run / "summary.json").read_text())
    # The workers' clock starts after the launcher's checks; back to epoch time via the file's mtime.
    t_launch = (run / "summary.json").stat().st_mtime - summary["wall_time_s"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "loss" in x and "event" not in x]
    reported = [max(v) for v in zip(*[x["ranks/host_peak_mb"] for x in steps if "ranks/host_peak_mb" in x])]
    return {"wall_s": m["wall_s"], "first_step_s": t_launch + summary["startup_s"] - m["t0"],
            "startup_s": summary["startup_s"], "first_log_line_s": steps[0]["time_s"] - m["t0"] if steps else None,
            "first_log_step": steps[0]["step"] if steps else None, "peak_tree_bytes": m["peak_tree_bytes"],
            "rank_peak_mb": [v / 2 ** 20 for v in m["rank_peak_bytes"].values()], "reported_host_peak_mb": reported,
            "tokens_per_s": summary.get("tokens_per_s")}


# ---- the raw limit and the usual recipe (each in a child process of this script) ------------------
def child_raw(corpus: Path, tok_dir: Path, limit: int, kind: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    chunks = text_chunks(corpus, limit)
    threads = cores()
    if kind == "tokenizers":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        t0, tokens = time.perf_counter(), 0
        for i in range(0, len(chunks), 8 * threads):  # bounded batches: an Encoding holds much more than ids
            tokens += sum(len(e.ids) for e in tok.encode_batch(chunks[i:i + 8 * threads], add_special_tokens=False))
    else:
        sys.path.insert(0, str(REPO))
        from phalanx.data.encoder import Encoder

        enc = Encoder(tok_dir, "tiktoken")
        if enc.kind != "tiktoken":
            return {"skipped": "tiktoken cannot express this tokenizer"}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            tokens = sum(a.size for a in pool.map(lambda c: enc.flat([c], None), chunks))
    seconds = time.perf_counter() - t0
    return {"input_bytes": sum(len(c.encode()) for c in chunks), "tokens": tokens, "encode_s": seconds,
            "threads": threads}


def child_recipe(corpus: Path, tok_dir: Path, eos: int, out: Path) -> dict:
    """nanoGPT's prepare.py with a batched map and this tokenizer (HF_DATASETS_CACHE set by the parent)."""
    import datasets
    import numpy as np
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))

    def tokenize(batch):
        ids = [x + [eos] for x in tok(batch["text"], add_special_tokens=False)["input_ids"]]
        return {"ids": ids, "len": [len(x) for x in ids]}

    ds = datasets.load_dataset("text", data_files=str(corpus), split="train")
    tokenized = ds.map(tokenize, batched=True, num_proc=cores(), remove_columns=["text"])
    total = int(np.sum(tokenized.with_format("numpy")["len"], dtype=np.uint64))
    arr = np.memmap(out, dtype=np.uint16, mode="w+", shape=(total,))
    shards, idx = min(1024, len(tokenized)), 0
    for i in range(shards):
        batch = tokenized.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
        part = np.concatenate(batch["ids"])
        arr[idx:idx + len(part)] = part
        idx += len(part)
    arr.flush()
    return {"rows": len(ds), "tokens": total}


def run_child(args: list, log: Path, env: dict | None = None) -> tuple[dict, dict]:
    result = log.with_suffix(".json")
    m = measure([sys.executable, __file__, "--child", *map(str, args), "--child-out", result], log, env)
    return m, json.loads(result.read_text())


def run_raw(corpus: Path, tok_dir: Path, limit: int, logs: Path) -> list[dict]:
    rows = []
    for kind in ("tokenizers", "tiktoken"):
        m, r = run_child(["raw", corpus, tok_dir, limit, kind], logs / f"raw-{kind}.log")
        if "skipped" in r:
            print(f"  raw {kind}: skipped ({r['skipped']})", file=sys.stderr)
            continue
        rows.append({"what": f"raw limit: {kind} on {r['threads']} threads (encoding only)",
                     "input_bytes": r["input_bytes"], "seconds": r["encode_s"], "tokens": r["tokens"],
                     "peak_tree_bytes": m["peak_tree_bytes"]})
    return rows


def run_recipe(corpus: Path, tok_dir: Path, eos: int, work: Path, logs: Path) -> dict:
    hf = work / "hf-cache"
    shutil.rmtree(hf, ignore_errors=True)
    env = {"HF_DATASETS_CACHE": str(hf), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    m, r = run_child(["recipe", corpus, tok_dir, eos, work / "recipe.bin"], logs / "recipe.log", env)
    shutil.rmtree(hf, ignore_errors=True)
    (work / "recipe.bin").unlink(missing_ok=True)
    size = corpus.stat().st_size
    return {"what": f"HF datasets recipe, {size / GB:g} GB corpus ({cores()} procs, whole run)", "input_bytes": size,
            "seconds": m["wall_s"], "tokens": r["tokens"], "rows": r["rows"], "peak_tree_bytes": m["peak_tree_bytes"]}


# ---- tables --------------------------------------------------------------------------------------
def header() -> list[str]:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    dirty = " (+ uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return ["# phalanx prepare benchmark", "",
            f"machine: {cores()} cores, {psutil.virtual_memory().total / 2 ** 30:.0f} GiB RAM; "
            f"phalanx commit {git('rev-parse', '--short', 'HEAD')}{dirty}; {time.strftime('%Y-%m-%d %H:%M')}", ""]


def main_table(results: list[dict]) -> list[str]:
    cols = ["corpus GB", "prepare wall s", "MB/s", "M tokens/s", "peak tree RSS GB", "store MB", "shards",
            "re-run s", "train time-to-first-step s (workers' startup_s)", "per-rank peak RSS MB (rank 0 / rank 1)"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        p, t = r["prepare"], r.get("train")
        first = f"{t['first_step_s']:.1f} ({t['startup_s']:.1f})" if t else "-"
        ranks = " / ".join(f"{v:.0f}" for v in t["rank_peak_mb"]) if t else "-"
        out.append(f"| {p['corpus_bytes'] / GB:g} | {p['wall_s']:.1f} | {p['mb_per_s']:.1f} | "
                   f"{p['tokens_per_s'] / 1e6:.2f} | {p['peak_tree_bytes'] / 2 ** 30:.2f} | "
                   f"{p['store_bytes'] / MB:.1f} | {p['shards']} | {p['rerun_s']:.2f} | {first} | {ranks} |")
    return out


def side_table(rows: list[dict]) -> list[str]:
    cols = ["what", "input MB", "s", "MB/s", "M tokens/s", "peak tree RSS GB", "phalanx MB/s / this"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        rate = r["input_bytes"] / MB / r["seconds"]
        ratio = f"{r['phalanx_mb_per_s'] / rate:.2f}" if r.get("phalanx_mb_per_s") else "-"
        peak = f"{r['peak_tree_bytes'] / 2 ** 30:.2f}" if r["peak_tree_bytes"] is not None else "-"
        out.append(f"| {r['what']} | {r['input_bytes'] / MB:.1f} | {r['seconds']:.1f} | {rate:.1f} | "
                   f"{r['tokens'] / r['seconds'] / 1e6:.2f} | {peak} | {ratio} |")
    return out


# ---- main ----------------------------------------------------------------------------------------
def sizes(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-gb", type=sizes, default=sizes("0.1,1"), help="corpus sizes for phalanx (GB)")
    p.add_argument("--recipe-sizes-gb", type=sizes, default=sizes("0.1"),
                   help="corpus sizes for the HF datasets recipe; each must be one of --sizes-gb")
    p.add_argument("--work", type=Path, default=Path("/tmp/phalanx-bench-prepare-work"),
                   help="corpora, caches and runs (not in the repository)")
    p.add_argument("--out", type=Path, default=Path("/tmp/phalanx-bench-prepare"), help="prepare.md, prepare.json")
    p.add_argument("--skip-train", action="store_true", help="no 20-step training runs")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is None:
        if not a.sizes_gb or min(a.sizes_gb) <= 0:
            p.error("--sizes-gb: expected positive sizes")
        if set(a.recipe_sizes_gb) - set(a.sizes_gb):
            p.error(f"--recipe-sizes-gb: {sorted(set(a.recipe_sizes_gb) - set(a.sizes_gb))} not in --sizes-gb "
                    f"(the recipe uses the tokenizer phalanx trained for that corpus)")
        if a.work.resolve().is_relative_to(REPO) or a.out.resolve().is_relative_to(REPO):
            p.error("--work and --out must be outside the repository")
    return a


def child(a: argparse.Namespace) -> None:
    kind, corpus, tok_dir, *rest = a.child
    if kind == "raw":
        result = child_raw(Path(corpus), Path(tok_dir), int(rest[0]), rest[1])
    else:
        result = child_recipe(Path(corpus), Path(tok_dir), int(rest[0]), Path(rest[1]))
    a.child_out.write_text(json.dumps(result))


def bench_size(gb: float, a: argparse.Namespace) -> dict:
    say = lambda text: print(f"[{gb:g} GB] {text}", file=sys.stderr, flush=True)  # noqa: E731
    work = a.work / f"{gb:g}gb"
    corpus = make_corpus(a.work, gb)
    say(f"corpus {corpus}")
    prep = run_prepare(corpus, work / "cache", work / "logs")
    say(f"prepare {prep['wall_s']:.1f} s ({prep['mb_per_s']:.1f} MB/s, encoder {prep['encoder']}), "
        f"peak tree {prep['peak_tree_bytes'] / 2 ** 30:.2f} GB; again {prep['rerun_s']:.2f} s")
    out = {"gb": gb, "corpus": str(corpus), "prepare": prep}
    if not a.skip_train:
        out["train"] = run_train(corpus, work / "cache", work / "run", work / "logs")
        say(f"train: first step after {out['train']['first_step_s']:.1f} s, "
            f"rank peaks {[round(v) for v in out['train']['rank_peak_mb']]} MB")
    if gb in a.recipe_sizes_gb:
        out["recipe"] = run_recipe(corpus, Path(prep["tokenizer_dir"]), prep["eos_id"], work, work / "logs")
        out["recipe"]["phalanx_mb_per_s"] = prep["mb_per_s"]
        say(f"recipe {out['recipe']['seconds']:.1f} s")
    return out


def side_rows(results: list[dict], a: argparse.Namespace) -> list[dict]:
    """Raw limits on the first 100 MB of the corpus nearest above 100 MB (else the largest), beside
    phalanx on that same corpus and the recipes."""
    above = [r for r in results if r["prepare"]["corpus_bytes"] >= RAW_BYTES]
    base = min(above, key=lambda r: r["gb"]) if above else max(results, key=lambda r: r["gb"])
    p = base["prepare"]
    rows = run_raw(Path(base["corpus"]), Path(p["tokenizer_dir"]), RAW_BYTES, a.work / f"{base['gb']:g}gb" / "logs")
    for r in rows:
        r["phalanx_mb_per_s"] = p["mb_per_s"]
    rows.append({"what": f"phalanx prepare, {base['gb']:g} GB corpus (whole run)", "input_bytes": p["corpus_bytes"],
                 "seconds": p["wall_s"], "tokens": p["tokens"], "peak_tree_bytes": p["peak_tree_bytes"]})
    rows.append({"what": f"phalanx prepare, {base['gb']:g} GB corpus (its encoding step, from index.json)",
                 "input_bytes": p["corpus_bytes"], "seconds": p["encode_s"], "tokens": p["tokens"],
                 "peak_tree_bytes": None})
    return rows + [r["recipe"] for r in results if "recipe" in r]


def main() -> None:
    a = parse_args()
    if a.child:
        return child(a)
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    results = [bench_size(gb, a) for gb in a.sizes_gb]
    side = side_rows(results, a)
    lines = header() + main_table(results) + ["", "Raw encoding limit and the usual recipe:", ""] + side_table(side)
    lines += ["", f"MB/s and tokens/s of phalanx are over the whole command's wall time (tokenizer training "
                  f"included); encoder used: {', '.join(sorted({r['prepare']['encoder'] for r in results}))}."]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    (a.out / "prepare.md").write_text(text)
    (a.out / "prepare.json").write_text(json.dumps({"sizes": results, "side": side, "header": header()}, indent=1))
    print(f"written: {a.out / 'prepare.md'}, {a.out / 'prepare.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
