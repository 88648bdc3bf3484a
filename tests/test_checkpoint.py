"""Checkpoints (run/checkpoint.py, run/stateful.py, the dict train.py builds) and the final export
(run/export.py), in process on a real one-process Gloo group, on tiny models.

The checkpoint is one dict of objects with state_dict()/load_state_dict(); these tests hold that every
entry round-trips, that leaving one out shows (a negative control per entry), that the files on disk keep
the layout older phalanx versions wrote (tests/fixtures/ckpt-31751d5), and that loading is safe.
"""
from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import REPO
from phalanx.core.config import Config, ModelConfig, TrainConfig
from phalanx.core.runfolder import RunFolder
from phalanx.model.build import build_causal_lm
from phalanx.model.optim import WarmupCosine, build_optimizer
from phalanx.run.checkpoint import (
    CheckpointDict,
    Checkpointer,
    CheckpointError,
    check_safe,
    complete_in,
    latest_in,
    read_meta,
    resolve_resume,
)
from phalanx.run.export import export_final
from phalanx.run.state import TrainState
from phalanx.run.stateful import ModelState, OptimizerState, rng_state, set_rng_state
from phalanx.run.train import Trainee, checkpoint_dict
from phalanx.tasks.base import TaskBase

VOCAB, BLOCK, EMBD = 64, 16, 32
FIXTURE = REPO / "tests" / "fixtures" / "ckpt-31751d5"


def tiny(arch: str = "gpt2", n_layer: int = 1) -> ModelConfig:
    return ModelConfig(arch=arch, n_layer=n_layer, n_head=2, n_embd=EMBD, block_size=BLOCK)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(seed))


def _step(model, opt, seed: int) -> None:
    x = _batch(seed)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _trained(seed: int = 0, lr_step: int = 3):
    torch.manual_seed(seed)
    t = TrainConfig(lr=1e-2, warmup_steps=5, max_steps=20, weight_decay=0.1)
    model = build_causal_lm(tiny("gpt2"), VOCAB, 0)
    opt = build_optimizer(model, t)
    sched = WarmupCosine(t)
    sched.apply(opt, lr_step)
    _step(model, opt, seed=100)
    return model, opt, sched, t


def _fresh(t: TrainConfig, seed: int = 99):
    torch.manual_seed(seed)
    model = build_causal_lm(tiny("gpt2"), VOCAB, 0)
    return model, build_optimizer(model, t)


def _trainee(model, opt, sched, scaler=None) -> Trainee:
    return Trainee(model=model, wrapped=model, forward=model, optimizer=opt, schedule=sched,
                   scaler=scaler or torch.amp.GradScaler("cpu", enabled=False), autocast=None, amp_dtype=None)


def _dict(model, opt, sched=None, state=None) -> CheckpointDict:
    """The dict the loop checkpoints (train.checkpoint_dict), over these objects."""
    return checkpoint_dict(_trainee(model, opt, sched or WarmupCosine(TrainConfig())), state or TrainState())


def _norm_group(g: dict) -> dict:
    return {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in g.items() if k != "params"}


def _assert_same(model_a, opt_a, model_b, opt_b) -> None:
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    oa, ob = opt_a.state_dict(), opt_b.state_dict()
    assert oa["state"].keys() == ob["state"].keys() and len(oa["state"]) == len(list(model_a.parameters()))
    for i, st in oa["state"].items():
        assert st.keys() == ob["state"][i].keys()
        for name, v in st.items():
            w = ob["state"][i][name]
            assert torch.is_tensor(w) and v.dtype == w.dtype and torch.equal(v, w), (i, name)
    assert [_norm_group(g) for g in oa["param_groups"]] == [_norm_group(g) for g in ob["param_groups"]]
    assert [g["params"] for g in oa["param_groups"]] == [g["params"] for g in ob["param_groups"]]


def test_save_then_load_is_bitwise_exact(pg, tmp_path):
    model, opt, sched, t = _trained()
    ckpt = Checkpointer(tmp_path, pg, keep=2)
    path, seconds = ckpt.save(1, _dict(model, opt, sched, TrainState(step=1)))
    assert path == tmp_path / "checkpoints" / "step_000001" and seconds >= 0
    assert (path / ".metadata").is_file() and (path / "rank_state" / "rank0.json").is_file()

    model2, opt2 = _fresh(t)
    assert not torch.equal(model2.transformer.wte.weight, model.transformer.wte.weight)
    assert opt2.param_groups[0]["lr"] != opt.param_groups[0]["lr"]
    sched2, state2 = WarmupCosine(t), TrainState()
    meta = ckpt.load(path, _dict(model2, opt2, sched2, state2))
    assert meta["step"] == 1 and meta["world_size"] == 1 and meta["schedule"] == {"step": 3}
    assert meta["train_state"]["step"] == 1 and meta == read_meta(path)
    assert sched2.step == 3 and state2.step == 1
    _assert_same(model, opt, model2, opt2)
    # and the two continue identically
    _step(model, opt, seed=7)
    _step(model2, opt2, seed=7)
    _assert_same(model, opt, model2, opt2)


def test_latest_and_keep_checkpoints_prunes(pg, tmp_path):
    model, opt, _, _ = _trained()
    ckpt = Checkpointer(tmp_path, pg, keep=2)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        ckpt.save(step, _dict(model, opt))
        assert latest_in(root) == root / f"step_{step:06d}"
        assert json.loads((root / "latest").read_text()) == {"name": f"step_{step:06d}"}
    assert ckpt.complete() == complete_in(root) == [root / "step_000002", root / "step_000003"]
    assert not (root / "step_000001").exists()
    Checkpointer(tmp_path, pg, keep=1).save(4, _dict(model, opt))
    assert complete_in(root) == [root / "step_000004"]


def test_torn_save_never_hides_the_last_good_checkpoint(pg, tmp_path):
    model, opt, _, _ = _trained()
    ckpt = Checkpointer(tmp_path, pg, keep=2)
    root = tmp_path / "checkpoints"
    ckpt.save(1, _dict(model, opt))

    def die():
        raise RuntimeError("killed while writing")

    with pytest.raises(RuntimeError, match="killed while writing"):
        ckpt.save(2, _dict(model, opt), after_write=die)  # the hook that runs after this rank's shards are written
    assert (root / ".tmp-step_000002").is_dir() and not (root / "step_000002").exists()
    assert latest_in(root) == root / "step_000001"
    ckpt.save(3, _dict(model, opt))
    assert not (root / ".tmp-step_000002").exists()  # stale temporary folders are cleaned up
    assert latest_in(root) == root / "step_000003"


def _fake_ckpt(root: Path, name: str, complete: bool = True) -> Path:
    p = root / name
    p.mkdir(parents=True)
    if complete:
        (p / "meta.json").write_text(json.dumps({"step": 0}))
    return p


def test_latest_in_ignores_temporary_and_incomplete_folders(tmp_path):
    root = tmp_path / "checkpoints"
    assert latest_in(root) is None and complete_in(root) == []
    one, two = _fake_ckpt(root, "step_000001"), _fake_ckpt(root, "step_000002")
    _fake_ckpt(root, ".tmp-step_000003")                  # torn write: even with its meta.json
    _fake_ckpt(root, "step_000004", complete=False)       # no meta.json yet
    assert complete_in(root) == [one, two]
    assert latest_in(root) == two                         # no `latest` file: newest complete
    (root / "latest").write_text(json.dumps({"name": "step_000004"}))
    assert latest_in(root) == two                         # `latest` names an incomplete one
    (root / "latest").write_text("{not json")
    assert latest_in(root) == two                         # unreadable `latest`
    (root / "latest").write_text(json.dumps({"name": "step_000001"}))
    assert latest_in(root) == one                         # a complete named one wins (as documented)


def test_latest_in_orders_steps_numerically_past_a_million(tmp_path):
    root = tmp_path / "checkpoints"
    _fake_ckpt(root, "step_999999")
    newest = _fake_ckpt(root, "step_1000000")
    assert latest_in(root) == newest
    assert complete_in(root)[-1] == newest


def test_pruning_past_a_million_steps_keeps_the_newest(pg, tmp_path):
    model, opt, _, _ = _trained()
    ckpt = Checkpointer(tmp_path, pg, keep=2)
    for step in (999_998, 999_999, 1_000_000):
        ckpt.save(step, _dict(model, opt))
    root = tmp_path / "checkpoints"
    assert (root / "step_1000000").is_dir()
    assert latest_in(root) == root / "step_1000000"


def test_read_meta(tmp_path):
    with pytest.raises(CheckpointError, match="no readable meta.json"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{torn")
    with pytest.raises(CheckpointError, match="no readable meta.json"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"step": 5, "config": {"a": 1}}))
    assert read_meta(tmp_path) == {"step": 5, "config": {"a": 1}}


class _Evil:
    marker: Path

    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def _evil_ckpt(tmp_path: Path) -> Path:
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    _Evil.marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Evil()))
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "config": {}}))
    return ckpt


def test_check_safe_refuses_a_malicious_pickle_without_running_it(tmp_path):
    ckpt = _evil_ckpt(tmp_path)
    with pytest.raises(CheckpointError, match="refusing to load") as e:
        check_safe(ckpt)
    assert "posix.system" in str(e.value) and str(ckpt) in str(e.value)
    assert not _Evil.marker.exists()


def test_load_checks_safety_before_dcp_reads_anything(pg, tmp_path):
    ckpt = _evil_ckpt(tmp_path)
    model, opt = _fresh(TrainConfig())
    with pytest.raises(CheckpointError, match="refusing to load"):
        Checkpointer(tmp_path / "run", pg).load(ckpt, _dict(model, opt))
    assert not _Evil.marker.exists()


def test_check_safe_other_refusals_and_a_real_checkpoint(pg, tmp_path):
    with pytest.raises(CheckpointError, match="no DCP .metadata"):
        check_safe(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="unreadable metadata"):
        check_safe(tmp_path)
    # a DCP checkpoint holding a pickled (non-tensor) object
    import torch.distributed.checkpoint as dcp
    objs = tmp_path / "objects"
    dcp.save({"w": torch.ones(3), "obj": "not a tensor"}, checkpoint_id=str(objs))
    with pytest.raises(CheckpointError, match="'obj' is a pickled object"):
        check_safe(objs)
    # what Checkpointer writes passes
    model, opt, _, _ = _trained()
    path, _ = Checkpointer(tmp_path / "run", pg).save(2, _dict(model, opt))
    check_safe(path)


def test_check_safe_refuses_dotted_names_reaching_outside_checkpoint_metadata(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "evil"
    ckpt.mkdir()

    def short(s: bytes) -> bytes:  # SHORT_BINUNICODE
        return b"\x8c" + bytes([len(s)]) + s
    # PROTO 4; STACK_GLOBAL(dcp.filesystem, "os.mkdir"); (marker,); REDUCE; STOP: harmless, but code runs
    payload = (b"\x80\x04" + short(b"torch.distributed.checkpoint.filesystem") + short(b"os.mkdir") + b"\x93"
               + short(str(marker).encode()) + b"\x85" + b"R" + b".")
    (ckpt / ".metadata").write_bytes(payload)
    try:
        with pytest.raises(CheckpointError, match="refusing to load"):
            check_safe(ckpt)
    finally:
        ran = marker.exists()
    assert not ran, "the checkpoint's metadata ran os.mkdir"


def test_rng_state_round_trip_restores_every_stream():
    state = json.loads(json.dumps(rng_state()))  # stored as JSON per rank
    first = (torch.rand(8), torch.randn(3), random.random(), random.gauss(0, 1), np.random.rand(4))
    torch.manual_seed(12345)
    random.seed(1)
    np.random.seed(2)
    set_rng_state(state)
    again = (torch.rand(8), torch.randn(3), random.random(), random.gauss(0, 1), np.random.rand(4))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert first[2] == again[2] and first[3] == again[3]
    assert np.array_equal(first[4], again[4])


# ---- the checkpoint dict: every entry round-trips; one left out shows ------------------------------
def _mid_run() -> tuple[Trainee, TrainState]:
    """A run part-way through: every entry of the checkpoint dict away from its fresh value."""
    model, opt, sched, _ = _trained(lr_step=5)
    scaler = torch.amp.GradScaler("cpu", enabled=True)  # fp16's dynamic loss scaler
    scaler.load_state_dict({"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100,
                            "_growth_tracker": 7})
    state = TrainState(step=5, samples_seen=40, tokens_seen=640, nan_skips=1, consecutive_nan=1, fp16_overflows=2,
                       train_time_s=1.5, data_order=2)
    return _trainee(model, opt, sched, scaler), state


def _fresh_run() -> tuple[Trainee, TrainState]:
    """What a restarted worker builds: another init, and (as after --force-resume) other optimizer
    hyper-parameters, which the checkpoint's override."""
    t = TrainConfig(lr=1e-2, warmup_steps=5, max_steps=20, weight_decay=0.0, beta1=0.5)
    model, opt = _fresh(t)
    return _trainee(model, opt, WarmupCosine(t), torch.amp.GradScaler("cpu", enabled=True)), TrainState()


def _snapshot(tr: Trainee, state: TrainState) -> dict:
    """What a resumed run depends on, one key per checkpoint entry. Draws from the random streams last."""
    names = {id(p): n for n, p in tr.model.named_parameters()}
    return {
        "model": {k: v.clone() for k, v in tr.model.state_dict().items()},
        "optim": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in tr.optimizer.state.items()},
        "param_groups": [_norm_group(g) for g in tr.optimizer.param_groups],
        "schedule": tr.schedule.state_dict(), "train_state": state.state_dict(), "scaler": tr.scaler.state_dict(),
        "rng": (torch.rand(4), random.random(), float(np.random.rand()))}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _save_and_resume(pg, tmp_path, leave_out: str | None = None) -> tuple[dict, dict]:
    def without(d: CheckpointDict) -> CheckpointDict:
        return CheckpointDict(*({k: v for k, v in part.items() if k != leave_out}
                                for part in (d.sharded, d.shared, d.per_rank)))

    tr, state = _mid_run()
    ckpt = Checkpointer(tmp_path, pg)
    path, _ = ckpt.save(state.step, without(checkpoint_dict(tr, state)))
    before = _snapshot(tr, state)
    tr2, state2 = _fresh_run()
    torch.manual_seed(4321), random.seed(4321), np.random.seed(4321)
    ckpt.load(path, without(checkpoint_dict(tr2, state2)))
    return before, _snapshot(tr2, state2)


def test_the_checkpoint_dict_round_trips_every_entry_and_the_runs_continue_alike(pg, tmp_path):
    tr, _ = _mid_run()
    saved = checkpoint_dict(tr, TrainState())
    entries = {**saved.sharded, **saved.shared, **saved.per_rank}
    assert set(entries) == {"model", "optim", "param_groups", "train_state", "schedule", "scaler", "rng"}
    before, after = _save_and_resume(pg, tmp_path)
    assert set(before) == set(entries)  # the snapshot covers every entry (the control below relies on it)
    for name in before:
        assert _same(before[name], after[name]), name


@pytest.mark.parametrize("entry", ["model", "optim", "param_groups", "train_state", "schedule", "scaler", "rng"])
def test_an_entry_left_out_of_the_checkpoint_dict_is_not_resumed(pg, tmp_path, entry):
    """Negative control: the round trip above holds because of the dict, entry by entry."""
    before, after = _save_and_resume(pg, tmp_path, leave_out=entry)
    assert not _same(before[entry], after[entry])


def test_a_resumed_run_continues_bitwise_like_the_uninterrupted_one(pg, tmp_path):
    tr, state = _mid_run()
    ckpt = Checkpointer(tmp_path, pg)
    path, _ = ckpt.save(state.step, checkpoint_dict(tr, state))
    tr2, state2 = _fresh_run()
    ckpt.load(path, checkpoint_dict(tr2, state2))
    for run in (tr, tr2):
        run.schedule.apply(run.optimizer, 6)
        _step(run.model, run.optimizer, seed=7)
    _assert_same(tr.model, tr.optimizer, tr2.model, tr2.optimizer)


def test_what_is_written_has_the_layout_of_the_31751d5_checkpoint(pg, tmp_path):
    """Same DCP keys, meta.json keys and per-rank keys as tests/fixtures/ckpt-31751d5 (same model shape),
    so checkpoints stay readable both ways."""
    torch.manual_seed(0)
    t = TrainConfig(lr=1e-3, warmup_steps=1, max_steps=4)
    model = build_causal_lm(ModelConfig(arch="gpt2", n_layer=1, n_head=2, n_embd=32, block_size=32), 256, 0)
    opt = build_optimizer(model, t)
    _step(model, opt, seed=1)
    path, _ = Checkpointer(tmp_path, pg).save(4, _dict(model, opt, WarmupCosine(t), TrainState(step=4)),
                                              {"config_hash": "0", "config": {}})

    def dcp_keys(p: Path) -> set[str]:
        return set(dcp.FileSystemReader(str(p)).read_metadata().state_dict_metadata)

    assert dcp_keys(path) == dcp_keys(FIXTURE) and any(k.startswith("optim.") for k in dcp_keys(path))
    assert set(read_meta(path)) == set(read_meta(FIXTURE))
    mine, theirs = (json.loads((p / "rank_state" / "rank0.json").read_text()) for p in (path, FIXTURE))
    assert set(mine) == set(theirs) == {"rng"} and set(mine["rng"]) == set(theirs["rng"])


def test_a_trainable_only_model_entry_holds_and_restores_just_what_trains(pg, tmp_path):
    """Issue 17's LoRA checkpoints hold what changes: restricted to trainable parameters, the model entry
    writes nothing frozen and leaves frozen parameters as the new run built them."""
    def build(seed: int):
        torch.manual_seed(seed)
        model = build_causal_lm(tiny("gpt2"), VOCAB, 0)
        for name, p in model.named_parameters():
            p.requires_grad_(".mlp." in name)  # stand-in for adapters
        return model, build_optimizer(model, TrainConfig(lr=1e-2))

    def entries(model, opt) -> CheckpointDict:
        return CheckpointDict(sharded={"model": ModelState(model, trainable_only=True),
                                       "optim": OptimizerState(model, opt)})

    model, opt = build(0)
    _step(model, opt, seed=1)
    path, _ = Checkpointer(tmp_path, pg).save(1, entries(model, opt))
    written = {k for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata if k.startswith("model.")}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert written == {f"model.{n}" for n in trainable} and trainable
    model2, opt2 = build(1)
    frozen = {n: p.detach().clone() for n, p in model2.named_parameters() if not p.requires_grad}
    Checkpointer(tmp_path, pg).load(path, entries(model2, opt2))
    reference = dict(model.named_parameters())
    for n, p in model2.named_parameters():
        assert torch.equal(p, reference[n] if n in trainable else frozen[n]), n
    assert not torch.equal(model2.transformer.wte.weight, model.transformer.wte.weight)


def test_resolve_resume_is_the_one_rule(pg, tmp_path):
    run = tmp_path / "run"

    def cfg(resume: str) -> Config:
        return Config(run_dir=str(run), resume=resume)

    assert resolve_resume(cfg("never")) is None and resolve_resume(cfg("auto")) is None
    model, opt, _, _ = _trained()
    ckpt = Checkpointer(run, pg)
    for step in (2, 4):
        ckpt.save(step, _dict(model, opt))
    assert resolve_resume(cfg("auto")) == run / "checkpoints" / "step_000004"
    assert resolve_resume(cfg("never")) is None
    assert resolve_resume(cfg(str(tmp_path / "elsewhere"))) == tmp_path / "elsewhere"


# ---- the final export -----------------------------------------------------------------------------
class _Tokenizer:
    def save_pretrained(self, out) -> None:
        (Path(out) / "tokenizer.json").write_text("{}")


class _Task(TaskBase):
    """The default export hook (TaskBase's)."""

    def __init__(self):
        self.tokenizer = _Tokenizer()


class _AdapterTask(_Task):
    """A hook that wraps the writer, as chat with LoRA will (merged model, then out/adapter)."""

    def export(self, model, out, write) -> None:
        write(model, self.tokenizer, out)
        (Path(out) / "adapter").mkdir()
        (Path(out) / "adapter" / "adapter_config.json").write_text("{}")


class _BrokenTask(_Task):
    def export(self, model, out, write) -> None:
        (Path(out) / "half.txt").write_text("")
        raise RuntimeError("export failed")


def test_export_final_runs_the_task_hook_and_publishes_a_whole_folder(pg, tmp_path):
    from transformers import AutoModelForCausalLM

    model, _, _, _ = _trained()
    folder = RunFolder(tmp_path / "run")
    folder.final.mkdir(parents=True)
    (folder.final / "stale.txt").write_text("an older export")
    export_final(model, _Task(), folder, pg)
    assert not folder.final_tmp.exists() and not (folder.final / "stale.txt").exists()
    assert (folder.final / "tokenizer.json").is_file() and (folder.final / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(folder.final)
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name

    export_final(model, _AdapterTask(), folder, pg)
    assert (folder.final / "adapter" / "adapter_config.json").is_file()
    assert (folder.final / "model.safetensors").is_file()
    with pytest.raises(RuntimeError, match="export failed"):
        export_final(model, _BrokenTask(), folder, pg)
    assert (folder.final / "adapter").is_dir() and not (folder.final / "half.txt").exists()  # untouched
