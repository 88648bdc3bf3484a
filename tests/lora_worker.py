"""One worker of tests/test_lora_fsdp.py, started by torch.distributed.run (Gloo, CPU):

    python -m torch.distributed.run --standalone --nproc-per-node N tests/lora_worker.py OUT BASE [STRATEGY]

Builds chat's LoRA model the trainer's way (ChatTask.build_model with model_builder: under fsdp on the meta
device, adapters injected, FSDP2 per block + root, a 16-bit frozen base), then writes to OUT for the test:
  init.safetensors        every adapter (and trainable-token row) after init, gathered (rank 0)
  rank<r>.json            dtypes of the stored frozen shards, adapters, gradients and AdamW state; which
                          parameters got a gradient and optimizer state; whether every frozen shard stayed
                          bit-identical over 3 optimizer steps; adapter rows this rank holds
  trained.safetensors     every adapter after the steps, gathered in memory (rank 0)
  final/, final-bf16/     ChatTask.export through run/export.export_final (merged fp32 / bf16 + final/adapter)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from phalanx.core import dist
from phalanx.core.config import load_config
from phalanx.core.runfolder import RunFolder
from phalanx.model import precision
from phalanx.model.build import model_builder, quiet_transformers
from phalanx.model.optim import build_optimizer
from phalanx.model.slices import local
from phalanx.model.weights import pretrained_dtype
from phalanx.run.export import export_final
from phalanx.tasks.chat import ChatTask

TEMPLATE_TOKENS = [3, 7]  # rows the base has that train as trainable tokens (besides the two grown ones)


def gathered(model) -> dict[str, torch.Tensor]:
    """Every trainable tensor whole, by all-gathering each rank's rows (independent of the export's code)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def build(info, base: str, strategy: str):
    from transformers import AutoTokenizer

    cfg = load_config(None, ["task=chat", f"model.pretrained={base}", "model.lora.r=4", "model.lora.alpha=8",
                             "model.lora.dropout=0", f"train.strategy={strategy}", "train.precision=bf16",
                             "train.lr=1e-2", "train.warmup_steps=0", "train.seed=11"], check_paths=False)
    task = ChatTask(cfg, info)
    task.tokenizer = AutoTokenizer.from_pretrained(base)
    task.tokenizer.add_special_tokens({"additional_special_tokens": ["<|a|>", "<|b|>"]})  # grows the vocabulary
    task.data = SimpleNamespace(template_tokens=TEMPLATE_TOKENS, end_of_turn=[len(task.tokenizer) - 1])
    frozen = precision.base_dtype(cfg.model, strategy, info.world_size, torch.bfloat16,
                                  lambda: pretrained_dtype(base))
    model = task.build_model(model_builder(cfg.train, info.device, info.world_size, torch.bfloat16, frozen))
    return cfg, task, model


def main() -> None:
    from safetensors.torch import save_file

    out, base = Path(sys.argv[1]), sys.argv[2]
    strategy = sys.argv[3] if len(sys.argv) > 3 else "fsdp"
    info = dist.setup("gloo", threads=1)
    quiet_transformers()
    cfg, task, model = build(info, base, strategy)
    init = gathered(model)
    if info.is_main:
        save_file(init, str(out / "init.safetensors"))
    frozen = {n: local(p).detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = build_optimizer(model, cfg.train)
    vocab = len(task.tokenizer)
    for step in range(3):
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(step * 10 + info.rank))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = {n: str(p.grad.dtype) for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: sorted({str(v.dtype) for k, v in s.items() if k != "step"})
             for p, s in optimizer.state.items()}
    report = {
        "frozen_stored": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad}),
        "adapters_stored": sorted({str(p.dtype) for p in model.parameters() if p.requires_grad}),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "with_grad": sorted(grads), "grad_dtypes": sorted(set(grads.values())),
        "with_state": sorted(state), "state_dtypes": sorted({d for v in state.values() for d in v}),
        "frozen_unchanged": all(torch.equal(local(p), frozen[n]) for n, p in model.named_parameters()
                                if not p.requires_grad),
        "frozen_count": len(frozen),
        "local_rows": {n: local(p).shape[0] for n, p in model.named_parameters() if p.requires_grad},
    }
    (out / f"rank{info.rank}.json").write_text(json.dumps(report))
    trained = gathered(model)
    if info.is_main:
        save_file(trained, str(out / "trained.safetensors"))
    for name, dtype in (("final", torch.float32), ("final-bf16", torch.bfloat16)):
        folder = RunFolder(out / name)
        export_final(model, task, folder, info, dtype=dtype)
    dist.barrier(info)
    dist.teardown()


if __name__ == "__main__":
    main()
