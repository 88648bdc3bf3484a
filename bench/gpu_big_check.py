"""Models larger than one device, checked on one GPU (a stage of bench/gpu_check.sh; ~5 minutes on an H200).

A ~1B-parameter Llama-style model is generated on the device (no hub), built the FSDP2 way — meta device,
fully_shard per block then the root, forced on a 1-device mesh (the trainer's wrap skips sharding at
world 1, and NCCL refuses two ranks on one GPU), local shards materialised and initialised by name — and
trained for a few steps with bf16 + MixedPrecisionPolicy (16-bit gathers, fp32 reduce), with and without
activation checkpointing, and with CPU offload. For each: tokens/s, MFU, peak device memory (allocated,
and reserved by the caching allocator) against the memory plan's figure, parameter/gradient/optimizer
dtypes; then the sharded export is read back by plain transformers (same logits as the trained model).
Then model.attn_implementation=flash_attention_2 where flash-attn is importable (else said and skipped):
the built model runs it, packed chat rows from phalanx's collate (two: the task's forward flattens them into
one for flash attention) give each conversation the logits it has alone under sdpa (and others when the
positions do not restart), and a few steps lower the loss. Last, FSDP2 + LoRA on a bf16 base of the same
shape (lora_check): the frozen base stored bf16, adapters fp32, gradients and AdamW state for adapters only,
the base bit-identical after the steps, the loss falling, peak memory against the plan, and the merged
bf16 export read back by plain transformers. (Written without a GPU lent: only its CPU smoke path ran.)

    python bench/gpu_big_check.py [--steps 6] [--batch 4] [--seq 2048] [--layers 16] [--width 2048]
Exit status: non-zero if a check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from functools import partial

import torch
import torch.nn.functional as F

from phalanx.core import dist
from phalanx.core.config import load_config
from phalanx.model.build import attention_in_use, causal_lm, quiet_transformers
from phalanx.model.checkpointing import apply_activation_checkpointing
from phalanx.model.optim import build_optimizer
from phalanx.model.shard import Builder, fsdp_shard
from phalanx.run.export import write_hf
from phalanx.run.telemetry import flops_per_token, peak_tflops
from phalanx.tasks.chat import ChatTask, collate_rows
from phalanx.tools import memplan

GB = 2 ** 30


def build(cfg, info, checkpointing: str, offload: bool):
    shard = partial(fsdp_shard, device=info.device, world_size=1, param_dtype=torch.bfloat16, cpu_offload=offload)
    prepare = partial(apply_activation_checkpointing, mode=checkpointing) if checkpointing != "none" else None
    builder = Builder(seed=1, device=torch.device("cpu") if offload else info.device, shard=shard, prepare=prepare,
                      buffer_device=info.device if offload else None)
    return builder.build(lambda: causal_lm(cfg.model, cfg.data.vocab_size, 0))


def train(model, cfg, info, ids, steps: int) -> dict:
    opt = build_optimizer(model, cfg.train)
    losses, times = [], []
    for _ in range(steps):
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(info.device.type, dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - t0)
    p = next(model.parameters())
    state = next(iter(opt.state.values()))
    return {"losses": [round(v, 4) for v in losses], "step_s": sorted(times[1:])[len(times[1:]) // 2],
            "param_dtype": str(p.dtype), "optimizer_dtype": str(state["exp_avg"].dtype)}


def flash_attention_check(cfg, info, steps: int) -> bool:
    """model.attn_implementation=flash_attention_2 on a 2-layer model of the same width (see the docstring);
    the CPU smoke run goes through the same code with eager attention."""
    import importlib.util

    device = info.device.type
    impl = "eager" if device == "cpu" else "flash_attention_2"
    if device == "cuda" and importlib.util.find_spec("flash_attn") is None:
        print(json.dumps({"flash_attention_2": "skipped: flash-attn is not installed"}), flush=True)
        return True

    def build(impl: str):
        m = dataclasses.replace(cfg.model, n_layer=2, attn_implementation=impl)
        return Builder(seed=1, device=info.device).build(lambda: causal_lm(m, cfg.data.vocab_size, 0))

    model, ref, task = build(impl).eval(), build("sdpa").eval(), ChatTask.__new__(ChatTask)
    gen = torch.Generator().manual_seed(0)
    convs = [(torch.randint(0, cfg.data.vocab_size, (n,), generator=gen).numpy(),
              torch.rand(n, generator=gen).numpy() < 0.5) for n in (300, 517, 701)]
    rows = [[convs[0], convs[1]], [convs[2]]]  # two rows: flash attention sees them flattened into one
    width = 840  # and pad tails
    batch = {k: v.to(info.device) if torch.is_tensor(v) else v for k, v in collate_rows(rows, width, 0).items()}
    spans = [(0, 0, 300), (0, 300, 817), (1, 0, 701)]

    def logps(net, inputs: dict) -> torch.Tensor:
        """Each target's log-prob through the task's own forward (the head only at targets), in a grid of the
        batch's shape (0 where there is none)."""
        keep = inputs["labels"] != -100
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            got = task.target_logps(net, inputs).logp.float()
        return torch.zeros(keep.shape, device=keep.device).masked_scatter(keep, got)

    def error(packed: torch.Tensor) -> float:
        """Largest relative difference of a target's log-prob, over every target, from each conversation run
        alone under sdpa (no mask, no position ids)."""
        worst = 0.0
        for r, a, z in spans:
            part = {k: batch[k][r:r + 1, a:z] for k in ("input_ids", "labels")}
            alone = logps(ref, part)[0]
            worst = max(worst, float(((packed[r, a:z] - alone).abs() / alone.abs().clamp_min(1e-3)).max()))
        return worst

    packed_err = error(logps(model, batch))
    arange = torch.arange(width, device=info.device).expand(2, -1)
    leaked_err = error(logps(model, {**batch, "position_ids": arange}))
    model.train()
    opt = build_optimizer(model, cfg.train)
    losses = []
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = task.loss_sum(model, batch) / int((batch["labels"] != -100).sum())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(float(loss.detach()), 4))
    r = {"attention": attention_in_use(model), "packed_vs_alone_max_rel": packed_err,
         "positions_not_restarting_max_rel": leaked_err, "losses": losses}
    print(json.dumps(r), flush=True)
    return (r["attention"] == impl and packed_err < 0.05 and leaked_err > 5 * packed_err
            and losses[-1] < losses[0])


def _lora_model(cfg, info, folder: str):
    from phalanx.core.sections import LoraSettings
    from phalanx.model.lora import LoraAdapters

    shard = partial(fsdp_shard, device=info.device, world_size=1, param_dtype=torch.bfloat16, cpu_offload=False)
    return Builder(seed=1, device=info.device, shard=shard, frozen_dtype=torch.bfloat16,
                   prepare=partial(apply_activation_checkpointing, mode="full")).build(
        lambda: causal_lm(dataclasses.replace(cfg.model, pretrained=folder), 0, 0), folder,
        adapters=LoraAdapters(LoraSettings(r=16, dropout=0.0), lambda: []))


def lora_check(cfg, info, ids, steps: int) -> bool:
    """FSDP2 + LoRA on a bf16 base of the same shape (issue 26): the base saved in bf16, built the trainer's
    way (meta device, adapters injected, fully_shard per block + root, activation checkpointing, frozen base
    stored bf16), trained with bf16 compute; then the merged export (fp32 merge, bf16 files) read back by
    plain transformers gives the trained model's logits."""
    from transformers import AutoModelForCausalLM

    from phalanx.core.sections import LoraSettings
    from phalanx.model.build import export_entries
    from phalanx.model.lora import merged_entries

    device, folder = info.device.type, tempfile.mkdtemp(prefix="phalanx-lora-base-")
    Builder(seed=2, device=info.device).build(lambda: causal_lm(cfg.model, cfg.data.vocab_size, 0)).to(
        torch.bfloat16).save_pretrained(folder)  # (on a GPU box the host has room for one whole base)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = _lora_model(cfg, info, folder)
    frozen = {n: p.detach().to_local().clone() for n, p in list(model.named_parameters())[:8] if not p.requires_grad}
    opt = build_optimizer(model, cfg.train)
    losses, grads = [], set()
    for _ in range(steps):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(input_ids=ids, use_cache=False).logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
        grads |= {n for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(float(loss.detach()), 4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    unchanged = all(torch.equal(model.get_parameter(n).detach().to_local(), v) for n, v in frozen.items())
    lora = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=folder, lora=LoraSettings(r=16)),
                               task="chat", train=dataclasses.replace(cfg.train, activation_checkpointing="full"))
    planned = memplan.estimate(lora, memplan.shapes(lora), 1, device, 0).peak
    out = tempfile.mkdtemp(prefix="phalanx-lora-export-")
    entries = merged_entries(model, export_entries(model.get_base_model()))
    write_hf(model.get_base_model(), type("NoTokenizer", (), {"save_pretrained": lambda self, o: None})(), out,
             info=info, dtype=torch.bfloat16, entries=entries)
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to(info.device).eval()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        diff = (model.eval()(input_ids=ids[:1, :256], use_cache=False).logits.float()
                - back(input_ids=ids[:1, :256], use_cache=False).logits.float()).abs().max().item()
    stored = [{str(p.dtype) for p in model.parameters() if p.requires_grad == t} for t in (False, True)]
    r = {"lora_losses": losses, "frozen_stored": sorted(stored[0]), "adapters_stored": sorted(stored[1]),
         "only_adapters_have_grads": grads == trainable,
         "optimizer_state_only_adapters": len(opt.state) == len(trainable),
         "frozen_unchanged": unchanged,
         "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / GB, 2) if device == "cuda" else None,
         "planned_gb": round(planned / GB, 2), "merged_export_max_abs_logit_diff": diff}
    print(json.dumps(r), flush=True)
    return (r["frozen_stored"] == ["torch.bfloat16"] and r["adapters_stored"] == ["torch.float32"]
            and r["only_adapters_have_grads"] and r["optimizer_state_only_adapters"] and r["frozen_unchanged"]
            and all(v == v for v in losses) and losses[-1] < losses[0] and diff < 0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist.free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    cuda = torch.cuda.is_available()  # without one: a small smoke run of the same code on the CPU (Gloo)
    info = dist.setup("nccl" if cuda else "gloo")
    device = info.device.type
    quiet_transformers()
    cfg = load_config(None, ["model.arch=llama", f"model.n_layer={args.layers}", f"model.n_embd={args.width}",
                             f"model.n_head={args.width // 128}", f"model.block_size={args.seq}",
                             "data.vocab_size=32000",
                             f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}",
                             "train.precision=bf16", "train.strategy=fsdp"], check_paths=False)
    shapes = memplan.shapes(cfg)
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(info.device)
    peak, source = peak_tflops(0.0, info.device, torch.bfloat16)
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke run)"
    fpt = flops_per_token(shapes.parameters, shapes.layers, shapes.hidden, args.seq)
    print(f"{name}: {shapes.parameters / 1e9:.2f} B parameters, batch {args.batch} x {args.seq}, "
          f"peak {peak} TFLOP/s ({source})", flush=True)
    ok, rows = True, []
    cases = (("none", False), ("full", False), ("full", True)) if cuda else (("none", False), ("full", False))
    for ckpt, offload in cases:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model = build(cfg, info, ckpt, offload)
        r = train(model, cfg, info, ids, args.steps)
        case = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, activation_checkpointing=ckpt))
        capacity = torch.cuda.get_device_properties(0).total_memory if cuda else 0
        plan = memplan.estimate(case, shapes, 1, device, capacity)
        tokens_s = args.batch * args.seq / r["step_s"]
        r.update(activation_checkpointing=ckpt, cpu_offload=offload, tokens_per_s=round(tokens_s),
                 mfu=round(fpt * tokens_s / 1e12 / peak, 4) if peak else None,
                 peak_allocated_gb=round(torch.cuda.max_memory_allocated() / GB, 2) if cuda else None,
                 peak_reserved_gb=round(torch.cuda.max_memory_reserved() / GB, 2) if cuda else None,
                 planned_gb=round(plan.peak / GB, 2) if not offload else None)
        ok &= all(v == v for v in r["losses"]) and r["losses"][-1] < r["losses"][0]
        ok &= r["param_dtype"] == "torch.float32" and r["optimizer_dtype"] == "torch.float32"
        rows.append(r)
        print(json.dumps(r), flush=True)
        if ckpt == "full" and not offload:  # the sharded export, read back by plain transformers
            from transformers import AutoModelForCausalLM

            folder = tempfile.mkdtemp(prefix="phalanx-export-")
            write_hf(model, type("NoTokenizer", (), {"save_pretrained": lambda self, o: None})(), folder, info=info,
                     shard_mb=512 if cuda else 1)
            back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(info.device).eval()
            with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
                diff = (model.eval()(input_ids=ids[:1, :256], use_cache=False).logits.float()
                        - back(input_ids=ids[:1, :256], use_cache=False).logits.float()).abs().max().item()
            files = len([f for f in os.listdir(folder) if f.startswith("model-")])
            print(json.dumps({"sharded_export_files": files, "max_abs_logit_diff": diff}), flush=True)
            ok &= files > 1 and diff < 0.1
            del back
        del model
    print("\n| activation ckpt | cpu offload | tokens/s | MFU | peak allocated GB | reserved GB | planned GB "
          "| step s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['activation_checkpointing']} | {r['cpu_offload']} | {r['tokens_per_s']} | "
              f"{r['mfu'] if r['mfu'] is not None else '-'} | {r['peak_allocated_gb']} | {r['peak_reserved_gb']} | "
              f"{r['planned_gb'] or '-'} | {r['step_s']:.3f} |")
    ok &= flash_attention_check(cfg, info, args.steps)
    ok &= lora_check(cfg, info, ids, args.steps)
    dist.teardown()
    print(f"gpu_big_check: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
