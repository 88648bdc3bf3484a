"""`phalanx generate`: sample a continuation from a finished language-model run (RUN/final).

Only the sample goes to stdout (model loading is silenced), so the output can be piped.
"""
from __future__ import annotations

import sys

import torch

from phalanx.core.config import ConfigError, load_config
from phalanx.core.registry import check_command
from phalanx.core.runfolder import EXIT_OK, RunFolder
from phalanx.model.build import load_causal_lm


def add_arguments(p) -> None:
    """Flags of `phalanx generate` (cli.py dispatches here)."""
    p.add_argument("run", help="run folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    folder = RunFolder(args.run)
    if folder.config.is_file():  # a run folder (a bare Hugging Face folder has no config: taken as is)
        check_command(load_config(str(folder.config), check_paths=False).task, "generate", args.run)
    if not folder.final.is_dir():
        raise ConfigError(f"run '{args.run}': no final/ model (has the run finished?)")
    print(generate(args.run, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    return EXIT_OK


def generate(run_dir: str, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8,
             top_k: int = 50, seed: int = 0) -> str:
    """Sample a continuation of `prompt` from RUN/final (a plain transformers model)."""
    model, tokenizer = load_causal_lm(RunFolder(run_dir).final)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    torch.manual_seed(seed)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if limit and ids.shape[1] + max_new_tokens > limit:
        # the context holds prompt and sample: the prompt keeps its end, at least half goes to the sample
        ids = ids[:, -max(limit - max_new_tokens, limit // 2):]
        max_new_tokens = limit - ids.shape[1]
        print(f"phalanx: the sample is limited to {max_new_tokens} new tokens (the model has {limit} positions)",
              file=sys.stderr)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature or None, top_k=top_k,
                             pad_token_id=tokenizer.eos_token_id, attention_mask=torch.ones_like(ids))
    return tokenizer.decode(out[0], skip_special_tokens=True)

