"""task: chat with real `phalanx` processes: N processes == 1 process, LoRA resume, fine-tune then talk,
and bad records refused before any worker starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SHAKESPEARE, paired_params, phalanx, small_gpt2_base, train_losses

from phalanx.core.config import load_config
from phalanx.core.errors import ConfigError
from phalanx.data import prepare
from phalanx.data.chat import store as chat_store

TINY = ["task=chat", "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=96",
        "data.vocab_size=512", "train.log_every=1", "train.eval_every=0", "train.warmup_steps=2", "train.lr=3e-3",
        "train.eval_max_samples=16", "log.progress=lines", "dist.threads_per_worker=1", "dist.backend=gloo"]
MEMORISE = [("What is the capital of France?", "Paris, of course."),
            ("Name a colour.", "Blue like the sea."),
            ("How many legs has a cat?", "Four legs."),
            ("Say hello.", "Hello, friend!")]


@pytest.fixture(scope="module")
def talk(tmp_path_factory) -> Path:
    """~300 conversations of 1-3 exchanges cut from Tiny Shakespeare: lengths (and supervised counts) vary."""
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if line.strip()][:3000]
    path = tmp_path_factory.mktemp("talk") / "talk.jsonl"
    with open(path, "w") as f:
        for i in range(0, 2700, 9):
            turns = 1 + i % 3
            messages = ([{"role": "system", "content": "Speak as in a play."}] if i % 4 == 0 else [])
            for k in range(turns):
                reply = lines[i + 2 * k + 1] + " " * (k % 2) + lines[i + 7][:i % 40]
                messages += [{"role": "user", "content": lines[i + 2 * k]}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small pretrained GPT-2 with a tokenizer that has no chat template (as a pretraining run's final/)."""
    return small_gpt2_base(tmp_path_factory.mktemp("base"), 300_000, 512, positions=128, width=64)


def chat_args(run: Path, data: Path, cache: Path, *extra) -> list:
    return ["train", f"data.train={data}", f"data.cache_dir={cache}", "--run-dir", run, *TINY, *extra]


# ---- N processes == 1 process ---------------------------------------------------------------------
# No dropout: its masks are seeded per micro-batch, so runs with other micro-batch sizes draw other masks.
SHAPE = ["train.global_batch_size=12", "train.max_steps=6"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, talk, cache_dir) -> Path:
    run = tmp_path_factory.mktemp("chat-1")
    phalanx(*chat_args(run, talk, cache_dir, *SHAPE, "train.micro_batch_size=12"), check=True, timeout=240)
    return run


def assert_same(run: Path, ref: Path, rel: float = 1e-5) -> None:
    got, want = train_losses(run), train_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel), f"step {step}"
    # Per tensor, relative to its norm: Adam divides by the root of tiny second moments, so a single weight of
    # a rarely seen token's embedding row can move by ~1e-5 from float summation order alone.
    for name, got, want in paired_params(run, ref):
        err = float((got - want).norm() / want.norm().clamp_min(1e-12))
        assert err < rel and float((got - want).abs().max()) < 1e-4, (name, err)


def test_supervised_counts_differ_across_rows(one_process, talk, cache_dir):
    """What makes the equivalence below meaningful: rows hold different numbers of supervised tokens."""
    cfg = load_config(None, ["task=chat", f"data.train={talk}", f"data.cache_dir={cache_dir}", *TINY[1:]])
    data = prepare.open_prepared(cfg, chat_store.CHAT)
    counts = {sum(int(m[1:].sum()) for _, m in data.train.sequences(i)) for i in range(24)}
    assert len(counts) > 5
    summary = json.loads((one_process / "summary.json").read_text())
    assert 0.5 < summary["data_packing_efficiency"] <= 1.0 and summary["trainable_parameters"] == summary["parameters"]


@pytest.mark.parametrize("nproc, micro", [(1, 6), (2, 3)])
def test_accumulation_and_processes_equal_one_process(one_process, talk, cache_dir, tmp_path, nproc, micro):
    run = tmp_path / "run"
    phalanx(*chat_args(run, talk, cache_dir, *SHAPE, f"train.micro_batch_size={micro}"), "--nproc-per-node", nproc,
            check=True, timeout=240)
    assert_same(run, one_process)


@pytest.mark.slow
def test_three_processes_equal_one_process(one_process, talk, cache_dir, tmp_path):
    run = tmp_path / "run"
    phalanx(*chat_args(run, talk, cache_dir, *SHAPE, "train.micro_batch_size=2"), "--nproc-per-node", 3,
            check=True, timeout=300)
    assert_same(run, one_process)


# ---- LoRA ---------------------------------------------------------------------------------------------
LORA = ["model.lora.r=4", "model.lora.dropout=0.1", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.max_steps=8", "train.checkpoint_every=3"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, talk, base, cache_dir) -> Path:
    run = tmp_path_factory.mktemp("lora")
    phalanx(*chat_args(run, talk, cache_dir, *LORA, f"model.pretrained={base}"), "--nproc-per-node", 2,
            check=True, timeout=240)
    return run


def test_lora_checkpoints_hold_only_what_trains_and_resume_exactly_after_sigkill(lora_run, talk, base, cache_dir,
                                                                                  tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(lora_run / "checkpoints" / "step_000008")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k or "trainable_tokens" in k for k in model_keys), model_keys[:5]
    summary = json.loads((lora_run / "summary.json").read_text())
    assert 0 < summary["trainable_parameters"] < 0.2 * summary["parameters"]  # counted before the merge
    run = tmp_path / "killed"
    proc = phalanx(*chat_args(run, talk, cache_dir, *LORA, f"model.pretrained={base}",
                              "debug.fault=kill:rank=1:step=5"),
                   "--nproc-per-node", 2, "--max-restarts", 1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert train_losses(run) == train_losses(lora_run)  # bitwise: same world size, exact resume


def test_lora_export_is_merged_and_the_adapter_loads_with_peft(lora_run, base):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = lora_run / "final"
    tok = AutoTokenizer.from_pretrained(final)
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    base_model = AutoModelForCausalLM.from_pretrained(base)
    base_model.resize_token_embeddings(len(tok), mean_resizing=False)
    adapted = PeftModel.from_pretrained(base_model, final / "adapter").eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "Good morrow"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        a, b = merged(ids).logits, adapted(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the base stayed what it was: the adapter changes the output
    with torch.no_grad(), adapted.disable_adapter():
        plain = adapted(ids).logits
    assert (plain - a).abs().max() > 1e-4


def test_lora_leaves_the_base_weights_bit_identical(base):
    """In-process: after optimizer steps only adapters (and the new tokens' rows) changed."""
    from transformers import AutoModelForCausalLM

    from phalanx.model.lora import apply_lora
    from phalanx.model.optim import build_optimizer

    cfg = load_config(None, ["model.lora.r=4", f"model.pretrained={base}"])
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(model.get_input_embeddings().weight.shape[0] + 2)
    before = [(name, p, p.detach().clone()) for name, p in model.named_parameters()]  # peft wraps these very tensors
    model = apply_lora(model, cfg.model.lora, [512, 513])
    opt = build_optimizer(model, cfg.train)
    for _ in range(3):
        ids = torch.randint(0, 514, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(not p.requires_grad for _, p, _ in before)
    changed = [name for name, p, copy in before if not torch.equal(p, copy)]
    assert changed == []
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if "lora_B" in n)


@pytest.mark.slow
def test_lora_resumes_on_fewer_processes(lora_run, talk, base, cache_dir, tmp_path):
    run = tmp_path / "two-then-one"
    first = phalanx(*chat_args(run, talk, cache_dir, *LORA, f"model.pretrained={base}",
                               "debug.fault=kill:rank=1:step=5"),
                    "--nproc-per-node", 2, timeout=300)
    assert first.returncode == 1
    phalanx(*chat_args(run, talk, cache_dir, *LORA, f"model.pretrained={base}"), check=True, timeout=300)
    got, want = train_losses(run), train_losses(lora_run)
    for step in range(7, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-5)


# ---- fine-tune, then talk ----------------------------------------------------------------------------
def test_fine_tune_then_chat_gives_the_trained_reply(tmp_path, base, cache_dir):
    data = tmp_path / "four.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in MEMORISE))
    run = tmp_path / "run"
    phalanx(*chat_args(run, data, cache_dir, f"model.pretrained={base}", "data.packing=false", "data.val_fraction=0",
                       "train.global_batch_size=4", "train.micro_batch_size=4", "train.max_steps=120", "train.lr=1e-2",
                       "train.warmup_steps=10", "train.log_every=20", "model.block_size=64"), check=True, timeout=300)
    final = run / "final"
    config = json.loads((final / "generation_config.json").read_text())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(final)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end in config["eos_token_id"]
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    for question, answer in MEMORISE[:2]:
        proc = phalanx("chat", run, "--message", question, "--max-new-tokens", 24, check=True)
        assert proc.stdout.strip() == answer
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        assert new[-1] == end  # it stopped at the end of its turn, well before max_new_tokens
        assert tok.decode(new, skip_special_tokens=True).strip() == answer


# ---- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, record, message", [
    ("messages", {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
     "field 'messages[1].role': unknown role 'bot'"),
    ("sharegpt", {"conversations": [{"from": "human", "value": 1}]}, "field 'conversations[0].value' should be text"),
    ("alpaca", {"instruction": "x", "input": ""}, "missing field 'output'"),
    ("prompt_completion", {"prompt": "x", "completion": ["y"]}, "field 'completion' should be text"),
])
def test_bad_records_name_file_line_and_field(tmp_path, cache_dir, fmt, record, message):
    good = {"messages": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "sharegpt": {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            "alpaca": {"instruction": "q", "output": "a"}, "prompt_completion": {"prompt": "q", "completion": "a"}}[fmt]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good, good, record, good]) + "\n")
    cfg = load_config(None, ["task=chat", f"data.train={path}", f"data.cache_dir={tmp_path / 'c'}", *TINY[1:],
                             f"chat.format={fmt}"])
    escaped = message.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ConfigError, match=f"data file '{path}' line 3: .*" + escaped):
        prepare.prepare(cfg, chat_store.CHAT, workers=1, progress=False, say=lambda s: None)
    assert not list((tmp_path / "c").glob("chat-*/index.json"))  # nothing half-written is taken as done


def test_bad_chat_input_is_exit_2_before_any_worker(tmp_path, talk, base, cache_dir):
    array = tmp_path / "alpaca.json"
    array.write_text(json.dumps([{"instruction": "q", "output": "a"}] * 3))
    proc = phalanx(*chat_args(tmp_path / "r1", array, cache_dir))
    assert proc.returncode == 2 and "one top-level JSON array" in proc.stderr and "JSON Lines" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "r1" / "logs").exists()
    proc = phalanx(*chat_args(tmp_path / "r2", talk, cache_dir, f"model.pretrained={base}", "model.block_size=256"))
    assert proc.returncode == 2 and "model.block_size" in proc.stderr and "128 positions" in proc.stderr


def test_lora_refuses_another_base(tmp_path, talk, base, cache_dir):
    """Adapters only make sense on the base they were trained on: a changed base folder is exit 2 at resume
    (even with --force-resume). (FSDP2 + LoRA: tests/test_lora_fsdp.py.)"""
    import shutil

    own = tmp_path / "base"
    shutil.copytree(base, own)
    run = tmp_path / "run"
    args = chat_args(run, talk, cache_dir, *LORA, f"model.pretrained={own}", "train.max_steps=3")
    phalanx(*args, check=True, timeout=240)
    phalanx(*[a if a != "train.max_steps=3" else "train.max_steps=4" for a in args], "--force-resume", check=True,
            timeout=240)  # the same base: resumes
    (own / "config.json").write_text((own / "config.json").read_text() + "\n")  # another base, same path
    for extra in ([], ["--force-resume"]):
        proc = phalanx(*[a if a != "train.max_steps=3" else "train.max_steps=5" for a in args], *extra)
        assert proc.returncode == 2 and "trained from another base model" in proc.stderr, proc.stderr[-2000:]
