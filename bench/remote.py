"""Data on object storage: training and preparation from a local S3-compatible server vs local disk (not a
test; prints Markdown tables).

    python bench/remote.py [--corpus-gb 1] [--small-gb 0.25] [--steps 150] [--repeats 3] [--work DIR] [--out DIR]
                           [--skip-prepare] [--skip-train]

The server is moto's (tests/s3server.py) in a thread of this process: it keeps every object in this
process's memory and answers over HTTP on 127.0.0.1, so a ratio against local disk measures moto too
(one Python process serving every request), not only phalanx's side.

Training (2 processes, a small GPT on Tiny Shakespeare prepared into ~15 KB shards, --steps steps, the
windowed order of one-shard windows everywhere): tokens/s from each run's summary.json (its training time,
data waits included) for the store on local disk, then through the node cache from S3: cold (a fresh
cache, no limit), warm (that cache again), and a fresh cache of a quarter of the store (evicting as it
goes); --repeats rounds, each remote run's ratio against the mean of the local runs before and after it
(the load of a shared machine drifts within minutes), the median of those; the mean time of the step's data
phase (taking the micro-batches: waits for the cache included) and its share of the step; with each remote run the
cache's hit rate (shard maps whose file was there) and the bytes downloaded against the store's size (the
cache's `.stats.<pid>.json`).

Preparation of a --corpus-gb text corpus (bench/prepare.py's: WikiText-2 and Tiny Shakespeare lines,
shuffled and repeated), with a fixed tokenizer (trained once, so every run encodes the same way): read
from local disk into a local store; read from S3 into a local store; read from S3 into a store on S3 by
one launcher, and by two launchers at once (two "nodes" on this machine's 2 cores, a cache each: they
split the pieces, so the ratio is the coordination's cost, not a speed-up). Peak RSS of the preparing
process tree for the S3 input at --small-gb and --corpus-gb (flat in the corpus size, as on disk).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]
from prepare import GB, MB, make_corpus, measure, phalanx  # noqa: E402  (bench/prepare.py)
from s3server import S3Server  # noqa: E402  (tests/s3server.py)

from phalanx.data.tokenizer import load_saved  # noqa: E402

SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
MODEL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=128", "model.block_size=64", "data.vocab_size=2048",
         "train.micro_batch_size=8", "train.global_batch_size=32", "train.eval_every=0", "train.log_every=10",
         "train.checkpoint_every=0", "train.eval_max_samples=64", "log.progress=off", "data.shard_mb=0.02",
         "data.order=windowed", "data.order_window=1"]


def train(run: Path, cache: Path, steps: int, logs: Path, *extra) -> dict:
    cmd = phalanx("train", f"data.train={SHAKESPEARE}", f"data.cache_dir={cache}", "--run-dir", run,
                  f"train.max_steps={steps}", *MODEL, *extra, "--nproc-per-node", 2)
    shutil.rmtree(run, ignore_errors=True)
    measured = measure(cmd, logs / f"{run.name}.log")
    summary = json.loads((run / "summary.json").read_text())
    steps = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "data_time_s" in m]
    out = {"tokens_per_s": summary["tokens_per_s"], "train_s": summary["train_time_s"], "wall_s": measured["wall_s"],
           "data_ms": 1e3 * statistics.mean(m["data_time_s"] for m in steps),  # the logged steps' data phase
           "data_share": sum(m["data_time_s"] for m in steps) / sum(m["step_time_s"] for m in steps)}
    files = list(cache.glob("remote/store-*/.stats.*.json"))  # one per process of the run (data/remote/cache.py)
    if files:
        stats = [json.loads(p.read_text()) for p in files]
        hits, misses = sum(s["hits"] for s in stats), sum(s["misses"] for s in stats)
        out.update(hit_rate=hits / max(hits + misses, 1), fetched=sum(s["fetched_bytes"] for s in stats))
        for p in files:
            p.unlink()  # the next run on this cache counts afresh
    return out


def bench_train(s3: S3Server, work: Path, steps: int, repeats: int) -> list[dict]:
    """Rounds of: local disk, S3 with a fresh cache (cold), that cache again (warm), S3 with a fresh cache
    of a quarter of the store; medians over the rounds (a shared machine drifts)."""
    logs, url = work / "logs", s3.bucket("bench-train")
    store = f"data.store_url={url}/stores"
    train(work / "prepare", work / "cache-prepare", 2, logs, store)  # the store, prepared into S3
    size = json.loads(next((work / "cache-prepare" / "remote").glob("store-*/index.json")).read_text())
    size = size["summary"]["store_bytes"]
    quarter = f"data.cache_limit_gb={size / 4 / GB:.6f}"
    cases = {"local disk": ("cache-local", False, ()), "S3, cold cache": ("cache-full", True, (store,)),
             "S3, warm cache": ("cache-full", False, (store,)),
             "S3, cache 1/4 of the store": ("cache-quarter", True, (store, quarter))}
    runs: dict[str, list[dict]] = {case: [] for case in cases}
    for i in range(repeats + 1):  # a last local run: each round's runs lie between two local ones
        for case, (cache, fresh, extra) in cases.items():
            if i == repeats and case != "local disk":
                break
            if fresh:
                shutil.rmtree(work / cache, ignore_errors=True)
            runs[case].append(train(work / "run", work / cache, steps, logs, *extra))
    local = [r["tokens_per_s"] for r in runs["local disk"]]
    out = []
    for case, rs in runs.items():
        # paired with the local runs around it: the load of a shared machine drifts within minutes
        ratios = [] if case == "local disk" else \
            [r["tokens_per_s"] / ((local[i] + local[i + 1]) / 2) for i, r in enumerate(rs)]
        row = {"case": case, "store_bytes": size, "runs": rs, "ratios": ratios,
               "ratio": statistics.median(ratios) if ratios else 1.0,
               "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
               "data_ms": statistics.median(r["data_ms"] for r in rs),
               "data_share": statistics.median(r["data_share"] for r in rs)}
        if "hit_rate" in rs[0]:
            row.update(hit_rate=statistics.mean(r["hit_rate"] for r in rs),
                       fetched=statistics.mean(r["fetched"] for r in rs))
        out.append(row)
    return out


def prepare(cmd_extra: list, cache: Path, logs: Path, name: str) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    return measure(phalanx("prepare", *cmd_extra, f"data.cache_dir={cache}", "--quiet"), logs / f"{name}.log")


def bench_prepare(s3: S3Server, work: Path, corpus_gb: float, small_gb: float) -> list[dict]:
    logs, url = work / "logs", s3.bucket("bench-prepare")
    big, small = make_corpus(work, corpus_gb), make_corpus(work, small_gb)
    base = ["data.val_fraction=0", "data.vocab_size=4096"]
    tok = work / "tok-cache"
    prepare([f"data.train={small}", *base], tok, logs, "tokenizer")  # one tokenizer for every run
    shutil.rmtree(work / "tok", ignore_errors=True)
    load_saved(next(tok.glob("tokenizer-*"))).save_pretrained(work / "tok")  # a folder data.tokenizer takes
    base.append(f"data.tokenizer={work / 'tok'}")
    t0 = time.time()
    for corpus in (big, small):
        s3.fs.put_file(str(corpus), f"{url}/{corpus.name}")
    print(f"uploaded to the S3 server in {time.time() - t0:.1f} s", flush=True)
    s3_big, s3_small = f"data.train={url}/{big.name}", f"data.train={url}/{small.name}"
    rows = [("local disk -> local store", prepare([f"data.train={big}", *base], work / "p-local", logs, "p-local")),
            ("S3 -> local store", prepare([s3_big, *base], work / "p-s3", logs, "p-s3")),
            ("S3 -> S3 store, 1 launcher", prepare([s3_big, *base, f"data.store_url={url}/one"], work / "p-one",
                                                   logs, "p-one"))]
    two = [subprocess.Popen(phalanx("prepare", s3_big, *base, f"data.store_url={url}/two",
                                    f"data.cache_dir={work / f'p-two{i}'}", "--quiet", "--workers", 1),
                            cwd=REPO, stdout=subprocess.PIPE, text=True) for i in range(2)]
    t0 = time.time()
    shares = [int(p.communicate()[0].split("encoded_here ")[1].split(";")[0]) for p in two]
    rows.append(("S3 -> S3 store, 2 launchers (1 worker each)", {"wall_s": time.time() - t0, "shares": shares}))
    small_run = prepare([s3_small, *base], work / "p-small", logs, "p-small")
    out = [{"case": name, "corpus_bytes": big.stat().st_size, **r} for name, r in rows]
    out.append({"case": f"S3 -> local store, {small_gb:g} GB", "corpus_bytes": small.stat().st_size, **small_run})
    return out


def tables(train_rows: list[dict], prep_rows: list[dict]) -> str:
    lines = []
    if train_rows:
        lines += ["| training (2 processes) | tokens/s (median) | vs local disk (paired, median; each round) | "
                  "data phase per step (ms; share of the step) | cache hit rate | downloaded / store |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in train_rows:
            hit = f"{r['hit_rate']:.1%}" if "hit_rate" in r else "-"
            got = f"{r['fetched'] / r['store_bytes']:.2f}" if "fetched" in r else "-"
            each = f"{r['ratio']:.3f} ({', '.join(f'{x:.2f}' for x in r['ratios'])})" if r["ratios"] else "1"
            lines.append(f"| {r['case']} | {r['tokens_per_s']:,.0f} | {each} | {r['data_ms']:.2f} "
                         f"({r['data_share']:.1%}) | {hit} | {got} |")
    if prep_rows:
        base = prep_rows[0]["wall_s"]
        lines += ["", "| preparation | corpus | wall s | MB/s | vs local disk | peak RSS of the tree |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in prep_rows:
            peak = f"{r['peak_tree_bytes'] / 2**20:,.0f} MiB" if "peak_tree_bytes" in r else "-"
            extra = f" (pieces {'+'.join(map(str, r['shares']))})" if "shares" in r else ""
            lines.append(f"| {r['case']}{extra} | {r['corpus_bytes'] / GB:.2f} GB | {r['wall_s']:.1f} | "
                         f"{r['corpus_bytes'] / MB / r['wall_s']:.1f} | {base / r['wall_s']:.2f} | {peak} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus-gb", type=float, default=1.0)
    ap.add_argument("--small-gb", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/phalanx-bench-remote"))
    ap.add_argument("--out", type=Path, default=None, help="where remote.md and remote.json go (default: --work)")
    ap.add_argument("--skip-prepare", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    with S3Server() as s3:
        train_rows = [] if a.skip_train else bench_train(s3, a.work, a.steps, a.repeats)
        prep_rows = [] if a.skip_prepare else bench_prepare(s3, a.work, a.corpus_gb, a.small_gb)
    text = tables(train_rows, prep_rows)
    print(text)
    a.out = a.out or a.work
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "remote.md").write_text(text + "\n")
    (a.out / "remote.json").write_text(json.dumps({"train": train_rows, "prepare": prep_rows}, indent=1))


if __name__ == "__main__":
    main()
