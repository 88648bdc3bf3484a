"""Fast in-process unit tests of optim, model, evaluate and the watchdog (no subprocesses, no torchrun);
checkpoints and the final export: tests/test_checkpoint.py.

The end-to-end tests run these modules inside real multi-process launches; here each behaviour is pinned
down directly on tiny models, so a regression names the function that broke. Evaluation tests use a
real single-process Gloo group made by `phalanx.core.dist.setup` (module-scoped, torn down and the
environment restored afterwards).
"""
from __future__ import annotations

import json
import math
import pickle
import threading

import phalanx.core.dist as pdist
import pytest
import torch
from torch import nn

from phalanx.core.config import ModelConfig, TrainConfig
from phalanx.run.evaluate import evaluate

from phalanx.run.evaluate import eval_shard
from phalanx.model.build import (
    build_causal_lm,
    build_classifier,
    count_parameters,
    tie_shared,
    wrap,
)
from phalanx.model.shard import transformer_blocks
from phalanx.model.optim import WarmupCosine, build_optimizer, optimizer_impl, restore_impl
from phalanx.run.state import TrainState
from phalanx.core.faults import KINDS, parse_fault
from phalanx.run.probe import PHASE_OF, Probe
from phalanx.run.watchdog import Phase, Watchdog, summarize

VOCAB, BLOCK, EMBD = 64, 16, 32


def tiny(arch: str = "gpt2", n_layer: int = 1) -> ModelConfig:
    return ModelConfig(arch=arch, n_layer=n_layer, n_head=2, n_embd=EMBD, block_size=BLOCK)


def cpu_info(rank: int = 0, world_size: int = 1) -> pdist.DistInfo:
    return pdist.DistInfo(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                          node_rank=0, attempt=0, backend="gloo", device=torch.device("cpu"))


# ---- optim ----------------------------------------------------------------------------------------
def test_warmup_cosine_values_at_key_steps():
    s = WarmupCosine(TrainConfig(lr=2.0, min_lr_ratio=0.1, warmup_steps=10, max_steps=110))
    assert s.lr_at(0) == pytest.approx(0.2)        # (step + 1) / warmup: the first step already learns
    assert s.lr_at(4) == pytest.approx(1.0)        # mid warm-up: linear
    assert s.lr_at(9) == pytest.approx(2.0)        # last warm-up step reaches the peak
    assert s.lr_at(10) == pytest.approx(2.0)       # cosine starts at the peak
    assert s.lr_at(60) == pytest.approx(0.2 + 0.5 * 1.8)  # half-way through the decay
    assert s.lr_at(110) == pytest.approx(0.2)      # end: lr * min_lr_ratio
    assert s.lr_at(111) == s.lr_at(10_000) == pytest.approx(0.2)  # past the end: stays at the floor
    warm = [s.lr_at(k) for k in range(10)]
    decay = [s.lr_at(k) for k in range(10, 200)]
    assert all(a < b for a, b in zip(warm, warm[1:]))
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_warmup_cosine_without_warmup_and_zero_floor():
    s = WarmupCosine(TrainConfig(lr=1e-3, min_lr_ratio=0.0, warmup_steps=0, max_steps=100))
    assert s.lr_at(0) == pytest.approx(1e-3)
    assert s.lr_at(50) == pytest.approx(5e-4)
    assert s.lr_at(100) == pytest.approx(0.0, abs=1e-15) and s.lr_at(150) == pytest.approx(0.0, abs=1e-15)


def test_schedule_apply_and_state_round_trip():
    t = TrainConfig(lr=1e-2, min_lr_ratio=0.1, warmup_steps=5, max_steps=50)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, t)
    s = WarmupCosine(t)
    lr = s.apply(opt, 17)
    assert lr == s.lr_at(17) and all(g["lr"] == lr for g in opt.param_groups)
    state = json.loads(json.dumps(s.state_dict()))  # stored in meta.json
    assert state == {"step": 17}
    fresh = WarmupCosine(t)
    fresh.load_state_dict(state)
    assert fresh.step == 17 and fresh.state_dict() == s.state_dict()
    assert fresh.lr_at(fresh.step) == lr


def _adamw_run(impl: str, steps: int, model=None, state=None):
    torch.manual_seed(0)
    model = model or build_causal_lm(tiny("gpt2"), VOCAB, 0)
    opt = build_optimizer(model, TrainConfig(lr=1e-2, weight_decay=0.1, optimizer_impl=impl))
    if state is not None:
        opt.load_state_dict(state)
        restore_impl(opt, impl)
    for k in range(steps):
        gen = torch.Generator().manual_seed(k)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return model, opt


@pytest.mark.parametrize("impl", ["fused", "foreach", "loop"])
def test_optimizer_impls_run_the_same_adamw(impl):
    ref, _ = _adamw_run("loop", 5)
    model, opt = _adamw_run(impl, 5)
    assert optimizer_impl(opt) == impl
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_auto_is_fused_on_cpu_and_a_saved_state_resumes_under_another_impl():
    assert optimizer_impl(_adamw_run("auto", 0)[1]) == "fused"
    ref, _ = _adamw_run("fused", 6)
    model, fused = _adamw_run("fused", 3)
    state = pickle.loads(pickle.dumps(fused.state_dict()))
    model, loop = _adamw_run("loop", 0, model=model, state=state)
    assert optimizer_impl(loop) == "loop"  # not the saved groups' fused flag
    gen_steps = [torch.Generator().manual_seed(k) for k in range(3, 6)]
    for gen in gen_steps:
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        loop.step()
    assert all(int(loop.state[p]["step"]) == 6 for p in model.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_weight_decay_on_matrices_only():
    t = TrainConfig(lr=1e-3, weight_decay=0.1, beta1=0.8, beta2=0.9)
    model = build_causal_lm(tiny("gpt2"), VOCAB, 0)
    opt = build_optimizer(model, t)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["lr"] == no_decay["lr"] == 1e-3 and tuple(decay["betas"]) == (0.8, 0.9)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert not any(n.endswith(".bias") or ".ln_" in n for n in decayed)
    assert {"transformer.h.0.ln_1.weight", "transformer.ln_f.weight", "transformer.h.0.attn.c_attn.bias"} <= plain
    assert {"transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight"} <= decayed
    # every parameter exactly once (the tied lm_head / wte appears once, not in both groups)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


def test_weight_decay_behaviour_and_frozen_parameters_excluded():
    """With zero gradients AdamW moves only by decay: matrices shrink by (1 - lr*wd); vectors stay."""
    t = TrainConfig(lr=0.5, weight_decay=0.1)
    model = build_causal_lm(tiny("llama"), VOCAB, 0)
    model.model.norm.weight.requires_grad_(False)
    opt = build_optimizer(model, t)
    assert all(p is not model.model.norm.weight for g in opt.param_groups for p in g["params"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if p.dim() >= 2:
            torch.testing.assert_close(p.detach(), before[n] * (1 - 0.5 * 0.1), msg=n)
        else:  # RMSNorm weights (and the frozen one)
            assert torch.equal(p.detach(), before[n]), n


# ---- model ----------------------------------------------------------------------------------------
def _gpt2_params(V, P, E, L):
    block = 2 * E + (E * 3 * E + 3 * E) + (E * E + E) + 2 * E + (E * 4 * E + 4 * E) + (4 * E * E + E)
    return V * E + P * E + L * block + 2 * E  # lm_head tied to wte: counted once


def _llama_params(V, E, L):
    return V * E + L * (4 * E * E + 3 * E * 4 * E + 2 * E) + E  # no biases, tied head


@pytest.mark.parametrize("arch,n_layer", [("gpt2", 1), ("gpt2", 2), ("llama", 1), ("llama", 2)])
def test_causal_lm_from_config(arch, n_layer):
    model = build_causal_lm(tiny(arch, n_layer), VOCAB, eos_id=3)
    cfg = model.config
    assert cfg.vocab_size == VOCAB and cfg.eos_token_id == 3 and cfg.bos_token_id == 3
    expected = _gpt2_params(VOCAB, BLOCK, EMBD, n_layer) if arch == "gpt2" else _llama_params(VOCAB, EMBD, n_layer)
    assert count_parameters(model) == sum(p.numel() for p in model.parameters()) == expected
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    assert len(transformer_blocks(model)) == n_layer
    logits = model(input_ids=torch.randint(0, VOCAB, (2, BLOCK))).logits  # the full context length fits
    assert logits.shape == (2, BLOCK, VOCAB)


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert"])
def test_classifier_from_config(arch):
    id2label = {0: "neg", 1: "neu", 2: "pos"}
    max_length = 16
    model = build_classifier(tiny(arch, 2), VOCAB, pad_id=0, max_length=max_length, id2label=id2label)
    assert model.config.num_labels == 3 and model.config.id2label == id2label
    assert model.config.label2id == {"neg": 0, "neu": 1, "pos": 2}
    assert model.config.vocab_size == VOCAB and model.config.pad_token_id == 0
    assert count_parameters(model) == sum(p.numel() for p in model.parameters()) > 0
    assert len(transformer_blocks(model)) == 2
    ids = torch.randint(1, VOCAB, (2, max_length))  # max_length tokens must fit the positions (roberta: +2)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert logits.shape == (2, 3)


def test_tie_shared_points_copies_at_one_tensor():
    model = build_causal_lm(tiny("gpt2"), VOCAB, 0)
    # a full state dict gathered from shards: a separate copy per name
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.setdefault("lm_head.weight", state["transformer.wte.weight"].clone())
    assert state["lm_head.weight"] is not state["transformer.wte.weight"]
    others = {k: v for k, v in state.items() if k != "lm_head.weight"}
    out = tie_shared(state, model)
    assert out is state
    assert out["lm_head.weight"] is out["transformer.wte.weight"]
    assert all(out[k] is v for k, v in others.items())  # nothing else touched
    # the owner missing from the dict: left alone, no KeyError
    partial = {"lm_head.weight": torch.zeros(VOCAB, EMBD)}
    assert tie_shared(partial, model)["lm_head.weight"].abs().sum() == 0


def test_tie_shared_leaves_untied_models_alone():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = dict(state)
    assert tie_shared(state, model) == before and all(state[k] is before[k] for k in state)


def test_wrap_is_identity_at_world_size_one():
    model = nn.Linear(2, 2)
    for strategy in ("ddp", "fsdp"):  # DDP at world size 1 costs ~5% for nothing (measured): no wrapper
        assert wrap(model, strategy, cpu_info(0, 1)) is model


# ---- evaluate -------------------------------------------------------------------------------------
class FakeTask:
    """Like tasks/lm.py: collate -> batch dict, eval_sums -> per-batch sums, eval_metrics -> metrics."""

    def __init__(self, drop_one: bool = False):
        self.calls: list[list[int]] = []
        self.seen_modes: list[tuple[bool, bool]] = []
        self.drop_one = drop_one

    def collate(self, dataset, indices):
        self.calls.append([int(i) for i in indices])
        return {"x": torch.tensor([dataset[i] for i in indices], dtype=torch.float64), "tag": "kept"}

    def eval_sums(self, model, batch):
        assert batch["tag"] == "kept"
        self.seen_modes.append((model.training, torch.is_grad_enabled()))
        return [float(batch["x"].sum()), float(batch["x"].numel())]

    def eval_metrics(self, sums):
        total, count = sums
        return {"eval/sum": total, "eval/samples": int(count) - self.drop_one}


def _dataset(n: int) -> list[int]:
    return [i * i + 1 for i in range(n)]


@pytest.mark.parametrize("n,micro", [(10, 3), (9, 3), (1, 4), (17, 1)])
def test_evaluate_visits_every_sample_once(pg, n, micro):
    task, data, model = FakeTask(), _dataset(n), nn.Linear(2, 2)
    model.train()
    metrics = evaluate(task, model, data, pg, micro)
    assert metrics == {"eval/sum": float(sum(data)), "eval/samples": n}
    flat = [i for c in task.calls for i in c]
    assert flat == list(range(n))
    assert len(task.calls) == math.ceil(n / micro) and all(len(c) <= micro for c in task.calls)
    assert task.seen_modes == [(False, False)] * len(task.calls)  # eval mode, no autograd
    assert model.training  # restored


def test_evaluate_respects_max_samples_and_keeps_eval_mode(pg):
    task, data, model = FakeTask(), _dataset(20), nn.Linear(2, 2)
    model.eval()
    metrics = evaluate(task, model, data, pg, micro_batch_size=4, max_samples=7)
    assert [i for c in task.calls for i in c] == list(range(7))
    assert metrics == {"eval/sum": float(sum(data[:7])), "eval/samples": 7}
    assert not model.training  # was eval: stays eval
    assert evaluate(FakeTask(), model, data, pg, 4, max_samples=50)["eval/samples"] == 20  # capped at len
    assert evaluate(FakeTask(), model, [], pg, 4) == {}


def test_evaluate_checks_the_sample_count(pg):
    with pytest.raises(RuntimeError, match="saw 4 samples, expected 5"):
        evaluate(FakeTask(drop_one=True), nn.Linear(2, 2), _dataset(5), pg, 2)


@pytest.mark.parametrize("n,world,micro", [(10, 3, 2), (2, 3, 4), (7, 4, 1), (9, 2, 5)])
def test_evaluate_sharded_over_simulated_ranks(monkeypatch, n, world, micro):
    """Ranks as threads with an all-reduce that really sums across them: every sample on exactly one
    rank, every rank the same number of forward passes (a rank with nothing left runs a throw-away
    batch), and every rank gets the global metrics."""
    sync = threading.Barrier(world)
    posted: dict[int, list[float]] = {}

    def all_reduce(values, info, op="sum"):
        posted[info.rank] = list(values)
        sync.wait(timeout=20)
        return [sum(posted[r][k] for r in range(world)) for k in range(len(values))]

    monkeypatch.setattr(pdist, "all_reduce", all_reduce)
    data = _dataset(n)
    tasks = [FakeTask() for _ in range(world)]
    results: dict[int, object] = {}

    def rank_main(r):
        try:
            results[r] = evaluate(tasks[r], nn.Linear(2, 2), data, cpu_info(r, world), micro)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[r] = e
            sync.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    expected = {"eval/sum": float(sum(data)), "eval/samples": n}
    assert all(results[r] == expected for r in range(world)), results
    rounds = math.ceil(math.ceil(n / world) / micro)
    covered = []
    for r in range(world):
        shard = list(eval_shard(n, r, world))
        real = math.ceil(len(shard) / micro)
        calls = tasks[r].calls
        assert len(calls) == rounds  # same number of forwards on every rank
        assert [i for c in calls[:real] for i in c] == shard
        assert calls[real:] == [[0]] * (rounds - real)  # throw-away batches, not counted
        covered += shard
    assert covered == list(range(n))


@pytest.mark.parametrize("n,world", [(0, 1), (0, 3), (1, 1), (1, 4), (2, 3), (5, 8), (7, 7), (10, 3),
                                     (100, 7), (872, 3), (1001, 16)])
def test_eval_shard_partitions_exactly(n, world):
    shards = [eval_shard(n, r, world) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(n))  # contiguous, in rank order, each once
    assert all(s.step == 1 for s in shards)
    sizes = [len(s) for s in shards]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert max(sizes) == math.ceil(n / world)


# --- hang watchdog -------------------------------------------------------------------------------

def test_hung_rank_waits_for_its_peers_reports_before_exiting(tmp_path):
    """The launcher stops the group when the first worker exits: a rank that exited at once would cut off
    the stacks of its peers, and the diagnosis would name no stuck rank."""
    dog0, dog1 = Watchdog(tmp_path, 0, 2, 5.0), Watchdog(tmp_path, 1, 2, 5.0)
    dog0.beat(3, Phase.SYNC)
    dog1.beat(3, Phase.START)
    dog0._dump(6.0)
    waiter = threading.Thread(target=dog0._wait_for_peers)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # rank 1 has not reported yet
    dog1._dump(6.0)
    waiter.join(2.0)
    assert not waiter.is_alive()
    assert "rank(s) 1 did not reach the collective at step 3" in summarize(tmp_path)


def _stuck(tmp_path, *positions) -> str:
    """The hang summary for ranks last seen at these (step, phase, micro) positions."""
    for rank, (step, phase, micro) in enumerate(positions):
        dog = Watchdog(tmp_path / str(positions), rank, len(positions), 5.0)
        dog.beat(step, phase, micro)
        dog._dump(6.0)
    return summarize(tmp_path / str(positions))


@pytest.mark.parametrize("behind,ahead", [
    ((3, Phase.DATA, 0), (3, Phase.SYNC, 0)),                # the usual hang: one rank never reached the sync
    ((3, Phase.CHECKPOINT_WRITTEN, 0), (3, Phase.START, 0)),  # step 3's checkpoint comes before step 3 itself
    ((3, Phase.EVAL, 0), (3, Phase.CHECKPOINT, 0)),
    ((3, Phase.FORWARD, 1), (3, Phase.BACKWARD, 1)),
    ((3, Phase.BACKWARD, 0), (3, Phase.FORWARD, 1)),          # micro-batches order forward/backward ...
    ((3, Phase.BACKWARD, 1), (3, Phase.OPTIMIZER, 0)),        # ... but the optimizer is past all of them
    ((3, Phase.OPTIMIZER, 0), (4, Phase.EVAL, 0)),
    ((6, Phase.CHECKPOINT_WRITTEN, 0), (6, Phase.EXPORT, 0)),
])
def test_the_hang_summary_names_the_rank_behind_in_step_order(tmp_path, behind, ahead):
    for order in ((behind, ahead), (ahead, behind)):
        stuck_rank = order.index(behind)
        text = _stuck(tmp_path, *order)
        assert f"rank(s) {stuck_rank} did not reach the collective at step {behind[0]} (last stage: {behind[1]})" \
            in text, text


def test_every_fault_kind_fires_at_one_phase_through_the_probe():
    assert set(PHASE_OF) == set(KINDS)

    class Beats:
        def __init__(self):
            self.seen = []

        def beat(self, step, phase, micro=0):
            self.seen.append((step, phase, micro))

    beats = Beats()
    probe = Probe(beats, parse_fault("nan:rank=1:step=4"), rank=1, attempt=0)
    assert [probe(s, phase) for s, phase in ((3, Phase.FORWARD), (4, Phase.BACKWARD), (4, Phase.FORWARD))] == \
        [False, False, True]  # poisons only at its step and phase
    assert beats.seen == [(3, Phase.FORWARD, 0), (4, Phase.BACKWARD, 0), (4, Phase.FORWARD, 0)]
    assert not Probe(beats, parse_fault("nan:rank=0:step=4"), rank=1, attempt=0)(4, Phase.FORWARD)
    with pytest.raises(RuntimeError, match="injected failure"):
        Probe(beats, parse_fault("raise:step=2"), rank=0, attempt=0)(2, Phase.START)


def test_train_state_keeps_the_data_order_of_its_checkpoint():
    state = TrainState(step=5, samples_seen=80)
    saved = json.loads(json.dumps(state.state_dict()))
    assert saved["data_order"] == 3 and saved["version"] == 3
    fresh = TrainState()
    fresh.load_state_dict(saved)
    assert fresh == state
    old = TrainState()
    old.load_state_dict({"step": 5, "samples_seen": 80})  # written before the field existed
    assert old.data_order == 1 and old.step == 5
