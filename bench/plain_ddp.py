"""The reference: a plain hand-written DDP loop (init_process_group + DDP + DistributedSampler + set_epoch).

Run with torchrun. Trains the benchmark GPT-2 on a token array (phalanx's token store written out as one .npy)
and prints one JSON line per step with a wall-clock timestamp, so bench/vs_plain_ddp.py can compute
tokens/s and time-to-first-step exactly as it does for phalanx.
"""
import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel


class Blocks(Dataset):
    def __init__(self, tokens, block):
        self.tokens, self.block = tokens, block

    def __len__(self):
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i):
        return torch.from_numpy(self.tokens[i * self.block: i * self.block + self.block + 1].astype(np.int64))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    # Defaults = phalanx's on CPU (fused AdamW, clip 1.0): the reference gets the same optimizer kernel.
    p.add_argument("--optimizer", choices=["fused", "foreach", "loop"], default="fused")
    p.add_argument("--clip", type=float, default=1.0, help="0 = no clipping")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=a.vocab, n_positions=128, n_embd=256, n_layer=4, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{"fused": {"fused": True}, "foreach": {"foreach": True},
                                                            "loop": {"foreach": False}}[a.optimizer])
    data = Blocks(np.load(a.tokens, mmap_mode="r"), 128)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=a.micro, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < a.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = ddp(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
            loss.backward()
            if a.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0:
                print(json.dumps({"step": step, "time_s": time.time(), "tokens": a.micro * 128 * world,
                                  "loss": loss.item()}), flush=True)
            if step >= a.steps:
                break
        epoch += 1
    del ddp, opt, model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
