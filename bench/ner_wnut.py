"""phalanx vs the transformers token-classification guide's recipe (the Trainer) on WNUT 2017 with the real
all-MiniLM-L6-v2, 2 processes, same machine, threads, data, steps, micro-batch (16 per process, global 32),
learning rate and weight decay; everything else each side's defaults (phalanx: examples/ner.yaml's task
settings, length-grouped batches, cosine schedule; the Trainer: random order, dynamic padding, linear decay).

Tables (the sides alternate within each seed):
  quality  test-set entity F1 (seqeval's default mode, on all 23,394 words of emerging.test.annotated) after
           --steps steps, per seed and mean with a t 95% interval over --seeds; phalanx tags with `phalanx
           predict`, the Trainer side the guide's way (bench/ner_trainer_side.py)
  speed    useful tokens/s (non-padding tokens of the global batches over wall clocks, the first 10 steps
           untimed) of the same runs: phalanx, the Trainer's defaults (trainer: random order, dynamic padding,
           DDP's find_unused_parameters=True), and the Trainer with group_by_length (trainer-grouped: the same
           math as phalanx's grouped batches); peak private memory per rank (RssAnon, sampled every 0.2 s)
  long     WNUT's sentences joined into documents of 300-1,000 words (train and test files alike; seeded),
           each side trained on the training documents for --long-steps steps (micro 4, global 8) and tagging
           the test documents: words whose labels were trained on, test words predicted, entity F1 on all test
           words (a word without a prediction counts as O). The recipe truncates at the tokenizer's 512.

    python bench/ner_wnut.py [--seeds 0,1,2] [--steps 212] [--long-steps 60] [--work DIR]    # ~35-45 min
    python bench/ner_wnut.py --smoke          # 1 seed, 20 steps, 6 long steps, 200 test sentences: ~3-4 min
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from vs_trainer import phalanx_rate, trainer_rate
from vs_trl_runs import run

REPO = Path(__file__).resolve().parents[1]
WNUT = REPO.parent / "shared" / "data" / "wnut17"
MINILM = REPO.parent / "shared" / "models" / "all-minilm-l6-v2"
NPROC, MICRO, GLOBAL = 2, 16, 32
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # Student's t, two-sided 95%, by degrees of freedom

sys.path.insert(0, str(REPO))
from phalanx.data import readers  # noqa: E402
from phalanx.data.tokcls import labels as tag_names  # noqa: E402


def read_conll(path: Path) -> list[tuple[list[str], list[str]]]:
    text = path.read_text(encoding="utf-8").removeprefix("\ufeff")
    return [(w, t) for w, t, _ in readers.conll_sentences(text, (0, -1, "auto"), str, 0)]


def write_conll(path: Path, rows) -> Path:
    path.write_text("".join("".join(f"{w}\t{t}\n" for w, t in zip(*r)) + "\n" for r in rows), encoding="utf-8")
    return path


def documents(rows, seed: int, limit: int = 0) -> list[tuple[list[str], list[str]]]:
    """Consecutive sentences joined into documents of 300-1,000 words (the last one may be shorter)."""
    rng, out, words, tags, target = random.Random(seed), [], [], [], 0
    for w, t in rows:
        target = target or rng.randint(300, 1000)
        words, tags = words + w, tags + t
        if len(words) >= target:
            out.append((words, tags))
            words, tags, target = [], [], 0
    out += [(words, tags)] if words else []
    return out[:limit] if limit else out


def f1(gold, pred) -> float:
    from seqeval.metrics import f1_score

    return float(f1_score([t for _, t in gold], pred))


def mean_ci(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.4f}"
    m, s = statistics.mean(values), statistics.stdev(values)
    return f"{m:.4f} ± {T95[len(values) - 1] * s / len(values) ** 0.5:.4f}"


# ---- the two sides ------------------------------------------------------------------------------------------
def phalanx_side(a, out: Path, train: Path, steps: int, seed: int, micro: int, total: int, predict: list[Path]):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "phalanx", "train", str(REPO / "examples" / "ner.yaml"), f"data.train={train}",
           f"data.validation={WNUT / 'emerging.dev.conll'}", f"model.pretrained={MINILM}", f"train.lr={a.lr}",
           "train.warmup_steps=0", "train.weight_decay=0.01", f"train.micro_batch_size={micro}",
           f"train.global_batch_size={total}", f"train.max_steps={steps}", f"train.seed={seed}",
           f"train.log_every={a.warm}", "train.eval_every=0", "train.checkpoint_every=0", "train.eval_max_samples=64",
           "token_classify.max_length=128", "log.progress=off", f"data.cache_dir={a.work / 'cache'}",
           "--run-dir", str(out), "--nproc-per-node", str(NPROC)]
    peaks = run(cmd, out.with_suffix(".log"), a.work, timeout=3600)
    summary = json.loads((out / "summary.json").read_text())
    result = {"private_mb": [peaks.private[r] for r in sorted(peaks.private)],
              "train_labelled_words": None, **(phalanx_rate(out, a.warm) if steps > a.warm else {}), "pred": {},
              "dropped": {}, "summary_eval_f1": summary.get("eval/f1")}
    for path in predict:
        tagged = out.with_name(out.name + f"-{path.stem}.jsonl")
        run([sys.executable, "-m", "phalanx", "predict", str(out), "--input", str(path), "--output", str(tagged)],
            out.with_suffix(".predict.log"), a.work)
        rows = [json.loads(line) for line in tagged.read_text(encoding="utf-8").splitlines()]
        result["pred"][path.name] = [r["tags"] for r in rows]
        result["dropped"][path.name] = sum(len(w) for w, _ in read_conll(path)) - sum(len(r["tags"]) for r in rows)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return result


def trainer_side(a, out: Path, train: Path, steps: int, seed: int, micro: int, total: int, predict: list[Path],
                 names: list[str], group: bool):
    accum = total // (micro * NPROC)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
           str(REPO / "bench" / "ner_trainer_side.py"), "--model", str(MINILM), "--train", str(train),
           "--labels", json.dumps(names), "--micro", str(micro), "--accum", str(accum), "--steps", str(steps),
           "--lr", str(a.lr), "--seed", str(seed), "--out", str(out), "--work", str(a.work / "trainer-out"),
           *(["--group"] if group else []), *[x for p in predict for x in ("--predict", str(p))]]
    peaks = run(cmd, out.with_suffix(".log"), a.work, timeout=3600)
    got = json.loads(Path(f"{out}-pred.json").read_text())
    return {"private_mb": [peaks.private[r] for r in sorted(peaks.private)],
            "train_labelled_words": got["train_labelled_words"],
            **(trainer_rate(out, NPROC, a.warm) if steps > a.warm else {}),
            "pred": {p.name: got[p.name]["pred"] for p in predict},
            "dropped": {p.name: got[p.name]["dropped_words"] for p in predict}}


# ---- tables ---------------------------------------------------------------------------------------------
def quality_and_speed(a, names: list[str], test: list) -> None:
    test_path = WNUT / "emerging.test.annotated"
    if a.test_sentences:  # the smoke: the first sentences only
        test = test[:a.test_sentences]
        test_path = write_conll(a.work / "test-head.conll", test)
    sides = ["phalanx", "trainer", "trainer-grouped"]
    results: dict = {s: [] for s in sides}
    for seed in a.seeds:
        for side in sides:
            out = a.work / f"{side}-s{seed}"
            if side == "phalanx":
                r = phalanx_side(a, out, WNUT / "wnut17train.conll", a.steps, seed, MICRO, GLOBAL, [test_path])
            else:
                r = trainer_side(a, out, WNUT / "wnut17train.conll", a.steps, seed, MICRO, GLOBAL, [test_path], names,
                                 group=side == "trainer-grouped")
            r["f1"] = f1(test, r["pred"][test_path.name])
            results[side].append(r)
            rate = f", {r['useful_tps']:.0f} useful tok/s, {r['step_s']:.3f} s/step" if "useful_tps" in r else ""
            print(f"{side} seed {seed}: test F1 {r['f1']:.4f}{rate}, private "
                  f"{' / '.join(f'{m:.0f}' for m in r['private_mb'])} MB", flush=True)
    print(f"\n### WNUT 2017, all-MiniLM-L6-v2, {NPROC} processes: {a.steps} steps x {GLOBAL} sentences "
          f"(micro {MICRO}), lr {a.lr}; test-set entity F1 (seqeval, {sum(len(t) for _, t in test):,} words)\n")
    print("| side | F1 per seed | F1 mean ± t 95% | useful tok/s (median) | s/step | peak private MB per rank "
          "(median) |\n|---|---|---|---|---|---|")
    for side, rs in results.items():
        f1s = [r["f1"] for r in rs]
        tps = [r["useful_tps"] for r in rs if "useful_tps" in r]
        step = [r["step_s"] for r in rs if "step_s" in r]
        mem = [statistics.median(r["private_mb"][k] for r in rs) for k in range(len(rs[0]["private_mb"]))]
        rate = f"{statistics.median(tps):.0f} | {statistics.median(step):.3f}" if tps else "- | -"
        print(f"| {side} | {' / '.join(format(v, '.4f') for v in f1s)} | {mean_ci(f1s)} | {rate} | "
              f"{' / '.join(format(m, '.0f') for m in mem)} |")
    if all(any("useful_tps" in r for r in rs) for rs in results.values()):
        tps = {s: statistics.median(r["useful_tps"] for r in rs) for s, rs in results.items()}
        print(f"\n| ratio (useful tokens/s) | value |\n|---|---|\n"
              f"| same math: phalanx / trainer-grouped | {tps['phalanx'] / tps['trainer-grouped']:.2f}x |\n"
              f"| defaults: phalanx / trainer | {tps['phalanx'] / tps['trainer']:.2f}x |")


def long_documents(a, names: list[str]) -> None:
    train_docs = documents(read_conll(WNUT / "wnut17train.conll"), 0)
    test_docs = documents(read_conll(WNUT / "emerging.test.annotated"), 1, limit=a.long_test_docs)
    train = write_conll(a.work / "long-train.conll", train_docs)
    test = write_conll(a.work / "long-test.conll", test_docs)
    words = sum(len(w) for w, _ in test_docs)
    print(f"\n### Long documents: {len(train_docs)} training documents ({sum(len(w) for w, _ in train_docs):,} words), "
          f"{len(test_docs)} test documents ({words:,} words), 300-1,000 words each; {a.long_steps} steps x 8 "
          f"documents (micro 4)\n\n| side | training words labelled | test words predicted | test entity F1 (all "
          f"words) |\n|---|---|---|---|")
    for side in ("phalanx", "trainer"):
        out = a.work / f"long-{side}"
        if side == "phalanx":
            r = phalanx_side(a, out, train, a.long_steps, 0, 4, 8, [test])
            labelled = sum(len(w) for w, _ in train_docs)  # every word owned by one window (tests/test_token_classify)
        else:
            r = trainer_side(a, out, train, a.long_steps, 0, 4, 8, [test], names, group=False)
            labelled = r["train_labelled_words"]
        predicted = words - r["dropped"][test.name]
        total = sum(len(w) for w, _ in train_docs)
        print(f"| {side} | {labelled:,} of {total:,} ({labelled / total:.1%}) | {predicted:,} of {words:,} "
              f"({predicted / words:.1%}) | {f1(test_docs, r['pred'][test.name]):.4f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=212, help="quality runs: 212 = 2 epochs of the 3,394 sentences")
    p.add_argument("--long-steps", type=int, default=60)
    p.add_argument("--long-test-docs", type=int, default=0, help="0 = all")
    p.add_argument("--test-sentences", type=int, default=0, help="quality: the first N test sentences; 0 = all")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--work", default="")
    p.add_argument("--smoke", action="store_true", help="1 seed, 20 steps (5 untimed), 6 long steps, 200 test "
                   "sentences, 4 long test documents")
    a = p.parse_args()
    if a.smoke:
        a.seeds, a.steps, a.long_steps, a.long_test_docs, a.test_sentences = "0", 20, 6, 4, 200
    a.warm = 5 if a.smoke else 10  # steps not timed (and phalanx's log interval)
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.work = Path(a.work or f"/tmp/ner-wnut-{int(time.time())}")
    a.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    names = tag_names.ordered(t for _, tags in read_conll(WNUT / "wnut17train.conll") for t in tags)
    print(f"phalanx bench/ner_wnut.py {' '.join(sys.argv[1:])}; work {a.work}; labels {names}", flush=True)
    quality_and_speed(a, names, read_conll(WNUT / "emerging.test.annotated"))
    long_documents(a, names)
    print(f"\n(bench/ner_wnut.py {' '.join(sys.argv[1:])}: {(time.time() - started) / 60:.1f} min)")


if __name__ == "__main__":
    main()
