"""Config loading, overrides, and bad input: exit code 2 with a message naming the problem, no worker."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, SHAKESPEARE, phalanx

from phalanx.core.config import ConfigError, check_world, load_config


def test_overrides_and_types():
    cfg = load_config(None, ["train.lr=3e-4", "model.n_layer=6", "classify.labels=[a,b]", "train.compile=true"])
    assert cfg.train.lr == 3e-4 and cfg.model.n_layer == 6 and cfg.classify.labels == ["a", "b"]
    assert cfg.train.compile is True and cfg.run_dir == "runs/default"


def test_accumulation_is_derived_and_checked():
    cfg = load_config(None, ["train.global_batch_size=48", "train.micro_batch_size=8"])
    assert check_world(cfg, 1) == 6 and check_world(cfg, 2) == 3 and check_world(cfg, 3) == 2
    with pytest.raises(ConfigError, match="global_batch_size.*not divisible.*world size \\(4\\)"):
        check_world(cfg, 4)


SWEEPS = sorted((REPO / "examples").glob("sweep*.yaml"))


@pytest.mark.parametrize("example", sorted(set((REPO / "examples").glob("*.yaml")) - set(SWEEPS)), ids=lambda p: p.name)
def test_every_example_config_loads(example):
    cfg = load_config(str(example), [f"data.train={SHAKESPEARE}"], check_paths=False)
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0


def _write(tmp_path: Path, name: str, content: bytes | str) -> Path:
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


BINARY = b"hello \xff\xfe world"
BAD = [
    # (args builder, expected fragment of the one-line message)
    (lambda t: ["train.lr=abc"], "train.lr"),
    (lambda t: ["train.bogus=1"], "unknown config key 'train.bogus'"),
    (lambda t: ["train.max_steps=0"], "train.max_steps': must be >= 1"),
    (lambda t: ["train.global_batch_size=30", "train.micro_batch_size=8"], "not a multiple"),
    (lambda t: ["train.global_batch_size=24", "train.micro_batch_size=8", "--nproc-per-node", "2"],
     "not divisible by micro_batch_size (8) x world size (2)"),
    (lambda t: ["data.train=/nonexistent/file.txt"], "data.train': file or folder '/nonexistent/file.txt' not found"),
    (lambda t: ["model.n_embd=100", "model.n_head=3"], "model.n_embd"),
    (lambda t: ["train.precision=fp8"], "train.precision': expected one of"),
    (lambda t: ["model.arch=bert"], "task 'lm' needs gpt2 or llama"),
    (lambda t: [str(_write(t, "bad.yaml", "train: [1, 2"))], "not valid YAML"),
    (lambda t: [str(_write(t, "bad2.yaml", "train:\n  lr: {a: 1}\n"))], "train.lr': expected float"),
    (lambda t: ["/nonexistent/config.yaml"], "config file '/nonexistent/config.yaml' not found"),
    (lambda t: ["data.train=" + str(_write(t, "bin.txt", BINARY))], "not valid UTF-8"),
    (lambda t: ["data.train=" + str(_write(t, "bad.jsonl", '{"text": "ok"}\n{broken\n'))], "line 2: malformed JSON"),
    (lambda t: ["data.train=" + str(_write(t, "nofield.jsonl", '{"body": "x"}\n'))], "missing field 'text'"),
    (lambda t: ["data.train=" + str(_write(t, "empty.jsonl", ""))], "empty"),
    (lambda t: ["debug.fault=explode:step=1"], "debug.fault"),
    (lambda t: ["--nnodes", "2:1"], "--nnodes"),
]


def _in_process(args, capsys) -> tuple[int, str, str]:
    """`phalanx train ...` through the CLI's own entry point in this process (what `python -m phalanx` runs,
    without a new interpreter's two seconds of imports per case): exit code, stdout, stderr."""
    from phalanx.cli import main

    try:
        code = main(["train", *map(str, args)])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input_exits_2_before_any_worker(case, tmp_path, capsys):
    build, fragment = BAD[case]
    run_dir = tmp_path / "run"
    args = [*build(tmp_path), "--run-dir", run_dir]
    if case == 0:  # one case through a real process: the exit code as a shell sees it
        proc = phalanx("train", *args, timeout=60)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        code, out, err = _in_process(args, capsys)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "phalanx: task" not in out  # no worker started
    assert not (run_dir / "config.yaml").exists()  # nothing half-written


@pytest.mark.parametrize("example", SWEEPS, ids=lambda p: p.name)
def test_every_example_sweep_file_loads(example, tmp_path):
    """Every trial config of the shipped sweeps validates (the own-data template given a real file)."""
    from phalanx.tools.sweepspec import load_sweep

    text = example.read_text().replace("PATH/TO/corpus.txt", str(SHAKESPEARE))
    text = text.replace("config: examples/", f"config: {REPO / 'examples'}/")
    copy = tmp_path / example.name
    copy.write_text(text)
    sweep = load_sweep(copy)
    assert sweep.trials >= 4 and sweep.space and sweep.metric == "eval/loss"


# ---- keys renamed in 0.2 (core/renames.py) -------------------------------------------------------------
def test_old_keys_still_load_with_one_line_naming_the_new_ones(tmp_path):
    """A 0.1 config (task keys in `data`) and 0.1 overrides load into the task sections; one note names each
    moved key; data.prompt_field / data.system_field go to the section of the config's task."""
    old = tmp_path / "old.yaml"
    old.write_text("task: chat\ndata:\n  chat_format: messages\n  prompt_field: question\n"
                   "  template_kwargs: {enable_thinking: false}\n  system_message: fold\n")
    said = []
    cfg = load_config(str(old), ["data.max_length=64", "data.train_on=last"], check_paths=False, say=said.append)
    assert (cfg.chat.format, cfg.chat.prompt_field, cfg.chat.train_on) == ("messages", "question", "last")
    assert cfg.template.kwargs == {"enable_thinking": False} and cfg.template.system_message == "fold"
    assert cfg.classify.max_length == 64 and cfg.preference.prompt_field == ""
    assert len(said) == 1 and "until 0.3" in said[0]
    assert "data.chat_format -> chat.format" in said[0] and "data.max_length -> classify.max_length" in said[0]
    pref = load_config(None, ["task=preference", "data.prompt_field=q", "data.pair_format=explicit"],
                       check_paths=False, say=said.append)
    assert (pref.preference.prompt_field, pref.preference.format, pref.chat.prompt_field) == ("q", "explicit", "")
    assert load_config(None, ["chat.format=alpaca"], say=said.append).chat.format == "alpaca" and len(said) == 2
    assert load_config(str(old), ["chat.format=sharegpt"], check_paths=False, say=said.append).chat.format == \
        "sharegpt"  # an override wins over the file, under either name
    old.write_text("task: chat\ndata:\n  chat_format: messages\nchat:\n  format: alpaca\n")
    with pytest.raises(ConfigError, match="'data.chat_format' and 'chat.format' are one key"):
        load_config(str(old), check_paths=False, say=said.append)


def test_a_checkpoint_of_0_1_resumes_without_force_resume(tmp_path):
    """tests/fixtures/ckpt-31751d5 recorded its settings under 0.1's names (data.max_length, data.labels, ...):
    the same settings given with either name compare equal; a changed one does not."""
    import json
    import shutil

    from phalanx.tools.launch import preflight

    ckpt = tmp_path / "ckpt"
    shutil.copytree(REPO / "tests" / "fixtures" / "ckpt-31751d5", ckpt)
    recorded = json.loads((ckpt / "meta.json").read_text())["config"]
    same = [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in recorded.items()] + [f"resume={ckpt}"]
    for names in (same, [s.replace("data.max_length", "classify.max_length") for s in same]):
        preflight(load_config(None, names, check_paths=False, say=print), 1, "1")
    preflight(load_config(None, [*same, "data.max_length=64"], check_paths=False, say=print), 1, "1")  # not lm's
    for change, key in (("train.lr=0.5", "train.lr"), ("data.val_max_tokens=64", "lm.val_max_tokens")):
        with pytest.raises(ConfigError, match=f"different training settings: {key};"):
            preflight(load_config(None, [*same, change], check_paths=False, say=print), 1, "1")


def test_config_show_lists_what_the_task_reads(capsys):
    from phalanx.cli import main

    assert main(["config", "--show", "task=chat"]) == 0
    shown = capsys.readouterr().out
    assert "chat.train_on" in shown and "template.kwargs" in shown and "classify.labels" not in shown \
        and "preference.beta" not in shown and "data.train " in shown
    assert main(["config", "--show"]) == 0
    assert "classify.labels" in capsys.readouterr().out


@pytest.mark.parametrize("override, meaning", [("train.activation_checkpointing=true", "full"),
                                               ("train.activation_checkpointing=false", "none"),
                                               ("log.progress=false", "off"), ("data.order=true", "")])
def test_a_yaml_boolean_for_named_choices_lists_them_and_says_what_it_would_mean(override, meaning):
    """`train.activation_checkpointing=true` said only "expected str, got bool"."""
    key, _, said = override.partition("=")
    with pytest.raises(ConfigError) as e:
        load_config(None, [override], check_paths=False)
    text = str(e.value)
    assert "expected str" not in text and f"got {said}" in text, text
    choices = {"train.activation_checkpointing": "none, full, every_k", "log.progress": "auto, bar, lines, off",
               "data.order": "auto, global, windowed"}[key]
    assert choices in text, text
    assert (f"would mean {meaning}: write {key}={meaning}" if meaning else "none of them") in text, text
