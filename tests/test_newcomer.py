"""A newcomer's first hour (issue 13): clear one-line errors before anything starts, failure accounts that
name the rank and its own error, a quiet console, and an end of run that says what to do next."""
from __future__ import annotations

import json

import pytest

from conftest import lm_args, phalanx


def one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "phalanx: task" not in proc.stdout  # no worker started
    return lines[0]


def test_too_little_data_is_exit_2_before_any_worker(tmp_path, cache_dir):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc\n")
    line = one_error_line(phalanx("train", f"data.train={tiny}", f"data.cache_dir={cache_dir}",
                                  "--run-dir", tmp_path / "run", "--nproc-per-node", 2, timeout=60))
    assert f"'{tiny}' gives" in line and "training tokens; one sequence needs model.block_size + 1 = 129" in line
    line = one_error_line(phalanx(*lm_args(tmp_path / "run2", cache_dir, f"data.validation={tiny}"), timeout=60))
    assert f"validation data '{tiny}' gives" in line and "model.block_size + 1 = 33" in line


@pytest.mark.parametrize("flag, value, expected", [
    ("--max-restarts", "-1", "--max-restarts: expected a whole number >= 0, got -1"),
    ("--nproc-per-node", "0", "--nproc-per-node: expected a whole number >= 1, got 0"),
    ("--nnodes", "2:1", "--nnodes: expected 1 <= MIN <= MAX"),
    ("--rdzv-endpoint", "node1:99999", "--rdzv-endpoint: expected HOST, HOST:PORT or [IPv6]:PORT"),
    ("--rdzv-id", "my job", "--rdzv-id: expected letters, digits"),
])
def test_bad_launcher_flags_are_exit_2_and_nothing_is_written_or_moved(flag, value, expected, tmp_path, cache_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "keep.txt").write_text("old")
    for fresh in ([], ["--fresh"]):
        proc = phalanx(*lm_args(run, cache_dir), flag, value, *fresh, timeout=60)
        assert expected in one_error_line(proc)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and [p.name for p in run.iterdir()] == ["keep.txt"]


def test_good_endpoint_forms_pass_the_flag_check():
    from phalanx.tools.launch import check_flags

    for endpoint in ("node001", "node001:29500", "10.0.0.1:29500", "[fe80::1]:29500", "[::1]"):
        check_flags(2, "2", endpoint, "job-7.a_b", 3)


def test_a_failed_worker_is_named_with_its_own_error_and_the_console_stays_quiet(tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = phalanx(*lm_args(run, cache_dir, "train.max_steps=4", "debug.fault=raise:rank=1:step=2"),
                   "--nproc-per-node", 2, timeout=120)
    assert proc.returncode == 1
    account = [line for line in proc.stderr.splitlines() if line.startswith("phalanx: ")]
    assert account[-1].startswith("phalanx: training failed: rank 1 (pid ")
    assert account[-1].endswith("exited with code 1: RuntimeError: injected failure (debug.fault) at step 2")
    assert f"all workers' output in {run / 'logs'}" in proc.stderr
    assert "Traceback" not in proc.stderr and "=====" not in proc.stderr  # tracebacks are in RUN/logs
    assert json.loads((run / "errors" / "rank1.json").read_text())["error"].startswith("RuntimeError: injected")
    logged = "".join(p.read_text() for p in (run / "logs").rglob("*.log"))
    assert "Traceback" in logged and "injected failure" in logged


def test_the_end_of_a_run_says_what_to_do_next(tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = phalanx(*lm_args(run, cache_dir, "train.max_steps=2"), check=True, timeout=120)
    assert "final eval/loss" in proc.stdout and f"next: phalanx report {run}" in proc.stdout
    assert f'phalanx generate {run} --prompt' in proc.stdout
    out = phalanx("generate", run, "--prompt", "ROMEO:", "--max-new-tokens", "5", check=True)
    assert out.stdout.startswith("ROMEO:") and "Loading" not in out.stdout and "%|" not in out.stdout


# ---- the README's chat path, every command on its own defaults (issue 25) ---------------------------------
# Only what makes it fast is overridden (model size, steps); every setting the crash depended on stays the
# default: the base's 128 positions (model.block_size) and phalanx chat's --max-new-tokens 256.
QUICK = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "train.max_steps=2", "train.warmup_steps=1",
         "train.eval_every=0", "train.eval_max_samples=8", "log.progress=off"]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, cache_dir):
    """`phalanx train` (the built-in default), then `phalanx train examples/chat.yaml model.pretrained=...`."""
    root = tmp_path_factory.mktemp("readme-chat")
    base, run = root / "default", root / "chat"
    phalanx("train", f"data.cache_dir={cache_dir}", "--run-dir", base, *QUICK, check=True, timeout=240)
    phalanx("train", "examples/chat.yaml", f"model.pretrained={base / 'final'}", f"data.cache_dir={cache_dir}",
            "--run-dir", run, *QUICK, check=True, timeout=240)
    return run


def _chat(run, *args, stdin: str | None = None):
    return phalanx("chat", run, *args, input=stdin, timeout=180)


def test_phalanx_chat_on_its_defaults_answers_and_says_the_reply_limit_once(chat_run):
    proc = _chat(chat_run, "--message", "What does os.path.join do?")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("replies are limited to what the context leaves (128 positions") == 1
    # interactive, stdin piped: three turns, a reset, and the end of input; the limit is said once
    proc = _chat(chat_run, stdin="Hello\nWhat is a tuple?\n/reset\nAnd a list?\n")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.count("assistant> ") == 3 and proc.stdout.count("you> ") == 5
    assert proc.stderr.count("replies are limited") == 1


def test_phalanx_chat_drops_the_oldest_turns_and_refuses_only_a_message_that_cannot_fit(chat_run):
    from phalanx.tools.chat import Chat

    chat = Chat(chat_run / "final")
    for text in ["one two three four five six seven eight nine ten"] * 6:  # fills 128 positions in a few turns
        ids, budget = chat.ask(text, 256)
        assert budget >= 64 and ids.shape[1] + budget == 128  # at least half the context is kept for the reply
        chat.history.append({"role": "assistant", "content": "eleven twelve thirteen fourteen"})
    assert chat.history[0]["content"] != "" and len(chat.history) < 12  # the oldest exchanges went
    assert any("oldest turns are dropped" in n for n in chat.take_notes())
    long = " ".join(["word"] * 400)
    proc = _chat(chat_run, "--message", long)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "128 positions" in lines[0], proc.stderr[-2000:]
    proc = _chat(chat_run, stdin=f"{long}\nHello\n")  # interactive: said, and the session goes on
    assert proc.returncode == 0 and "128 positions" in proc.stderr and proc.stdout.count("assistant> ") == 1


def test_phalanx_generate_keeps_half_the_context_for_the_sample(chat_run):
    base = chat_run.parent / "default"
    proc = phalanx("generate", base, "--prompt", " ".join(["word"] * 300), "--max-new-tokens", "300", timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "limited to 64 new tokens (the model has 128 positions)" in proc.stderr


def test_phalanx_chat_folds_a_system_message_the_template_refuses(tmp_path):
    """--system under a Gemma-style template (no system role) is folded into the first user turn, as
    training folded it (template.system_message auto); a template that takes a system role keeps it."""
    import torch
    from chat_families import family_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from phalanx.tools.chat import Chat

    for family, folded in (("gemma", True), ("chatml", False)):
        tok, final = family_tokenizer(family), tmp_path / family
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                     eos_token_id=tok.eos_token_id)).save_pretrained(final)
        tok.save_pretrained(final)
        chat = Chat(final, system="Speak as in a play.")
        ids, budget = chat.ask("Who comes here?", 8)
        text = tok.decode(ids[0])
        assert budget == 8 and "Speak as in a play." in text
        assert ("Speak as in a play.\n\nWho comes here?" in text) == folded, text
        assert chat.answer(ids, budget) is not None  # generation runs on the folded prompt
