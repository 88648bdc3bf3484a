"""task: preference with real `phalanx` processes: 1 process == accumulation == 2 and 3 processes (per-step
losses and final weights), FSDP with a sharded frozen reference copy == DDP with precomputed references,
SIGKILL + resume bitwise (LoRA, adapters-off reference), resume on another world size."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHAKESPEARE, metrics, phalanx, small_gpt2_base, train_losses
from test_chat import assert_same


TINY = ["task=preference", "model.block_size=64", "train.log_every=1", "train.eval_every=0", "train.warmup_steps=2",
        "train.lr=1e-3", "train.eval_max_samples=16", "log.progress=lines", "dist.threads_per_worker=1",
        "dist.backend=gloo", "preference.sft_weight=0.2", "data.max_dropped_fraction=0.2"]
SHAPE = ["train.global_batch_size=12", "train.max_steps=6"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """200 pairs cut from Tiny Shakespeare, chosen = a line, rejected = its words reversed. Half are long
    (prompts of one or two exchanges, some with a system message, some too long for the block: truncated),
    half short, so a packed row holds one to three pairs."""
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if len(line.split()) > 2][:1200]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    with open(path, "w") as f:
        for i in range(0, 1200, 6):
            prompt = [{"role": "system", "content": "Speak as in a play."}] if i % 4 == 0 else []
            if i % 12 >= 6:  # short
                prompt.append({"role": "user", "content": " ".join(lines[i].split()[:3])})
                reply = " ".join(lines[i + 1].split()[:4])
            else:
                if i % 3 == 0:
                    prompt += [{"role": "user", "content": lines[i + 3]},
                               {"role": "assistant", "content": lines[i + 4]}]
                prompt.append({"role": "user", "content": lines[i] + (" " + lines[i + 5]) * (i % 5 == 0)})
                reply = lines[i + 1] + " " * (i % 2)
            f.write(json.dumps({"prompt": prompt, "chosen": reply, "rejected": " ".join(reply.split()[::-1])}) + "\n")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small pretrained GPT-2 with a tokenizer that has no chat template; no dropout (its masks are seeded
    per micro-batch: other micro-batch sizes draw others)."""
    return small_gpt2_base(tmp_path_factory.mktemp("base"), 200_000, 400, positions=64, width=32, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0)


def pref_args(run: Path, data: Path, cache: Path, base: Path, *extra) -> list:
    return ["train", f"data.train={data}", f"data.cache_dir={cache}", f"model.pretrained={base}", "--run-dir", run,
            *TINY, *extra]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, pairs, base, cache_dir) -> Path:
    run = tmp_path_factory.mktemp("pref-1")
    phalanx(*pref_args(run, pairs, cache_dir, base, *SHAPE, "train.micro_batch_size=12"), check=True, timeout=300)
    return run


def test_pairs_per_row_differ_and_the_metrics_are_logged(one_process):
    """What makes the equivalences meaningful: packed rows hold different numbers of pairs (and chosen
    tokens), some truncated; the reference is precomputed (full fine-tuning); the loss starts at log 2 (policy
    == reference) plus the NLL term, and the preference metrics are in metrics.jsonl and the summary."""
    rows = [m for m in metrics(one_process) if "rewards/margins" in m]
    assert len(rows) == 6 and len({r["pairs"] for r in rows}) > 1
    first = rows[0]
    assert first["rewards/chosen"] == first["rewards/margins"] == 0.0 and first["pair_loss"] == pytest.approx(
        0.6931471805599453, abs=1e-7)
    assert first["loss"] == pytest.approx(first["pair_loss"] + 0.2 * first["nll/chosen"], rel=1e-6)
    summary = json.loads((one_process / "summary.json").read_text())
    assert summary["reference"] == "precomputed" and summary["data_truncated"] > 0
    assert {"eval/rewards/accuracies", "eval/rewards/margins", "eval/loss"} <= set(summary)


def test_report_draws_the_preference_curves_and_the_export_is_a_chat_model(one_process):
    """`phalanx report` adds the task's curves (rewards, accuracies, log-probs, train and eval); RUN/final is
    what task chat exports: plain transformers loads it, its tokenizer holds the chat template, and its
    generation config stops at the end-of-turn token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from phalanx.tools.curves import task_keys
    from phalanx.tools.report import load_run, report_run

    run = load_run(one_process)
    assert {"rewards/margins", "rewards/accuracies", "logps/chosen"} <= set(task_keys(run.train))
    written = report_run(run)
    assert one_process / "report" / "task.png" in written and "eval/rewards/accuracies" in (
        one_process / "report.md").read_text()
    final = one_process / "final"
    tok = AutoTokenizer.from_pretrained(final)
    AutoModelForCausalLM.from_pretrained(final)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.chat_template and end in GenerationConfig.from_pretrained(final).eos_token_id


@pytest.mark.parametrize("nproc, micro", [(1, 6), (2, 3)])
def test_accumulation_and_processes_equal_one_process(one_process, pairs, base, cache_dir, tmp_path, nproc, micro):
    run = tmp_path / "run"
    phalanx(*pref_args(run, pairs, cache_dir, base, *SHAPE, f"train.micro_batch_size={micro}"),
            "--nproc-per-node", nproc, check=True, timeout=300)
    assert_same(run, one_process)


@pytest.mark.slow
def test_three_processes_equal_one_process(one_process, pairs, base, cache_dir, tmp_path):
    run = tmp_path / "run"
    phalanx(*pref_args(run, pairs, cache_dir, base, *SHAPE, "train.micro_batch_size=2"), "--nproc-per-node", 3,
            check=True, timeout=300)
    assert_same(run, one_process)


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["model", "precomputed"])
def test_fsdp_references_equal_one_process(one_process, pairs, base, tmp_path, reference):
    """Under FSDP2 the reference as a frozen second copy sharded like the policy, or precomputed by a pass
    whose forwards are collective (a cache of its own: computed here, not read), gives the steps one process
    with precomputed references gives; an uneven evaluation every 3 steps included (no hang)."""
    run = tmp_path / "run"
    phalanx(*pref_args(run, pairs, tmp_path / "cache", base, *SHAPE, "train.micro_batch_size=3",
                       "train.strategy=fsdp", f"preference.reference={reference}", "train.eval_every=3"),
            "--nproc-per-node", 2, check=True, timeout=300)
    assert json.loads((run / "summary.json").read_text())["reference"] == reference
    assert any((tmp_path / "cache").glob("pref-*/reference-*/key.json")) == (reference == "precomputed")
    got, want = train_losses(run), train_losses(one_process)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


LORA = ["model.lora.r=4", "train.global_batch_size=8", "train.micro_batch_size=2", "train.max_steps=8",
        "train.checkpoint_every=3", "train.eval_every=4"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, pairs, base, cache_dir) -> Path:
    run = tmp_path_factory.mktemp("pref-lora")
    phalanx(*pref_args(run, pairs, cache_dir, base, *LORA), "--nproc-per-node", 2, check=True, timeout=300)
    return run


@pytest.mark.slow  # ~75 s: LoRA's bitwise resume after SIGKILL is also tested by chat (test_chat.py) and under FSDP
def test_lora_resumes_bitwise_after_sigkill(lora_run, pairs, base, cache_dir, tmp_path):
    summary = json.loads((lora_run / "summary.json").read_text())
    assert summary["reference"] == "adapters_off" and 0 < summary["trainable_parameters"] < summary["parameters"]
    run = tmp_path / "killed"
    proc = phalanx(*pref_args(run, pairs, cache_dir, base, *LORA, "debug.fault=kill:rank=1:step=5"),
                   "--nproc-per-node", 2, "--max-restarts", 1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert train_losses(run) == train_losses(lora_run)  # bitwise: same world size, exact resume
    evals = [m for m in metrics(run) if "eval/rewards/margins" in m]
    assert [m["eval/rewards/margins"] for m in evals] == [m["eval/rewards/margins"] for m in metrics(lora_run)
                                                          if "eval/rewards/margins" in m]


@pytest.mark.slow
def test_lora_under_fsdp_takes_the_ddp_steps(lora_run, pairs, base, cache_dir, tmp_path):
    """The adapters-off reference on a policy sharded by FSDP2 (the same sharded model, one more collective
    forward per micro-batch) gives DDP's steps."""
    run = tmp_path / "fsdp"
    phalanx(*pref_args(run, pairs, cache_dir, base, *LORA, "train.strategy=fsdp"), "--nproc-per-node", 2,
            check=True, timeout=300)
    got, want = train_losses(run), train_losses(lora_run)
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.slow
def test_lora_resumes_on_another_world_size(lora_run, pairs, base, cache_dir, tmp_path):
    """Killed at 2 processes (last checkpoint at step 3), resumed at 4: the same trajectory (DCP reshards the
    adapters and AdamW state; the sample order is a function of the global position)."""
    run = tmp_path / "two-then-four"
    first = phalanx(*pref_args(run, pairs, cache_dir, base, *LORA, "debug.fault=kill:rank=1:step=5"),
                    "--nproc-per-node", 2, timeout=300)
    assert first.returncode == 1
    phalanx(*pref_args(run, pairs, cache_dir, base, *LORA), "--nproc-per-node", 4, check=True, timeout=300)
    got, want = train_losses(run), train_losses(lora_run)
    for step in range(4, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.slow
def test_the_chat_path_sft_then_preference_then_chat(pairs, base, cache_dir, tmp_path):
    """The README's path on small settings: chat SFT from a base, preference tuning (LoRA: adapters-off
    reference) from the chat run's final/ (its template is used as is: no token grown), then `phalanx chat`."""
    talk = tmp_path / "talk.jsonl"
    with open(pairs) as f:
        talk.write_text("".join(json.dumps({"messages": [*p["prompt"], {"role": "assistant", "content": p["chosen"]}]})
                                + "\n" for p in map(json.loads, f)))
    small = ["train.max_steps=3", "train.global_batch_size=4", "train.micro_batch_size=2", "train.log_every=1",
             "train.eval_every=0", "train.eval_max_samples=8", "log.progress=off", "dist.threads_per_worker=1"]
    sft = tmp_path / "chat"
    phalanx("train", "task=chat", f"data.train={talk}", f"data.cache_dir={cache_dir}", f"model.pretrained={base}",
            "model.block_size=64", "--run-dir", sft, *small, check=True, timeout=300)
    dpo = tmp_path / "dpo"
    proc = phalanx(*pref_args(dpo, pairs, cache_dir, sft / "final", *small, "model.lora.r=4"), check=True, timeout=300)
    assert "task preference" in proc.stdout and "grown" not in proc.stdout
    assert json.loads((dpo / "summary.json").read_text())["reference"] == "adapters_off"
    assert (dpo / "final" / "adapter" / "adapter_config.json").is_file()
    reply = phalanx("chat", dpo, "--message", "Good morrow", "--max-new-tokens", "4", check=True, timeout=120)
    assert reply.returncode == 0
