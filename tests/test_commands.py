"""Every command on every task's example config, driven by the task registry: a new task joins this test
(and must say here what small data it trains on). Commands that use a finished run apply to the tasks the
registry lists for them; every other combination is exit 2 with one line. The commands that do not need a
finished run (bench, doctor, sweep) are a slow test of their own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import DATA as DATA_DIR
from conftest import REPO, SHAKESPEARE, SST2, phalanx, small_gpt2_base

from phalanx.core.registry import RUN_COMMANDS, TASKS

SMALL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.vocab_size=512", "train.max_steps=2",
         "train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1", "train.log_every=1",
         "train.eval_every=0", "train.eval_max_samples=8", "log.progress=off", "dist.threads_per_worker=1"]


def _texts(folder: Path) -> dict[str, str]:
    talk = folder / "talk.jsonl"
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if line.strip()][:400]
    talk.write_text("".join(json.dumps({"messages": [{"role": "user", "content": a},
                                                     {"role": "assistant", "content": b}]}) + "\n"
                            for a, b in zip(lines[::2], lines[1::2])))
    sst = folder / "sst.jsonl"
    sst.write_text("".join((SST2 / "train.jsonl").read_text().splitlines(keepends=True)[:600]))
    text = folder / "text.txt"
    text.write_text(SHAKESPEARE.read_text()[:60_000])
    pairs = folder / "pairs.jsonl"  # the next line preferred to the same line backwards
    pairs.write_text("".join(json.dumps({"prompt": a, "chosen": b, "rejected": " ".join(b.split()[::-1])}) + "\n"
                             for a, b in zip(lines[::2], lines[1::2]) if len(b.split()) > 1))
    conll = folder / "tags.conll"  # WNUT 2017's first 120 sentences
    conll.write_text("\n\n".join((DATA_DIR / "wnut17" / "wnut17train.conll").read_text().split("\n\n")[:120]) + "\n")
    prompts = folder / "prompts.jsonl"  # sums with checkable answers
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                               for a in range(12) for b in range(5)))
    base = small_gpt2_base(folder / "base", 20_000, 300, positions=64, width=32)  # grpo samples from a base
    return {"lm": text, "classify": sst, "chat": talk, "preference": pairs, "token_classify": conll, "grpo": prompts,
            "base": base}


# What each task trains on here, and how each run command is called on its run.
DATA = {"lm": ["model.block_size=32"], "classify": ["classify.max_length=32", "data.val_fraction=0.1"],
        "chat": ["model.block_size=64", "model.pretrained="],
        "preference": ["model.block_size=64", "model.pretrained="],
        "token_classify": ["model.pretrained=", "token_classify.max_length=32", "data.val_fraction=0.1"],
        "grpo": ["model.pretrained=BASE", "model.lora.r=0", "model.block_size=64", "grpo.num_generations=2",
                 "grpo.max_completion_length=8", "train.eval_max_samples=4"]}
USE = {"generate": ["--prompt", "The", "--max-new-tokens", "4"], "predict": ["--input", "INPUT"],
       "chat": ["--message", "Hello", "--max-new-tokens", "4"]}


def test_every_task_is_covered():
    assert set(DATA) == set(TASKS), "a new task: add its small data here"
    assert set(USE) == set(RUN_COMMANDS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _texts(tmp_path_factory.mktemp("data"))


def _items(task: str, data: dict, cache_dir) -> list[str]:
    return [str(REPO / TASKS[task].example), f"data.train={data[task]}", f"data.cache_dir={cache_dir}", *SMALL,
            *(a.replace("BASE", str(data["base"])) for a in DATA[task])]


# lm, the default job, runs in `make test`; each other task's train, predict and chat paths have their own
# end-to-end tests in its test file, so here they are slow-marked (`make test-all`).
@pytest.mark.parametrize("task", [t if t == "lm" else pytest.param(t, marks=pytest.mark.slow) for t in sorted(TASKS)])
def test_every_command_on_the_tasks_example(task, data, tmp_path, cache_dir):
    spec = TASKS[task]
    items = _items(task, data, cache_dir)
    run = tmp_path / "run"

    proc = phalanx("config", *items, check=True)
    assert yaml.safe_load(proc.stdout)["task"] == task
    proc = phalanx("prepare", *items, "--quiet", check=True)
    assert "phalanx: train" in proc.stdout  # the training split's summary line
    phalanx("train", *items, "--run-dir", run, check=True, timeout=180)
    assert (run / "final" / "config.json").is_file() and (run / "outcome.json").is_file()
    phalanx("report", run, check=True)

    for command, args in USE.items():
        args = [str(data[task]) if a == "INPUT" else a for a in args]
        proc = phalanx(command, run, *args, timeout=120)
        if command in spec.uses:
            assert proc.returncode == 0, (command, proc.stderr[-2000:])
            # A 2-step chat model may well end its turn at once: its reply can be empty (test_chat.py checks
            # replies of a trained model); the other commands always print something.
            assert proc.stdout.strip() or command == "chat", (command, proc.stdout)
        else:
            assert proc.returncode == 2, (command, proc.stderr[-2000:])
            (line,) = proc.stderr.strip().splitlines()
            assert f"task is '{task}'" in line and f"phalanx {command}" in line


@pytest.mark.slow  # ~25 s per task; bench, doctor and sweep are in CI for lm (test_bench_doctor.py, test_sweep.py)
@pytest.mark.parametrize("task", sorted(TASKS))
def test_bench_doctor_and_sweep_on_the_tasks_example(task, data, tmp_path, cache_dir):
    spec = TASKS[task]
    items = _items(task, data, cache_dir)
    phalanx("bench", *items, "--nproc", "1", "--steps", "2", "--warmup", "0", "--out", tmp_path / "bench",
            check=True, timeout=180)
    assert (tmp_path / "bench" / "bench.md").is_file()
    phalanx("doctor", *items, "--nproc-per-node", "1", "--run-dir", tmp_path / "doctor", check=True, timeout=120)

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"config": str(REPO / spec.example),
                                     "overrides": dict(i.split("=", 1) for i in items[1:]),
                                     "space": {"train.lr": [1e-3]}, "metric": spec.eval_metrics[0], "trials": 1,
                                     "parallel": 1, "nproc_per_trial": 1, "sampler": "grid"}))
    phalanx("sweep", sweep, "--out", tmp_path / "sw", check=True, timeout=240)
    rows = [json.loads(line) for line in (tmp_path / "sw" / "trials.jsonl").read_text().splitlines()]
    assert [r["state"] for r in rows] == ["COMPLETE"]
