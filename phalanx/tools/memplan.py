"""The memory plan: what one rank will hold at its peak, from the config alone, before any worker starts.
`phalanx doctor CONFIG` prints it, the launcher prints it in its start line and, when it does not fit,
stops (train.memory_check=error, exit 2) or warns, naming the smallest change that fits.

Per rank, for AdamW in fp32 master weights (P parameters, T of them trainable, S = the shard count: the
world size under FSDP, else 1):
    weights       (4 T + b (P - T)) / S        b = the bytes of the frozen base's stored dtype (LoRA:
                                               model.base_dtype, e.g. 2 for a bf16 base; else 4); FSDP: + the
                                               largest unit all-gathered, twice (prefetch)
    gradients     4 T / S
    optimizer     8 T / S                      (exp_avg, exp_avg_sq)
    extra         k · 4 T / S                  gradient-sized memory on top, where the allocator keeps
                                               freed memory (dist.keep_freed_memory, not under fsdp): at
                                               the optimizer step (what it kept from backward) and in
                                               backward; 0 where freed blocks go back to the OS (fsdp:
                                               run/memphases.py measured live tensors + runtime there)
    casts         2 (P - T)                    LoRA with an fp32 base under 16-bit autocast, unsharded: the
                                               16-bit cast of each frozen weight, saved for the backward
    activations   a · L · s · b · h            per micro-batch of b sequences of s tokens, L blocks of width h;
                                               with checkpointing: 4 · s · b · h per block (its input) + one
                                               block's a · s · b · h (its recompute)
    logits        12 · b · s · V               (token-level heads: fp32 logits, log-softmax, its gradient)
    runtime       the process itself (torch, transformers, Gloo/NCCL; on a GPU the CUDA context)
The peak is the larger of two moments: backward (weights, optimizer state, activations and logits, FSDP's
extra; DDP keeps its gradient buckets throughout, which are the gradients) and the optimizer step (weights,
gradients, optimizer state, extra). `a` (bytes per token per block per unit of width, fp32; bf16/fp16
autocast keeps about 0.6 of it) and `k` were fitted on bench/big_models.py's ladder (private memory per rank,
RssAnon: GPT-2 shapes of 311 M to 941 M parameters, 2 processes, block 512, ddp and fsdp, with and without
activation checkpointing; every rung within 10% of its measured peak) and on a small model's whole peak
(VmHWM, tests/test_memplan.py), which asks for a larger `a` (~200) than the ladder (~136): a = 160, k = 1.5.
Without `k` the plan of a checkpointed fsdp run, whose peak is the optimizer step, was 30% under its measured
peak. Llama's `a` keeps its measured ratio to GPT-2's (190 : 200).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from phalanx.core.config import Config, ConfigError, check_world, hub_name
from phalanx.core.registry import TASKS
from phalanx.model import precision
from phalanx.model.checkpointing import checkpointed_blocks

GB = 2 ** 30
# bytes of saved activations per (token x block x width unit), fp32, fitted on CPU (see the docstring)
ACTIVATION_BYTES = {"gpt2": 160.0, "llama": 152.0}
HALF_ACTIVATIONS = 0.6       # what bf16/fp16 autocast keeps of them
EXTRA = 1.5                  # k: gradient-sized memory on top (see the docstring)
# a worker before training here (~0.5 GB private, ~0.1 GB of its libraries' resident pages, which the
# whole-peak measure counts) / cuBLAS workspaces, allocator slack (unmeasured)
RUNTIME = {"cpu": 0.6 * GB, "cuda": 0.3 * GB}
# where freed memory goes back to the OS (fsdp): a CPU worker's own private memory (its build phase less its
# shards, run/memphases.py), and per parameter of the largest unit, what a full fine-tuning holds around it
# in backward beyond the two gathers (its unsharded gradient, the reduce-scatter's input and output): fitted
# on a 306 M GPT-2 at 2, 3, 4 processes (bench/memory_phases.py; checked on other shapes, LoRA, ddp)
RUNTIME_RETURNED_CPU = 0.35 * GB
UNIT_GRADIENT_BYTES = 18.0


@dataclass(frozen=True)
class Shapes:
    """What the plan needs of a model, read from its config on the meta device (nothing allocated)."""
    arch: str
    parameters: int
    trainable: int
    layers: int
    hidden: int
    vocab: int
    largest_unit: int    # parameters of the largest FSDP unit: a block, or the root (embeddings, head)
    saved_dtype: torch.dtype | None = None  # the pretrained checkpoint's dtype (a LoRA base may stay in it)


@dataclass
class Plan:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    runtime: float
    peak: float
    available: float
    device: str          # 'GPU' or 'process' (host RAM / local processes)

    @property
    def fits(self) -> bool:
        return self.peak <= self.available

    def line(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k) / GB:.2f}" for k in
                          ("weights", "gradients", "optimizer", "activations", "logits", "runtime"))
        return (f"memory plan: about {self.peak / GB:.2f} GB per rank at the peak ({parts} GB) vs "
                f"{self.available / GB:.2f} GB per {self.device}")


def shapes(cfg: Config) -> Shapes:
    import transformers  # only here: ~2 s, and only what the plan needs

    from phalanx.data.tokenizer import load_pretrained
    from phalanx.model.build import count_parameters
    from phalanx.model.shard import transformer_blocks
    from phalanx.tasks import get_task

    task = get_task(cfg.task)
    with torch.device("meta"):
        if cfg.model.pretrained:
            config = transformers.AutoConfig.from_pretrained(hub_name(cfg.model.pretrained), local_files_only=True)
            model = getattr(transformers, task.AUTO_MODEL).from_config(config)
        else:  # the workers size the vocabulary by the tokenizer: data.vocab_size only trains one
            vocab = len(load_pretrained(cfg.data.tokenizer, local_files_only=True)) if cfg.data.tokenizer else \
                cfg.data.vocab_size
            model = task.model_for(cfg, vocab, 0)
    mc = model.config
    blocks = transformer_blocks(model)
    per_block = max((count_parameters(b) for b in blocks), default=0)
    total = count_parameters(model)
    root = total - sum(count_parameters(b) for b in blocks)
    return Shapes(arch=mc.model_type, parameters=total, trainable=_trainable(model, cfg, total),
                  layers=mc.num_hidden_layers, hidden=mc.hidden_size, vocab=mc.vocab_size,
                  largest_unit=max(per_block, root), saved_dtype=_saved_dtype(cfg))


def _saved_dtype(cfg: Config) -> torch.dtype | None:
    """A local pretrained folder's dtype (its config.json, else its weights' headers); None otherwise."""
    from phalanx.model.weights import checkpoint_dtype

    folder = Path(hub_name(cfg.model.pretrained)) if cfg.model.pretrained else None
    return checkpoint_dtype(folder) if folder and folder.is_dir() else None


def _trainable(model, cfg: Config, total: int) -> int:
    """LoRA: r x (in + out) per adapted linear layer (all but the head when no names are given); else all."""
    lora = cfg.model.lora
    if not lora.r:
        return total
    count = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        is_linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        wanted = any(name.endswith(t) for t in lora.target_modules) if lora.target_modules else \
            name.rsplit(".", 1)[-1] not in ("lm_head", "score")
        if is_linear and weight is not None and wanted:
            count += lora.r * sum(weight.shape)
    return count


def estimate(cfg: Config, s: Shapes, world: int, device: str, available: float) -> Plan:
    t = cfg.train
    shard = world if t.strategy == "fsdp" and world > 1 else 1
    half = t.precision in ("bf16", "fp16") or (t.precision == "auto" and device == "cuda")
    per_token = ACTIVATION_BYTES.get(s.arch, max(ACTIVATION_BYTES.values())) * (HALF_ACTIVATIONS if half else 1.0)
    tokens = t.micro_batch_size * _sequence(cfg)
    checkpointed = len(checkpointed_blocks(s.layers, t.activation_checkpointing, t.activation_checkpointing_every))
    # a checkpointed block keeps its input, and one block is recomputed at a time; the others as without it
    kept = s.layers - checkpointed
    activations = (4 * checkpointed + per_token * (kept + (1 if checkpointed else 0))) * tokens * s.hidden
    logits = 12.0 * tokens * s.vocab if TASKS[cfg.task].token_logits else 0.0
    # LoRA: the frozen base in its stored dtype (model.base_dtype), the adapters fp32
    frozen = precision.base_dtype(cfg.model, t.strategy, world, _compute_dtype(t.precision, device),
                                  lambda: s.saved_dtype)
    stored = 4.0 * s.trainable + (frozen.itemsize if frozen else 4.0) * (s.parameters - s.trainable)
    weights = stored / shard + (_unit_transients(cfg, s, device) if shard > 1 else 0.0)
    # 16-bit autocast over a frozen fp32 base (LoRA, ddp): each weight's 16-bit cast is saved for backward
    compute = _compute_dtype(t.precision, device)
    casts = compute.itemsize * (s.parameters - s.trainable) if compute and not frozen and shard == 1 and \
        cfg.model.lora.r else 0.0
    gradients, optimizer = 4.0 * s.trainable / shard, 8.0 * s.trainable / shard
    buckets = gradients if t.strategy == "ddp" and world > 1 else 0.0  # DDP keeps its gradient buckets
    runtime = RUNTIME["cuda"] if device == "cuda" else \
        RUNTIME["cpu"] if kept_memory(cfg) else RUNTIME_RETURNED_CPU
    extra = EXTRA if kept_memory(cfg) else 0.0
    backward = weights + optimizer + buckets + activations + casts + logits + \
        (extra * gradients if shard > 1 else 0.0)
    step = weights + gradients + optimizer + extra * gradients
    peak = runtime + max(backward, step)
    return Plan(weights, gradients, optimizer, activations, logits, runtime, peak, available,
                "GPU" if device == "cuda" else "process")


def _unit_transients(cfg: Config, s: Shapes, device: str) -> float:
    """FSDP2: the largest unit gathered twice (prefetch) in the compute dtype (its param_dtype), and where
    the unit trains (full fine-tuning; LoRA's adapters are a sliver of it) its gradients' buffers."""
    compute = _compute_dtype(cfg.train.precision, device)
    gathered = 2 * (compute.itemsize if compute else 4.0)
    if kept_memory(cfg):  # the fitted k covers gradient-sized memory there
        return gathered * s.largest_unit
    return (gathered + UNIT_GRADIENT_BYTES * s.trainable / s.parameters) * s.largest_unit


def kept_memory(cfg: Config) -> bool:
    """Does the worker's allocator keep freed memory (dist.keep_freed_memory: not under fsdp)? Kept memory is
    what `k` stands for; a rank that returns it holds about its live tensors."""
    return cfg.dist.keep_freed_memory and cfg.train.strategy != "fsdp"


def _compute_dtype(requested: str, device: str) -> torch.dtype | None:
    try:
        return precision.check_precision(requested, device)[0]
    except ConfigError:  # the launcher says why; the plan goes on as fp32
        return None


def _sequence(cfg: Config) -> int:
    from phalanx.tasks import get_task

    return get_task(cfg.task).sequence_length(cfg)


def available(device: str, local_world: int, gpu_bytes: float | None = None) -> float:
    """Memory one rank may use: its GPU's, or this host's available RAM shared by the local processes."""
    if device == "cuda":
        return float(gpu_bytes or 0.0)
    return psutil.virtual_memory().available / max(local_world, 1)


def suggest(cfg: Config, s: Shapes, world: int, device: str, avail: float) -> str | None:
    """The smallest change that fits: activation checkpointing, fsdp, a smaller micro-batch with the same
    global batch, then these together; None when nothing listed fits."""
    t = cfg.train
    options = []
    if t.activation_checkpointing == "none":
        options.append(("train.activation_checkpointing=full", {"activation_checkpointing": "full"}))
    if t.strategy == "ddp" and world > 1:  # LoRA too: what FSDP2 shards then is the frozen base
        options.append(("train.strategy=fsdp", {"strategy": "fsdp"}))
    m = t.micro_batch_size // 2
    while m >= 1:
        if t.global_batch_size % (m * world) == 0:
            options.append((f"train.micro_batch_size={m} (global batch unchanged: more accumulation)",
                            {"micro_batch_size": m}))
        m //= 2
    singles = list(options)
    for (a, ca), (b, cb) in ((x, y) for i, x in enumerate(singles) for y in singles[i + 1:]):
        if set(ca) & set(cb):
            continue
        options.append((f"{a} and {b}", {**ca, **cb}))
    for text, change in options:
        trial = dataclasses.replace(cfg, train=dataclasses.replace(t, **change))
        if estimate(trial, s, world, device, avail).fits:
            return text
    return None


def check(cfg: Config, world: int, local_world: int, device: str, gpu_bytes: float | None = None,
          say=print) -> Plan | None:
    """The launcher's memory plan: said in one line; a plan that does not fit is exit 2 (memory_check=error)
    or a warning, naming the smallest change that fits. None when the model's shapes cannot be read
    (e.g. a hub model not in the local cache: the loaders will say so)."""
    check_world(cfg, world)
    try:
        s = shapes(cfg)
    except Exception as e:  # shapes only; the real loaders report the real problem
        say(f"phalanx: memory plan: skipped (cannot read the model's shapes: {type(e).__name__})")
        return None
    plan = estimate(cfg, s, world, device, available(device, local_world, gpu_bytes))
    say(f"phalanx: {plan.line()}")
    if not plan.fits:
        fix = suggest(cfg, s, world, device, plan.available)
        text = (f"the memory plan does not fit: about {plan.peak / GB:.2f} GB per rank, {plan.available / GB:.2f} GB "
                f"per {plan.device}; " + (f"try {fix}" if fix else "use a smaller model, more processes or a larger "
                                                                 "device"))
        if cfg.train.memory_check == "error":
            raise ConfigError(f"config key 'train.memory_check': {text} (or train.memory_check=warn to try anyway)")
        say(f"phalanx: warning: {text}")
    return plan


def _gpu_memory_child(queue) -> None:
    queue.put([(torch.cuda.get_device_name(i), *torch.cuda.mem_get_info(i)) for i in range(torch.cuda.device_count())])


def gpu_memory() -> list[tuple[str, int, int]]:
    """(name, free bytes, total bytes) of every visible GPU, read in a child process that exits before any
    worker starts: a CUDA context held by the launcher or doctor (~0.5 GB on every GPU) would make
    exclusive-process GPUs refuse the workers. `free` is net of one context (the child's), which is what
    a worker will also need, so nothing more is subtracted for it."""
    if not torch.cuda.is_available():  # device_count/is_available ask NVML: no context here
        return []
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_gpu_memory_child, args=(queue,), daemon=True)
    child.start()
    try:
        return queue.get(timeout=120)
    finally:
        child.join(timeout=10)
