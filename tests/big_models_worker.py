"""One worker of tests/test_big_models.py, started by torch.distributed.run (Gloo, CPU).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/big_models_worker.py MODE OUT [ARGS]

Each mode builds models the way phalanx's trainer does (phalanx.model.build.model_builder: meta device,
FSDP2 sharding, named init or sliced loading) and writes what it measured to OUT as JSON/safetensors for
the test to check:
  memory [FOLDER]          peak private memory of the build (VmHWM after resetting it, RssAnon) from scratch
                           (and from FOLDER), by phalanx's path and by the pre-issue-18 one (whole model on
                           every rank, then fully_shard)
  init                     the initial weights under ddp and fsdp (gathered, rank 0 writes them)
  checks FOLDER...         init, then the logits of pretrained folders loaded under fsdp on fixed inputs, then
                           FSDP2 + bf16: parameter dtype inside the forward, gradient and optimizer dtypes
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import sys
from pathlib import Path

import torch

from phalanx.core import dist
from phalanx.core.config import ModelConfig, TrainConfig
from phalanx.model.build import causal_lm, model_builder, quiet_transformers
from phalanx.model.shard import fsdp_shard

# ~168 MB in fp32 (42 M parameters): 12 blocks of 12.6 MB, token embeddings of 16.8 MB
BIG = ModelConfig(arch="gpt2", n_layer=12, n_head=8, n_embd=512, block_size=64)
BIG_VOCAB = 8192
TINY = {"gpt2": ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=64, block_size=32, dropout=0.1),
        "llama": ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=64, block_size=32)}
TINY_VOCAB = 300


def status() -> dict[str, int]:
    """Bytes of /proc/self/status's memory lines (VmHWM: peak resident; RssAnon: private)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def measure(build) -> dict:
    """The build's peak over the resident memory it started from, its private memory kept, its tensors."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before = status()
    model = build()
    after = status()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    return {"peak_delta": after["VmHWM"] - before["VmRSS"], "anon_delta": after["RssAnon"] - before["RssAnon"],
            "file_delta": after["RssFile"] - before["RssFile"], "local_param_bytes": 4 * local,
            "full_param_bytes": 4 * sum(p.numel() for p in model.parameters())}


def memory(info, out: Path, folder: str = "") -> None:
    """Each build measured alone: the memory of the one before is handed back to the OS first."""
    results = {}
    model_builder(TrainConfig(strategy="fsdp"), info.device, info.world_size, None).build(
        lambda: causal_lm(TINY["gpt2"], 64, 0))  # the imports and first-use costs, before any measurement
    for source in ("scratch", "pretrained") if folder else ("scratch",):
        for path in ("new", "old"):
            pretrained = folder if source == "pretrained" else ""
            results[f"{source}-{path}"] = measure(lambda path=path, pretrained=pretrained:
                                                  build(info, path, pretrained))
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    (out / f"memory-rank{info.rank}.json").write_text(json.dumps(results))


def build(info, path: str, folder: str):
    """The BIG model under fsdp: phalanx's build (new), or as before issue 18 (old): every rank built or
    loaded the whole model, then sharded it."""
    define = lambda: causal_lm(dataclasses.replace(BIG, pretrained=folder), BIG_VOCAB, 0)  # noqa: E731
    if path == "new":
        return model_builder(TrainConfig(strategy="fsdp"), info.device, info.world_size, None).build(define, folder)
    if folder:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        model = define()
    fsdp_shard(model, device=info.device, world_size=info.world_size, param_dtype=None, cpu_offload=False)
    return model


def gathered(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def init(info, out: Path) -> None:
    from safetensors.torch import save_file

    for strategy in ("ddp", "fsdp"):
        model = model_builder(TrainConfig(strategy=strategy, seed=7), info.device, info.world_size, None).build(
            lambda: causal_lm(TINY["gpt2"], TINY_VOCAB, 0))
        tied = model.lm_head.weight is model.transformer.wte.weight
        state = gathered(model)
        if info.is_main:
            state.pop("lm_head.weight")
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"init-{strategy}.safetensors"))
            (out / f"init-{strategy}.json").write_text(json.dumps({"tied": tied}))


def logits(info, out: Path, folders: list[str]) -> None:
    ids = torch.arange(24).reshape(2, 12) % TINY_VOCAB
    for k, folder in enumerate(folders):
        model = model_builder(TrainConfig(strategy="fsdp"), info.device, info.world_size, None).build(
            lambda folder=folder: causal_lm(ModelConfig(pretrained=folder), 0, 0), folder)
        with torch.no_grad():
            got = model.eval()(input_ids=ids).logits
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        if info.is_main:
            torch.save({"logits": got, "tied": tied}, out / f"logits-{k}.pt")


def dtypes(info, out: Path) -> None:
    from phalanx.model.optim import build_optimizer

    t = TrainConfig(strategy="fsdp", precision="bf16")
    model = model_builder(t, info.device, info.world_size, torch.bfloat16).build(
        lambda: causal_lm(TINY["gpt2"], TINY_VOCAB, 0))
    seen = {}
    block = model.transformer.h[0]
    def look(*_):  # inside the block's forward, its parameters are the gathered (unsharded) ones
        seen.setdefault("unsharded", str(block.attn.c_attn.weight.dtype))

    block.attn.register_forward_pre_hook(look)
    optimizer = build_optimizer(model, t)
    ids = torch.arange(24).reshape(2, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, use_cache=False).logits.float().mean()
    loss.backward()
    grads = sorted({str(p.grad.dtype) for p in model.parameters()})
    optimizer.step()
    state = sorted({str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k != "step"})
    sharded = sorted({str(p.dtype) for p in model.parameters()})
    if info.is_main:
        (out / "dtypes.json").write_text(json.dumps({"unsharded": seen["unsharded"], "grads": grads,
                                                     "optimizer": state, "sharded": sharded}))


def main() -> None:
    mode, out, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    info = dist.setup("gloo", threads=1)
    quiet_transformers()
    if mode == "memory":
        memory(info, out, *args)
    if mode in ("init", "checks"):
        init(info, out)
    if mode == "checks":  # one launch for the three: start-up is most of a launch's time
        logits(info, out, args)
        dtypes(info, out)
    dist.barrier(info)
    dist.teardown()


if __name__ == "__main__":
    main()
