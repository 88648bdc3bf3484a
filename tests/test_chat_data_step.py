"""The chat data step through the real CLI: the data.max_dropped_fraction gate (exit 2 before any worker
starts; the complete store reused when the key is raised; counts by reason in the prepare line and in
summary.json), and family templates (tests/chat_families.py) with `phalanx prepare --show`: Qwen3's
reasoning and enable_thinking (baked into the saved template), Gemma's refused system role."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_families import family_tokenizer
from conftest import REPO, SHAKESPEARE, phalanx

FIXTURES = REPO / "tests" / "fixtures"
TINY = ["task=chat", "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.vocab_size=512",
        "log.progress=off", "dist.threads_per_worker=1", "train.eval_every=0"]


def long_and_short(path: Path) -> None:
    """30 exchanges that fit in 64 tokens and 10 whose reply alone does not (the last one the longest)."""
    lines = [x for x in SHAKESPEARE.read_text().splitlines() if x.strip()]
    rows = [{"messages": [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 1]}]}
            for i in range(0, 60, 2)]
    rows += [{"messages": [{"role": "system", "content": "Speak."}, {"role": "user", "content": lines[i]},
                           {"role": "assistant", "content": " ".join(lines[i:i + 8 + k])}]} for k, i in
             enumerate(range(100, 120, 2))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_dropping_too_much_is_exit_2_before_any_worker_and_raising_the_key_reuses_the_store(tmp_path):
    data, cache = tmp_path / "talk.jsonl", tmp_path / "cache"
    long_and_short(data)
    args = [*TINY, f"data.train={data}", f"data.cache_dir={cache}", "model.block_size=64"]
    proc = phalanx("prepare", *args, "--quiet")
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and "config key 'data.max_dropped_fraction'" in error[0]
    assert "dropped 10 of 40 records of data.train" in error[0] and "25.0% (more than 5.0%)" in error[0]
    assert "too long for model.block_size 10" in error[0] and f"longest: data file '{data}' line 40 (" in error[0]
    assert "raise model.block_size (now 64)" in error[0] and "chat.truncation" not in error[0]  # keep_end already
    assert "records 40; truncated " in proc.stdout and "; dropped 10; dropped_by too_long 10" in proc.stdout
    run = tmp_path / "run"
    proc = phalanx("train", *args, "--run-dir", run)
    assert proc.returncode == 2 and "data.max_dropped_fraction" in proc.stderr and not (run / "logs").exists()
    proc = phalanx("prepare", *args, "data.max_dropped_fraction=0.3", "--quiet", check=True)
    assert "already prepared" in proc.stdout and "dropped_by too_long 10" in proc.stdout  # not prepared again


@pytest.mark.slow
def test_summary_json_counts_what_was_dropped(tmp_path):
    data, run = tmp_path / "talk.jsonl", tmp_path / "run"
    long_and_short(data)
    phalanx("train", *TINY, f"data.train={data}", f"data.cache_dir={tmp_path / 'cache'}", "model.block_size=64",
            "data.max_dropped_fraction=0.3", "train.max_steps=1", "train.global_batch_size=2",
            "train.micro_batch_size=2", "--run-dir", run, check=True, timeout=180)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data_records"] == 40 and summary["data_dropped"] == 10
    assert summary["data_dropped_by"] == {"too_long": 10} and summary["data_truncated"] >= 0


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name in ("qwen3", "gemma"):
        out[name] = tmp_path_factory.mktemp(name)
        family_tokenizer(name).save_pretrained(out[name])
    return out


def show(tmp_path: Path, data: Path, tokenizer: Path, *extra) -> tuple:
    return phalanx("prepare", *TINY, f"data.train={data}", f"data.tokenizer={tokenizer}", "data.val_fraction=0",
                   f"data.cache_dir={tmp_path / 'cache'}", "model.block_size=128", "--quiet", "--show", 2, *extra)


def test_show_qwen3_reasoning_with_enable_thinking_baked_into_the_saved_template(tmp_path, saved):
    from transformers import AutoTokenizer

    thinking_off = "template.kwargs={enable_thinking: false}"
    proc = show(tmp_path, FIXTURES / "chat_qwen3.jsonl", saved["qwen3"], thinking_off)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "records 4; truncated 0; dropped 0" in proc.stdout
    # the first record's reply and its reasoning (rendered: the turn after the last user message) are trained
    assert "[[Two and two make four.\n</think>\n\nFour.<|im_end|>]]" in proc.stdout
    # the earlier turn's reasoning is dropped by the template; the last turn's is trained
    assert "Any colour" not in proc.stdout and "[[Blue.<|im_end|>]]" in proc.stdout
    tok = AutoTokenizer.from_pretrained(next((tmp_path / "cache").glob("tokenizer-*")))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<think>\n\n</think>\n\n")  # what RUN/final and phalanx chat render


def test_show_gemma_folds_the_system_message_and_counts_a_refused_record(tmp_path, saved):
    data = FIXTURES / "chat_gemma.jsonl"
    proc = show(tmp_path, data, saved["gemma"])
    assert proc.returncode == 2 and "refused by the chat template 1" in proc.stderr  # 1 of 3: over 5%
    assert f"e.g. data file '{data}' line 3: the chat template refused this conversation" in proc.stderr
    proc = show(tmp_path, data, saved["gemma"], "data.max_dropped_fraction=0.5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dropped_by template_refused 1" in proc.stdout
    assert "<start_of_turn>user\nSpeak as in a play.\n\nWho comes here?<end_of_turn>" in proc.stdout
    assert "[[A friend, my lord.<end_of_turn>]]" in proc.stdout and "[[d<end_of_turn>]]" in proc.stdout
