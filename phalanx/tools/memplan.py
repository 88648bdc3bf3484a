"""The memory plan: what one rank will hold at its peak, from the config alone, before any worker starts.
`phalanx doctor CONFIG` prints it, the launcher prints it in its start line and, when it does not fit,
stops (train.memory_check=error, exit 2) or warns, naming the smallest change that fits.

Per rank, for AdamW in fp32 master weights (P parameters, T of them trainable, S = the shard count: the
world size under FSDP, else 1; a micro-batch of b sequences of s tokens, L blocks of width h):
    weights       (4 T + b' (P - T)) / S       b' = the bytes of the frozen base's stored dtype (LoRA:
                                               model.base_dtype, e.g. 2 for a bf16 base; else 4); FSDP: + what
                                               its units gather, in the compute dtype: the root unit (embeddings,
                                               head; FSDP2 keeps it unsharded from its forward through the
                                               backward) once and the largest block twice (prefetch)
    gradients     4 T / S
    optimizer     8 T / S                      (exp_avg, exp_avg_sq)
    held          what backward starts with of gradients: DDP its buckets (4 T, which the gradients are) and
                                               with accumulation also the gradients the no_sync micro-batches
                                               accumulated apart (4 T; the last backward copies them into the
                                               buckets); FSDP with accumulation: train.fsdp_sync=micro_batch
                                               the accumulated shard (4 T / S), fsdp_sync=step every unit's
                                               unsharded fp32 gradient (4 T: FSDP2 accumulates in its reduce
                                               dtype); one process with accumulation 4 T
    unit grads    u · the largest unit        FSDP where units train: at the end of backward its unsharded
                                               gradient, the reduce-scatter's input and output
    casts         2 (P - T)                    LoRA with an fp32 base under 16-bit autocast, unsharded: the
                                               16-bit cast of each frozen weight, saved for the backward
    activations   f · L · b · s · c            c = the bytes a block saves for backward per token (autograd's
                                               saved tensors, counted with saved-tensor hooks): GPT-2
                                               4 (8 h + 5 I), with dropout + 16 h + 12 heads · s (its attention
                                               takes torch's math path); Llama-like 4 (8 h + 2 kv + 4 I) (I the
                                               MLP's width, kv the keys'); other architectures 112 h. LoRA: +
                                               5 bytes per input of each adapted layer (the adapters' path keeps
                                               it and its 1-byte dropout mask). f = memory per byte saved:
                                               HEAP_FACTOR where a block's tensors (b · s · h · 4 bytes) fall
                                               under glibc's mmap threshold and come from its heaps, where freed
                                               space is reused only in part (1 MiB under fsdp, which returns
                                               freed memory; 32 MiB under ddp, which keeps it; the adapters'
                                               small tensors always), MAPPED_FACTOR at or above it. With
                                               checkpointing: 4 · s · b · h per block (its input) + one block's
                                               recompute; bf16/fp16 autocast: 0.6 of it
    logits        the output head (model/head.py: only positions with a target, in chunks of fp32 logits
                                               of at most head.CHUNK_BYTES): LOGIT_CHUNKS chunks of
                                               min(N, head.chunk_rows(V)) · V · 4 bytes, the N selected hidden
                                               states and their gradient (8 N h) and, where the head trains
                                               (full fine-tuning), HEAD_WEIGHT_GRADIENTS V x H fp32 tensors in
                                               backward (its weight's gradient summed over the chunks, one
                                               chunk's product). N = b · s (every position: chat supervises
                                               fewer). A head model/head.py does not fuse: 12 N V (its logits at
                                               the targets, log-softmax, gradient)
    runtime       the process itself: on CPU 0.35 GB (a worker's build phase less its shards measured
                                               0.28-0.32 GB); on a GPU its CUDA context, 0.3 GB (unmeasured)
The peak is the largest of three moments: backward's start (weights, optimizer state, held, activations,
logits, casts), FSDP's end of backward (weights, optimizer state, gradients, unit grads) and the optimizer
step (weights, gradients, optimizer state).

The constants HEAP_FACTOR = 1.85, MAPPED_FACTOR = 0.95 and u = 8 bytes were fitted (the smallest largest
relative error on the fit set, then the least RMS) against the steps' private peak per rank (the largest
rank's summary.json private_peak_mb/steps; bench/memory_phases.py, this 2-core CPU, fp32, 2-3 steps) of:
    fitted     GPT-2 306 M (24 x 1024, vocabulary 4096) fsdp, block 64: 2, 3, 4 processes, and 4 with
               accumulation 2 in both fsdp_sync modes; GPT-2 311 M fsdp, 2 processes, block 512;
               SmolLM2-135M-Instruct (real weights) ddp, 2 processes, block 128, full and LoRA r=16
               (each within 8%)
    held out   SmolLM2 fsdp (block 128 and 512; full and LoRA) and ddp block 512 (full and LoRA); GPT-2
               116 M ddp (2 processes with accumulation 2; LoRA at 3), 205 M fsdp (3), 311 M fsdp with
               activation checkpointing, 477 M fsdp (2, accumulation 2); Llama 116 M ddp (3; 2 with
               accumulation 2), 272 M fsdp (3 with accumulation 2 in both modes; 4; LoRA at 2), 398 M fsdp
               (4, accumulation 2), 529 M fsdp (2, accumulation 2): each within 12%
docs/benchmarks.md's memory-plan table lists each with its plan / peak and command. The logits constants are
read from model/head.py's code, not fitted; the runtime is the build phase's measure. Before the head ran in chunks
(a 12 b s V term) and before fsdp reduced every micro-batch, the plan said 2.69 GB for a SmolLM2 LoRA run
that peaked at 3.4-3.6 GB, and 1.80 GB for the 306 M GPT-2 with accumulation that peaked at 2.87 GB (issue
31); the plan before this refit, on the runs above: 0.67-1.51 of their peaks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from phalanx.core.config import Config, ConfigError, check_world, hub_name
from phalanx.core.registry import TASKS
from phalanx.model import head, precision
from phalanx.model.checkpointing import checkpointed_blocks

GB = 2 ** 30
# memory per byte a block saves for backward (block_activation_bytes), fitted (see the docstring): tensors
# from glibc's heaps, under its mmap threshold (dist.return_freed_memory's 1 MiB under fsdp,
# dist.keep_freed_memory's 32 MiB), where freed space is reused only in part / tensors mapped on their own
HEAP_FACTOR = 1.85
MAPPED_FACTOR = 0.95
RETURNED_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD = 1 << 20, 32 << 20
# other architectures (encoders): bytes a block saves per (token x width unit), fp32, as a GPT-2 block
# without dropout does (unmeasured for them)
ACTIVATION_BYTES = 112.0
HALF_ACTIVATIONS = 0.6       # what bf16/fp16 autocast keeps of them
# a worker's own private memory before training here (its build phase less its tensors, run/memphases.py)
# / cuBLAS workspaces, allocator slack (unmeasured)
RUNTIME = {"cpu": 0.35 * GB, "cuda": 0.3 * GB}
# FSDP, where units train: bytes per parameter of the largest unit at the end of backward (its unsharded
# gradient, the reduce-scatter's input and output), fitted
UNIT_GRADIENT_BYTES = 8.0
# the output head (model/head.py), read from its code: chunks of fp32 logits alive at once (one chunk's
# logits and its log-sum-exp's exponentials in forward; in backward its logits turned gradient in place), and
# where the head trains V x H fp32 tensors in backward (the weight's gradient being summed over the chunks,
# one chunk's product)
LOGIT_CHUNKS = 3.0
HEAD_WEIGHT_GRADIENTS = 2.0


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
    heads: int = 0       # attention heads
    intermediate: int = 0  # the MLP's inner width
    kv_width: int = 0    # keys' (and values') width: key/value heads x head dim (grouped-query attention)
    block: int = 0       # parameters of the largest transformer block (an FSDP unit)
    root: int = 0        # parameters outside the blocks (embeddings, final norm, head: the root FSDP unit)
    lora_inputs: int = 0  # LoRA: the input widths of one block's adapted layers, summed
    dropout: float = 0.0  # the model's own dropout (GPT-2's attention and residual dropout)


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
    hidden, heads = mc.hidden_size, getattr(mc, "num_attention_heads", 0) or 0
    kv_heads = getattr(mc, "num_key_value_heads", None) or heads
    head_dim = getattr(mc, "head_dim", None) or (hidden // heads if heads else 0)
    inner = getattr(mc, "intermediate_size", None) or getattr(mc, "n_inner", None) or 4 * hidden
    trainable, lora_inputs = _trainable(model, cfg, total)
    return Shapes(arch=mc.model_type, parameters=total, trainable=trainable,
                  layers=mc.num_hidden_layers, hidden=hidden, vocab=mc.vocab_size,
                  largest_unit=max(per_block, root), saved_dtype=_saved_dtype(cfg), heads=heads,
                  intermediate=inner, kv_width=kv_heads * head_dim, block=per_block, root=root,
                  lora_inputs=lora_inputs // max(len(blocks), 1),
                  dropout=max(float(getattr(mc, k, 0.0) or 0.0) for k in ("attn_pdrop", "resid_pdrop")))


def _saved_dtype(cfg: Config) -> torch.dtype | None:
    """A local pretrained folder's dtype (its config.json, else its weights' headers); None otherwise."""
    from phalanx.model.weights import checkpoint_dtype

    folder = Path(hub_name(cfg.model.pretrained)) if cfg.model.pretrained else None
    return checkpoint_dtype(folder) if folder and folder.is_dir() else None


def _trainable(model, cfg: Config, total: int) -> tuple[int, int]:
    """LoRA: r x (in + out) per adapted linear layer (all but the head when no names are given), and the
    adapted layers' input widths summed; else all the parameters, 0."""
    lora = cfg.model.lora
    if not lora.r:
        return total, 0
    count = inputs = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        conv1d = type(module).__name__ == "Conv1D"  # GPT-2's: weight is in x out
        wanted = any(name.endswith(t) for t in lora.target_modules) if lora.target_modules else \
            name.rsplit(".", 1)[-1] not in ("lm_head", "score")
        if (isinstance(module, torch.nn.Linear) or conv1d) and weight is not None and wanted:
            count += lora.r * sum(weight.shape)
            inputs += weight.shape[0] if conv1d else weight.shape[1]
    return count, inputs


def estimate(cfg: Config, s: Shapes, world: int, device: str, available: float) -> Plan:
    t = cfg.train
    shard = world if t.strategy == "fsdp" and world > 1 else 1
    half = t.precision in ("bf16", "fp16") or (t.precision == "auto" and device == "cuda")
    rows, seq = _rows(cfg)
    tokens = t.micro_batch_size * rows * seq
    block, adapters = block_activation_bytes(s, seq, cfg.model.lora)
    # LoRA's adapter path keeps small tensors (1-byte dropout masks, rank-r outputs): from the heaps
    per_token = (block * activation_factor(cfg, s, tokens, device, half) + adapters * HEAP_FACTOR) * \
        (HALF_ACTIVATIONS if half else 1.0)
    checkpointed = len(checkpointed_blocks(s.layers, t.activation_checkpointing, t.activation_checkpointing_every))
    # a checkpointed block keeps its input, and one block is recomputed at a time; the others as without it
    kept = s.layers - checkpointed
    activations = 4 * checkpointed * tokens * s.hidden + per_token * (kept + (1 if checkpointed else 0)) * tokens
    logits = head_bytes(s, tokens, trains_head=not cfg.model.lora.r) if TASKS[cfg.task].token_logits else 0.0
    # LoRA: the frozen base in its stored dtype (model.base_dtype), the adapters fp32
    frozen = precision.base_dtype(cfg.model, t.strategy, world, _compute_dtype(t.precision, device),
                                  lambda: s.saved_dtype)
    stored = 4.0 * s.trainable + (frozen.itemsize if frozen else 4.0) * (s.parameters - s.trainable)
    gathers, unit_gradients = _unit_transients(cfg, s, device) if shard > 1 else (0.0, 0.0)
    weights = stored / shard + gathers
    # 16-bit autocast over a frozen fp32 base (LoRA, ddp): each weight's 16-bit cast is saved for backward
    compute = _compute_dtype(t.precision, device)
    casts = compute.itemsize * (s.parameters - s.trainable) if compute and not frozen and shard == 1 and \
        cfg.model.lora.r else 0.0
    gradients, optimizer = 4.0 * s.trainable / shard, 8.0 * s.trainable / shard
    # what backward starts with of gradients. DDP: its buckets (the gradients, which they are); with
    # accumulation, the micro-batches under no_sync accumulate into gradients of their own (zero_grad sets
    # them to None), which the last micro-batch's backward copies into the buckets: both, at its start. FSDP
    # with accumulation, from the second micro-batch on, the gradient accumulated so far:
    # fsdp_sync=step every unit's unsharded fp32 gradient (FSDP2 accumulates in its reduce dtype) until the
    # last micro-batch, micro_batch this rank's shard of it. One process: its accumulated gradients.
    accumulating = check_world(cfg, world) > 1
    held = gradients if accumulating else 0.0
    if t.strategy == "ddp" and world > 1:
        held += gradients
    elif shard > 1 and accumulating and t.fsdp_sync == "step":
        held = 4.0 * s.trainable
    runtime = RUNTIME["cuda" if device == "cuda" else "cpu"]
    # three moments: backward's start (every activation saved, the head's transients), backward's end under
    # fsdp (the whole sharded gradient and the last unit's gradient buffers), the optimizer step
    start = weights + optimizer + held + activations + casts + logits
    end = weights + optimizer + gradients + unit_gradients
    step = weights + gradients + optimizer
    peak = runtime + max(start, end, step)
    return Plan(weights, gradients, optimizer, activations, logits, runtime, peak, available,
                "GPU" if device == "cuda" else "process")


def block_activation_bytes(s: Shapes, seq: int, lora) -> tuple[float, float]:
    """Bytes one transformer block saves for its backward per token, fp32, as autograd keeps them (counted with
    saved-tensor hooks on these shapes): the block's own (tensors of width h, of the MLP's width I and of the
    keys' and values' width kv; GPT-2 with dropout takes torch's math-path attention, which keeps heads x seq
    scores per token) and, under LoRA, its adapters' (each adapted layer's input on the adapters' path and,
    with LoRA dropout, its 1-byte mask). Other architectures: ACTIVATION_BYTES per unit of width."""
    h, inner = s.hidden, s.intermediate or 4 * s.hidden
    if s.arch == "gpt2":
        block = 4.0 * (8 * h + 5 * inner) + (16.0 * h + 12.0 * s.heads * seq if s.dropout else 0.0)
    elif s.arch in head.FUSED_TYPES:  # Llama-like blocks: attention with q/k/v/o, a gated MLP
        block = 4.0 * (8 * h + 2 * (s.kv_width or h) + 4 * inner)
    else:
        block = ACTIVATION_BYTES * h
    adapters = (5.0 if lora.dropout else 4.0) * s.lora_inputs if lora.r else 0.0
    return block, adapters


def activation_factor(cfg: Config, s: Shapes, tokens: int, device: str, half: bool) -> float:
    """What a block's saved tensors take in memory, per byte: where its activations (tensors of tokens x h)
    are smaller than glibc's mmap threshold they come from its heaps, where freed space is reused only in
    part (HEAP_FACTOR); at or above it each is mapped and unmapped on its own (MAPPED_FACTOR: the transients
    of backward alone). The threshold: 1 MiB where freed memory goes back (dist.return_freed_memory, fsdp),
    32 MiB where it is kept (dist.keep_freed_memory). A GPU's caching allocator counts as mapped (unmeasured)."""
    if device == "cuda":
        return MAPPED_FACTOR
    threshold = KEPT_MMAP_THRESHOLD if kept_memory(cfg) else RETURNED_MMAP_THRESHOLD
    return MAPPED_FACTOR if (2 if half else 4) * tokens * s.hidden >= threshold else HEAP_FACTOR


def head_bytes(s: Shapes, targets: int, trains_head: bool) -> float:
    """What the output head holds per micro-batch of `targets` positions with a target (model/head.py; the
    plan takes every position of the micro-batch): for the families whose head is fused there, a few chunks of
    fp32 logits (each at most head.CHUNK_BYTES), the selected hidden states and their gradient and, where the
    head trains, the weight's gradient being summed over the chunks and one chunk's product of that size;
    for another architecture the model's own logits at the selected positions, their log-softmax and gradient
    (fp32: 12 bytes per target per vocabulary entry)."""
    if s.arch not in head.FUSED_TYPES:
        return 12.0 * targets * s.vocab
    rows = min(targets, head.chunk_rows(s.vocab))
    weight = HEAD_WEIGHT_GRADIENTS * 4.0 * s.vocab * s.hidden if trains_head else 0.0
    return LOGIT_CHUNKS * 4.0 * rows * s.vocab + 2 * 4.0 * targets * s.hidden + weight


def _unit_transients(cfg: Config, s: Shapes, device: str) -> tuple[float, float]:
    """FSDP2: what its units hold beyond the shards. Gathered, in the compute dtype (its param_dtype): the
    root unit (FSDP2 keeps the root unsharded from its forward through the backward) and the largest block
    twice (prefetch). Where the units train (full fine-tuning; LoRA's adapters are a sliver of them), the
    gradient buffers of the largest unit at the end of backward (its unsharded gradient, the
    reduce-scatter's input and output)."""
    compute = _compute_dtype(cfg.train.precision, device)
    itemsize = compute.itemsize if compute else 4.0
    block = s.block or s.largest_unit
    gathered = itemsize * (s.root + 2 * block)
    return gathered, UNIT_GRADIENT_BYTES * s.trainable / s.parameters * max(block, s.root)


def kept_memory(cfg: Config) -> bool:
    """Does the worker's allocator keep freed memory (dist.keep_freed_memory: not under fsdp)? Its mmap
    threshold is then 32 MiB, so a block's activations come from glibc's heaps (activation_factor)."""
    return cfg.dist.keep_freed_memory and cfg.train.strategy != "fsdp"


def _compute_dtype(requested: str, device: str) -> torch.dtype | None:
    try:
        return precision.check_precision(requested, device)[0]
    except ConfigError:  # the launcher says why; the plan goes on as fp32
        return None


def _rows(cfg: Config) -> tuple[int, int]:
    """Rows one sample of a micro-batch trains on (task grpo: its G completions), and their length."""
    from phalanx.tasks import get_task

    task = get_task(cfg.task)
    return task.rows_per_sample(cfg), task.sequence_length(cfg)


def available(device: str, local_world: int, gpu_bytes: float | None = None) -> float:
    """Memory one rank may use: its GPU's, or this host's available RAM shared by the local processes."""
    if device == "cuda":
        return float(gpu_bytes or 0.0)
    return psutil.virtual_memory().available / max(local_world, 1)


def suggest(cfg: Config, s: Shapes, world: int, device: str, avail: float) -> str | None:
    """The smallest change that fits: fsdp's gradient reduced every micro-batch (the same update), activation
    checkpointing, fsdp, a smaller micro-batch with the same global batch, then these together; None when
    nothing listed fits."""
    t = cfg.train
    options = []
    if t.strategy == "fsdp" and t.fsdp_sync == "step" and world > 1:
        options.append(("train.fsdp_sync=micro_batch", {"fsdp_sync": "micro_batch"}))
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
