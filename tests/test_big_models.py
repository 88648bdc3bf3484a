"""Models larger than one device (issue 18): sharded construction and loading, named init, activation
checkpointing, FSDP2's mixed precision, the sharded export.

Multi-process checks run tests/big_models_worker.py under torch.distributed.run (Gloo, CPU) where they
measure the build itself, and real `phalanx train` runs where they compare trajectories.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from functools import partial

import pytest
import torch
from big_models_worker import BIG, BIG_VOCAB, TINY, TINY_VOCAB
from conftest import REPO, final_params, lm_args, metrics, phalanx, train_losses, with_worker_zygote, zygote_python

from phalanx.core.config import ConfigError, ModelConfig, load_config
from phalanx.model.build import build_causal_lm, causal_lm, classifier
from phalanx.model.checkpointing import apply_activation_checkpointing, checkpointed_blocks
from phalanx.model.init import name_seed
from phalanx.model.shard import Builder

WORKER = REPO / "tests" / "big_models_worker.py"
MB = 2**20


def torchrun(mode: str, out, *args, nproc: int = 2, timeout: float = 240) -> None:
    proc = subprocess.run([zygote_python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(WORKER), mode, str(out), *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=with_worker_zygote({**os.environ, "OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A pretrained GPT-2 and Llama (tied embeddings, rotary inv_freq), saved in bf16 as hub models often are."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for arch in ("gpt2", "llama"):
        out[arch] = root / arch
        build_causal_lm(TINY[arch], TINY_VOCAB, 0, seed=2).to(torch.bfloat16).save_pretrained(out[arch])
    return out


# ---- named init -------------------------------------------------------------------------------------
def _stats(t: torch.Tensor) -> tuple[float, float]:
    return float(t.float().mean()), float(t.float().std()) if t.numel() > 1 else 0.0


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_named_init_keeps_transformers_rules(arch):
    """Per parameter, the same rule as transformers' own init: constants exactly, normals with its std
    (GPT-2's residual projections scaled by 1/sqrt(2 x layers)); buffers such as rotary inv_freq and BERT's
    position ids computed as transformers computes them."""
    m = ModelConfig(arch=arch, n_layer=2, n_head=2, n_embd=128, block_size=64)
    if arch == "bert":
        define = partial(classifier, m, 500, 0, 64, {0: "a", 1: "b"})
    else:
        define = partial(causal_lm, m, 500, 0)
    torch.manual_seed(0)  # transformers' init draws from the global generator: the same draws every run
    ours, theirs = Builder(seed=3).build(define), define()  # define() outside a Builder: transformers' init
    assert [n for n, _ in ours.state_dict().items()] == [n for n, _ in theirs.state_dict().items()]
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        if b.numel() == 1 or float(b.float().std()) == 0:
            assert torch.equal(a, b), name  # ones, zeros
        else:
            (ma, sa), (_, sb) = _stats(a), _stats(b)
            # two samples of n draws: their stds differ by ~sqrt(1/n) relative; 5 of those (10% at least)
            spread = max(0.1, 5 / math.sqrt(a.numel()))
            assert abs(ma) < 4 * sb / math.sqrt(a.numel()) + 1e-4 and sa == pytest.approx(sb, rel=spread), name
    buffers = dict(theirs.named_buffers())  # rotary inv_freq, position ids: not in the state dict
    assert buffers.keys() == dict(ours.named_buffers()).keys()
    assert all(torch.equal(b, buffers[n]) for n, b in ours.named_buffers())
    if arch == "gpt2":
        std = float(ours.transformer.h[0].attn.c_proj.weight.detach().std())
        assert std == pytest.approx(0.02 / math.sqrt(2 * 2), rel=0.1)


def test_init_is_a_function_of_seed_and_name_only():
    """Adding layers changes no existing weight (Llama: no depth-dependent rule; GPT-2 scales c_proj by
    depth); another seed changes the random ones."""
    two = build_causal_lm(TINY["llama"], TINY_VOCAB, 0, seed=7).state_dict()
    three = build_causal_lm(dataclasses.replace(TINY["llama"], n_layer=3), TINY_VOCAB, 0, seed=7).state_dict()
    other = build_causal_lm(TINY["llama"], TINY_VOCAB, 0, seed=8).state_dict()
    assert all(torch.equal(three[k], v) for k, v in two.items())
    assert not torch.equal(two["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
    assert name_seed(7, "a.b") != name_seed(7, "a.c") and name_seed(7, "a") == name_seed(7, "a")


@pytest.fixture(scope="module")
def checks(tmp_path_factory, folders):
    """One 2-process launch: initial weights under ddp and fsdp, pretrained logits under fsdp, bf16 dtypes."""
    out = tmp_path_factory.mktemp("checks")
    torchrun("checks", out, folders["gpt2"], folders["llama"])
    return out


def _assert_init_equals_world_one(out) -> None:
    from safetensors.torch import load_file

    want = Builder(seed=7).build(partial(causal_lm, TINY["gpt2"], TINY_VOCAB, 0)).state_dict()
    want.pop("lm_head.weight")
    for strategy in ("ddp", "fsdp"):
        got = load_file(str(out / f"init-{strategy}.safetensors"))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), strategy
        assert json.loads((out / f"init-{strategy}.json").read_text())["tied"]  # lm_head is wte, after sharding


def test_init_is_the_same_at_world_1_and_2_under_ddp_and_fsdp(checks):
    _assert_init_equals_world_one(checks)


@pytest.mark.slow
def test_init_is_the_same_at_world_3(tmp_path):
    torchrun("init", tmp_path, nproc=3)
    _assert_init_equals_world_one(tmp_path)


def test_pretrained_folders_load_sharded_to_the_logits_of_from_pretrained(checks, folders):
    """Loaded under fsdp from each rank's slices of a bf16 checkpoint (upcast to fp32): the logits of plain
    from_pretrained. A Llama whose rotary inv_freq were left as to_empty's garbage would differ."""
    from transformers import AutoModelForCausalLM

    ids = torch.arange(24).reshape(2, 12) % TINY_VOCAB
    for k, arch in enumerate(("gpt2", "llama")):
        want = AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32).eval()
        with torch.no_grad():
            expected = want(input_ids=ids).logits
        got = torch.load(checks / f"logits-{k}.pt")
        assert got["tied"], arch
        torch.testing.assert_close(got["logits"], expected, rtol=1e-5, atol=1e-5, msg=arch)


def test_rotary_buffers_matter_to_that_comparison(folders):
    """The negative control of the test above: garbage inv_freq changes the logits."""
    model = build_causal_lm(ModelConfig(pretrained=str(folders["llama"])), 0, 0).eval()
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        good = model(input_ids=ids).logits
        model.model.rotary_emb.inv_freq.mul_(3.0)
        assert not torch.allclose(model(input_ids=ids).logits, good, atol=1e-3)


def test_a_grown_vocabulary_keeps_the_old_rows_and_starts_new_ones_at_their_mean(folders):
    """chat on a base without a template: the embedding grows by the template's tokens; old rows are the
    checkpoint's, new ones are drawn around the mean old row (transformers' mean resizing); still tied."""
    from safetensors import safe_open

    def define():
        model = causal_lm(ModelConfig(pretrained=str(folders["gpt2"])), 0, 0)
        model.resize_token_embeddings(TINY_VOCAB + 2, mean_resizing=False)
        return model

    model = Builder(seed=1).build(define, str(folders["gpt2"]))
    with safe_open(str(folders["gpt2"] / "model.safetensors"), "pt") as f:
        saved = f.get_tensor("transformer.wte.weight").float()
    wte = model.transformer.wte.weight.detach()
    assert torch.equal(wte[:TINY_VOCAB], saved)
    assert torch.allclose(wte[TINY_VOCAB:], saved.mean(0).expand(2, -1), atol=1e-3)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_hub_model_shipped_as_pytorch_model_bin_only_loads(tmp_path, folders, monkeypatch):
    """The hub snapshot asks for safetensors first; a model that has none is fetched again for its .bin
    files (a fake hub: the patterns decide which files of a saved folder arrive)."""
    import fnmatch
    import shutil

    import huggingface_hub
    from transformers import AutoModelForCausalLM

    saved = tmp_path / "saved"  # the configs, and the weights as torch.save wrote them (transformers 5 only
    saved.mkdir()               # writes safetensors)
    for f in folders["gpt2"].glob("*.json"):
        shutil.copy(f, saved / f.name)
    torch.save(AutoModelForCausalLM.from_pretrained(folders["gpt2"]).state_dict(), saved / "pytorch_model.bin")

    def snapshot_download(name, allow_patterns):
        out = tmp_path / f"snapshot-{len(list(tmp_path.glob('snapshot-*')))}"
        out.mkdir()
        for f in saved.iterdir():
            if any(fnmatch.fnmatch(f.name, pattern) for pattern in allow_patterns):
                shutil.copy(f, out / f.name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = Builder(seed=1).build(partial(causal_lm, ModelConfig(pretrained=str(saved)), 0, 0), "someone/only-bin")
    reference = AutoModelForCausalLM.from_pretrained(folders["gpt2"], dtype=torch.float32).eval()
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_shape_mismatch_is_an_error_for_lm_and_a_new_head_for_classify(tmp_path, folders):
    with pytest.raises(ConfigError, match="model.pretrained.*transformer.wte.weight.*shape"):
        Builder(seed=1).build(partial(causal_lm, TINY["gpt2"], 200, 0), str(folders["gpt2"]))  # 300 rows saved
    m = ModelConfig(arch="bert", n_layer=1, n_head=2, n_embd=32)
    two = Builder(seed=1).build(partial(classifier, m, 100, 0, 16, {0: "a", 1: "b"}))
    two.save_pretrained(tmp_path / "bert")
    pre = ModelConfig(pretrained=str(tmp_path / "bert"))
    three = Builder(seed=1).build(partial(classifier, pre, 0, 0, 16, {0: "a", 1: "b", 2: "c"}), pre.pretrained,
                                  mismatched="init")
    assert three.classifier.weight.shape[0] == 3 and float(three.classifier.weight.detach().std()) > 0
    assert torch.equal(three.bert.embeddings.word_embeddings.weight, two.bert.embeddings.word_embeddings.weight)


# ---- FSDP2 mixed precision, CPU offload -------------------------------------------------------------
def test_fsdp_bf16_gathers_in_bf16_and_keeps_fp32_gradients_and_optimizer_state(checks):
    dtypes = json.loads((checks / "dtypes.json").read_text())
    assert dtypes == {"unsharded": "torch.bfloat16", "grads": ["torch.float32"], "optimizer": ["torch.float32"],
                      "sharded": ["torch.float32"]}


def test_cpu_offload_needs_fsdp_and_a_gpu(tmp_path, cache_dir):
    from phalanx.model import precision

    with pytest.raises(ConfigError, match="train.cpu_offload.*train.strategy=fsdp"):
        load_config(None, ["train.cpu_offload=true"])
    precision.check_offload(True, "cuda")
    with pytest.raises(ConfigError, match="train.cpu_offload.*no GPU"):
        precision.check_offload(True, "cpu")
    run = tmp_path / "offload"
    proc = phalanx(*lm_args(run, cache_dir, "train.strategy=fsdp", "train.cpu_offload=true", "dist.backend=gloo"),
                   "--nproc-per-node", 2, timeout=60)
    assert proc.returncode == 2 and "train.cpu_offload" in proc.stderr and not run.exists()  # before any worker


# ---- memory of the build ----------------------------------------------------------------------------
def _bound(full: int) -> int:
    """Half the model, plus the largest unit copied whole while initialising (the token embeddings here,
    larger than one block), plus a fixed allowance (allocator slack, runtime): in bytes."""
    unit = BIG_VOCAB * BIG.n_embd * 4
    return full // 2 + unit + 32 * MB


def _check_memory(out, source: str) -> None:
    for rank in (0, 1):
        got = json.loads((out / f"memory-rank{rank}.json").read_text())
        new, old = got[f"{source}-new"], got[f"{source}-old"]
        assert new["full_param_bytes"] == old["full_param_bytes"] > 150 * MB  # the ~170 MB model
        bound = _bound(new["full_param_bytes"])
        assert new["local_param_bytes"] <= new["full_param_bytes"] // 2 + MB
        assert new["peak_delta"] < bound and new["anon_delta"] < bound, (rank, new, bound)
        assert new["file_delta"] < 8 * MB  # no mapped weight files resident
        # the negative control: the pre-issue-18 path (whole model on every rank, then sharded) breaks it
        assert old["peak_delta"] > bound, (rank, old, bound)


def test_fsdp_build_peak_private_memory_stays_under_half_the_model(tmp_path):
    """VmHWM over the build (reset first through /proc/self/clear_refs), per rank of a 2-process FSDP build
    of a ~170 MB GPT-2, against the bound; the old path measured the same way must exceed it."""
    torchrun("memory", tmp_path)
    _check_memory(tmp_path, "scratch")


@pytest.mark.slow
def test_fsdp_pretrained_load_peak_private_memory_stays_under_half_the_model(tmp_path):
    folder = tmp_path / "big"
    build_causal_lm(BIG, BIG_VOCAB, 0, seed=1).save_pretrained(folder)
    torchrun("memory", tmp_path, folder, timeout=400)
    _check_memory(tmp_path, "pretrained")


# ---- activation checkpointing -----------------------------------------------------------------------
def test_checkpointed_blocks():
    assert checkpointed_blocks(5, "none", 2) == [] and checkpointed_blocks(5, "full", 2) == [0, 1, 2, 3, 4]
    assert checkpointed_blocks(5, "every_k", 2) == [0, 2, 4] and checkpointed_blocks(5, "every_k", 1) == [0, 1, 2, 3, 4]


def _step(model, ids, seed=5):
    torch.manual_seed(seed)
    loss = torch.nn.functional.cross_entropy(model(input_ids=ids, use_cache=False).logits.flatten(0, 1), ids.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_recomputes_and_gives_bitwise_the_same_loss_and_gradients(arch, lora):
    """With dropout on (and LoRA's dropout through peft): the block's forward really runs twice (the
    mechanism is on), and the loss and every gradient are bitwise those without checkpointing."""
    from phalanx.core.sections import LoraSettings
    from phalanx.model.lora import apply_lora

    m = dataclasses.replace(TINY[arch], dropout=0.1)
    ids = torch.randint(0, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for mode in ("none", "full"):
        model = Builder(seed=3, prepare=partial(apply_activation_checkpointing, mode=mode)).build(
            partial(causal_lm, m, TINY_VOCAB, 0))
        if lora:
            torch.manual_seed(1)
            model = apply_lora(model, LoraSettings(r=4), [])
        calls = []
        attn = next(mod for name, mod in model.named_modules() if name.endswith(("h.0.attn", "layers.0.self_attn")))
        attn.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        results.append((*_step(model.train(), ids), len(calls)))
    (loss0, grads0, calls0), (loss1, grads1, calls1) = results
    assert (calls0, calls1) == (1, 2)
    assert torch.equal(loss0, loss1) and grads0.keys() == grads1.keys() and grads0
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


AC_RUN = ["train.max_steps=4", "train.checkpoint_every=2", "train.eval_max_samples=8", "model.dropout=0.1",
          "dist.threads_per_worker=1", "dist.backend=gloo"]


def _grad_norms(run) -> dict[int, float]:
    return {m["step"]: m["grad_norm"] for m in metrics(run) if "grad_norm" in m and "event" not in m}


def _assert_bitwise(run, ref, steps) -> None:
    assert {s: train_losses(run)[s] for s in steps} == {s: train_losses(ref)[s] for s in steps}
    assert {s: _grad_norms(run)[s] for s in steps} == {s: _grad_norms(ref)[s] for s in steps}


@pytest.fixture(scope="module")
def ac_runs(tmp_path_factory, cache_dir):
    """2 processes x 2 accumulation steps (no_sync), dropout 0.1, without and with checkpointing."""
    runs = {}
    for mode in ("none", "full"):
        runs[mode] = tmp_path_factory.mktemp(f"ac-{mode}")
        phalanx(*lm_args(runs[mode], cache_dir, *AC_RUN, f"train.activation_checkpointing={mode}"),
                "--nproc-per-node", 2, check=True, timeout=240)
    return runs


def test_checkpointing_under_ddp_no_sync_and_dropout_changes_nothing(ac_runs):
    """Every loss, gradient norm and final weight bitwise equal with and without checkpointing."""
    _assert_bitwise(ac_runs["full"], ac_runs["none"], range(1, 5))
    p_none, p_full = final_params(ac_runs["none"]), final_params(ac_runs["full"])
    assert p_none.keys() == p_full.keys() and all(torch.equal(p_none[k], p_full[k]) for k in p_none)


def test_a_checkpointed_run_resumes_bitwise(ac_runs, tmp_path, cache_dir):
    resumed = tmp_path / "resumed"
    phalanx(*lm_args(resumed, cache_dir, *AC_RUN, "train.activation_checkpointing=full"), "--nproc-per-node", 2,
            "--resume", ac_runs["full"] / "checkpoints" / "step_000002", check=True, timeout=240)
    _assert_bitwise(resumed, ac_runs["full"], (3, 4))


# ---- the sharded export -----------------------------------------------------------------------------
def test_sharded_export_at_world_one_loads_to_the_logits_of_the_single_file(tmp_path, folders):
    """write_hf over train.export_shard_mb: files of at most that size, the index from_pretrained reads,
    tied weights once; the same logits as the single-file export of the same model."""
    from transformers import AutoModelForCausalLM

    from safetensors.torch import load_file

    from phalanx.core import dist
    from phalanx.run.export import INDEX, export_entries, write_hf

    info = dist.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, attempt=0,
                         backend="gloo", device=torch.device("cpu"))
    model = build_causal_lm(TINY["llama"], TINY_VOCAB, 0, seed=4)
    tok = type("Tok", (), {"save_pretrained": lambda self, out: None})()
    write_hf(model, tok, tmp_path / "one", info=info)
    write_hf(model, tok, tmp_path / "many", info=info, shard_mb=0.05)
    assert (tmp_path / "one" / "model.safetensors").is_file() and not (tmp_path / "one" / INDEX).exists()
    index = json.loads((tmp_path / "many" / INDEX).read_text())
    files = sorted(p.name for p in (tmp_path / "many").glob("model-*.safetensors"))
    assert files == sorted(set(index["weight_map"].values())) and len(files) > 3
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as save_pretrained does
    for f in (tmp_path / "many").glob("model-*.safetensors"):
        tensors = load_file(str(f))
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 0.05 * MB or len(tensors) == 1
    assert sorted(n for n, _ in export_entries(model)) == sorted(index["weight_map"])
    ids = torch.arange(20).reshape(2, 10)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "one").eval()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "many").eval()
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    assert b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()


def test_export_files_hold_consecutive_tensors_up_to_the_limit():
    from phalanx.run.export import plan_files

    entries = [(name, torch.empty(n)) for name, n in [("a", 10), ("b", 10), ("c", 30), ("d", 5), ("e", 1)]]
    files = plan_files(entries, 80)  # bytes: 40, 40, 120, 20, 4
    assert [[n for n, _ in f] for f in files] == [["a", "b"], ["c"], ["d", "e"]]
