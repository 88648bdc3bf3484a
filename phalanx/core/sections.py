"""The config sections every task shares: data, model, train, dist, log, debug (each a dataclass whose fields
carry their documentation in `metadata["help"]`, which `phalanx config --show` prints). A task's own keys
are in its section (task_sections.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field


def setting(default, help: str, *, min=None, max=None, choices=None, path=False, factory=None, boolean=None):
    """A config key. `boolean`: for a key of named choices, the (true, false) choices a YAML true/false given to it
    would mean (the error says so; the key stays a name)."""
    meta = {"help": help, "min": min, "max": max, "choices": choices, "path": path, "boolean": boolean}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DataConfig:
    """Where the data is, how it is read, tokenized, stored and ordered: what every task shares (a task's own
    record format and fields are in its section)."""
    train: str = setting("", "training data: a file (.txt, .jsonl, .json, .csv, .parquet), a folder of them, or "
                         "'hf:NAME[:CONFIG]' for a Hugging Face hub dataset; empty = built-in corpus (Python "
                         "standard-library docstrings, offline)", path=True)
    validation: str = setting("", "validation data (same forms as data.train); empty = hold out data.val_fraction of "
                              "the training data", path=True)
    val_fraction: float = setting(0.05, "fraction of the training data held out for validation when data.validation "
                                  "is empty", min=0.0, max=0.5)
    format: str = setting("auto", "file format; auto = from the file extension (.conll: CoNLL, a word and its tag "
                          "per line, for token_classify)", choices=["auto", "text", "jsonl", "csv", "parquet", "conll"])
    text_field: str = setting("text", "field holding the text in JSONL/CSV/Parquet/hub data")
    tokenizer: str = setting("", "tokenizer: a local folder with a Hugging Face tokenizer, or 'hf:NAME'; empty = "
                             "train a byte-level BPE (lm) or WordPiece (classify) tokenizer on the training text",
                             path=True)
    vocab_size: int = setting(4096, "vocabulary size of a tokenizer trained on the data", min=256, max=1_000_000)
    group_by_length: str = setting("auto", "classify, and chat with data.packing=false: put sequences of similar "
                                   "length into the same optimizer step (less padding, faster steps, but each step "
                                   "sees one length band); auto = the task's choice by held-out quality at equal "
                                   "steps (bench/order_quality.py): true for classify (accuracy unchanged, ~1/5 of "
                                   "the padding), false for chat (length goes with content there: grouped steps "
                                   "learned less)", choices=["auto", "true", "false"])
    cache_dir: str = setting("", "token cache folder; empty = $XDG_CACHE_HOME/phalanx or ~/.cache/phalanx. With "
                             "data.store_url: a local folder, the node-local cache of the remote store")
    store_url: str = setting("", "where prepared stores and their tokenizer are kept: an object-storage URL "
                             "(s3://bucket/prefix; gs://, az://, ... through fsspec's installed backends) or a shared "
                             "folder; empty = in data.cache_dir. Each node's workers read the shards through its "
                             "cache (data.cache_dir, data.cache_limit_gb). Moving a store does not change a run")
    cache_limit_gb: float = setting(0.0, "with data.store_url: the most disk the node-local cache of shards may use "
                                    "(0 = no limit); it must hold the order's lookahead (exit 2 at start otherwise)",
                                    min=0.0)
    order: str = setting("auto", "training sample order: global = one shuffle of the whole training set per epoch; "
                         "windowed = the shards in windows of data.order_window, the windows shuffled and the samples "
                         "shuffled within each (a cache smaller than the store keeps hitting); auto = windowed with "
                         "data.store_url, else global. Both are functions of (seed, epoch, position): the same on any "
                         "world size; a resumed run keeps the order its checkpoint recorded",
                         choices=["auto", "global", "windowed"])
    order_window: int = setting(8, "shards per window of the windowed order", min=1)
    shard_mb: float = setting(32.0, "input megabytes per piece of work and store shard, at most (a corpus is cut into "
                              "~64 pieces of at least 1 MB so every core has work); memory per preparing process is "
                              "about twice this", min=0.001, max=4096.0)
    tokenizer_sample_mb: float = setting(32.0, "megabytes of training data (a deterministic sample spread over the "
                                         "corpus) a tokenizer is trained on", min=0.01, max=100_000.0)
    prepare_workers: int = setting(0, "processes that encode the data; 0 = the available cores", min=0)
    max_dropped_fraction: float = setting(0.05, "chat, preference: the most training records the data step may drop "
                                          "(too long for model.block_size, refused by the chat template, nothing left "
                                          "to learn) before it stops with exit 2; truncated records are kept and do "
                                          "not count", min=0.0, max=1.0)
    packing: bool = setting(True, "chat: pack whole conversations into rows of model.block_size tokens (each attends "
                            "only to itself); train.global_batch_size then counts rows. Off: one conversation per "
                            "row, padded per micro-batch, length-grouped. preference: whole pairs (both replies) into "
                            "rows of 2 x model.block_size; off: one pair (two padded rows) per sample")


@dataclass
class LoraSettings:
    r: int = setting(0, "LoRA rank; 0 = off (full fine-tuning)", min=0, max=4096)
    alpha: float = setting(16.0, "LoRA scaling numerator (the update is scaled by alpha / r)", min=0.0)
    dropout: float = setting(0.05, "dropout on the LoRA branch's input", min=0.0, max=0.9)
    target_modules: list = setting(None, "module names to adapt (e.g. c_attn,c_proj or q_proj,v_proj); empty = every "
                                   "linear layer but the output head (peft's all-linear)", factory=list)


# model.attn_implementation's choices: the model's own default, then transformers' kernels by name
ATTENTION = ["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"]


@dataclass
class ModelConfig:
    arch: str = setting("gpt2", "architecture of a model built from scratch",
                        choices=["gpt2", "llama", "bert", "roberta", "distilbert"])
    pretrained: str = setting("", "start from a pretrained model: a local folder, 'hf:NAME', or a GGUF file "
                              "(llama.cpp, Ollama; 'hf:OWNER/REPO/FILE.gguf' fetches one from the hub), which the "
                              "launcher dequantises once to an fp32 folder in data.cache_dir's gguf/ that "
                              "RUN/config.yaml then names (the base's identity: the GGUF's sha256); empty = random "
                              "init from the fields below", path=True)
    n_layer: int = setting(4, "transformer blocks", min=1, max=512)
    n_head: int = setting(4, "attention heads", min=1, max=512)
    n_embd: int = setting(256, "hidden width (divisible by n_head)", min=8, max=65536)
    block_size: int = setting(128, "lm: tokens per training sequence (context length)", min=8, max=1_000_000)
    dropout: float = setting(0.0, "dropout probability (masks seeded per micro-batch: alike at any world size)",
                             min=0.0, max=0.9)
    attn_implementation: str = setting("auto", "attention kernel of a transformers model: auto = the model's own "
                                       "default (sdpa where the architecture supports it, else eager); sdpa, eager, "
                                       "flex_attention (a GPU: no CPU backward), flash_attention_2 (the flash-attn "
                                       "package and a GPU); the start line says which one runs",
                                       choices=ATTENTION)
    lora: LoraSettings = setting(None, "chat: low-rank adapters through peft (only they train; the base stays frozen)",
                                 factory=LoraSettings)
    base_dtype: str = setting("auto", "LoRA: the dtype the frozen base weights are stored in (adapters, their "
                              "gradients and AdamW state stay fp32; the compute dtype is train.precision's): auto = "
                              "the pretrained checkpoint's own dtype under fsdp, or under ddp when train.precision "
                              "computes in 16 bit, else fp32; bf16/fp16 under ddp need a 16-bit train.precision. Full "
                              "fine-tuning keeps fp32 master weights", choices=["auto", "fp32", "bf16", "fp16"])


@dataclass
class TrainConfig:
    global_batch_size: int = setting(32, "sequences per optimizer step, over all processes", min=1)
    micro_batch_size: int = setting(8, "sequences per process per forward pass", min=1)
    max_steps: int = setting(300, "optimizer steps to train for", min=1)
    lr: float = setting(1e-3, "peak learning rate (AdamW)", min=0.0, max=10.0)
    min_lr_ratio: float = setting(0.1, "cosine decay ends at lr * min_lr_ratio", min=0.0, max=1.0)
    warmup_steps: int = setting(30, "linear warm-up steps before cosine decay", min=0)
    weight_decay: float = setting(0.1, "AdamW weight decay (matrices only; not biases or norms)", min=0.0)
    beta1: float = setting(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = setting(0.95, "AdamW beta2", min=0.0, max=1.0)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0 = off)", min=0.0)
    optimizer_impl: str = setting("auto", "AdamW implementation (speed only; the same math and state, so a checkpoint "
                                  "resumes under any): auto = torch's fused kernel where torch supports it for the "
                                  "parameters, else foreach on CUDA and the single-tensor loop elsewhere",
                                  choices=["auto", "fused", "foreach", "loop"])
    seed: int = setting(1337, "seed for init, data order and dropout", min=0)
    log_every: int = setting(10, "optimizer steps between metric lines", min=1)
    eval_every: int = setting(100, "optimizer steps between evaluations (0 = only at the end)", min=0)
    eval_max_samples: int = setting(0, "evaluate on the first N validation samples (0 = all)", min=0)
    checkpoint_every: int = setting(0, "optimizer steps between checkpoints (0 = only at the end)", min=0)
    checkpoint_every_minutes: float = setting(0.0, "also checkpoint when this many minutes passed (0 = off)", min=0.0)
    keep_checkpoints: int = setting(2, "complete checkpoints to keep", min=1)
    precision: str = setting("fp32", "autocast precision; auto = bf16 where the hardware runs it natively (CUDA "
                             "compute capability >= 8.0, or a CPU with AVX512-BF16/AMX), else fp32; fp16 adds a "
                             "dynamic loss scaler whose state is checkpointed",
                             choices=["auto", "fp32", "bf16", "fp16"])
    tf32: bool = setting(False, "CUDA (Ampere and newer): run fp32 matrix multiplies and convolutions on TF32 tensor "
                         "cores (several times faster, 10-bit mantissa inputs, fp32 accumulation); torch's default is "
                         "off. No effect on CPU or on what autocast computes in bf16/fp16. Applied in every worker "
                         "(`torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32`, both set to "
                         "the key's value) and shown in the start line (`tf32 on`/`off`) on CUDA")
    compile: bool = setting(False, "torch.compile the model for training steps (the uncompiled model is saved, "
                            "evaluated and exported)")
    strategy: str = setting("ddp", "data parallel strategy: ddp = full replica per process; fsdp = FSDP2 fully_shard "
                            "per transformer block, then the root (parameters, gradients and optimizer state sharded; "
                            "the model is built on the meta device and each process materialises, initialises or "
                            "loads only its own shards); checkpoints load into either", choices=["ddp", "fsdp"])
    fsdp_sync: str = setting("micro_batch", "fsdp with gradient accumulation: when gradients are reduce-scattered. "
                             "micro_batch = after every micro-batch, so each rank accumulates only its shard of the "
                             "gradient (memory falls with the world size, as FSDP's point is); step = once, after the "
                             "step's last micro-batch (set_requires_gradient_sync(False) before it: every rank holds "
                             "the whole model's unsharded gradient until then, less communication, more memory). The "
                             "same update either way; ddp always all-reduces once per step",
                             choices=["micro_batch", "step"])
    activation_checkpointing: str = setting("none", "recompute transformer blocks' activations in the backward pass "
                                            "instead of keeping them (less memory, ~1/3 more compute; same losses and "
                                            "gradients): none, full = every block, every_k = blocks 0, k, 2k, ... "
                                            "with k = train.activation_checkpointing_every",
                                            choices=["none", "full", "every_k"], boolean=("full", "none"))
    activation_checkpointing_every: int = setting(2, "k of every_k: checkpoint every k-th transformer block", min=1)
    cpu_offload: bool = setting(False, "fsdp on GPUs: keep parameter shards, their gradients and the optimizer state "
                                "in host memory (FSDP2's CPUOffloadPolicy; the optimizer step runs on the CPU); exit "
                                "2 without a GPU")
    export_shard_mb: float = setting(2048.0, "RUN/final: a model larger than this many megabytes (in "
                                     "train.export_dtype) is written as sharded safetensors files of at most this "
                                     "size each, with model.safetensors.index.json, by all processes in parallel, "
                                     "each tensor gathered only to the process that writes it; smaller models are one "
                                     "model.safetensors written by rank 0", min=0.001)
    export_dtype: str = setting("auto", "dtype of RUN/final's weights, cast from the fp32 master weights at export: "
                                "auto = the pretrained base's own dtype (its config.json / safetensors), fp32 when "
                                "training from scratch; fp32, bf16, fp16", choices=["auto", "fp32", "bf16", "fp16"])
    memory_check: str = setting("error", "when the memory plan (printed before workers start) says a rank will not "
                                "fit its GPU, or its share of host RAM on CPU: error = exit 2 naming the smallest "
                                "change that fits; warn = say so and start anyway", choices=["error", "warn"])
    nan_policy: str = setting("skip", "on a non-finite loss or gradient norm: skip the step or stop",
                              choices=["skip", "stop"])
    max_nan_skips: int = setting(5, "stop after this many consecutive skipped steps", min=1)


@dataclass
class DistConfig:
    backend: str = setting("auto", "process group backend; auto = nccl with CUDA, else gloo",
                           choices=["auto", "gloo", "nccl", "mpi"])
    threads_per_worker: int = setting(0, "CPU threads per process; 0 = available cores / local processes", min=0)
    keep_freed_memory: bool = setting(True, "glibc: keep freed memory for reuse (mmap threshold 32 MiB, trim "
                                      "threshold 1 GiB) instead of handing it back to the OS and faulting it in again "
                                      "every step; ~8% faster CPU steps here. Off, and always under fsdp (where "
                                      "memory per rank is the point): blocks of 1 MiB or more are mapped and "
                                      "unmapped, so a rank holds about its live tensors (kept memory grew each step: "
                                      "+1 GB per rank on a 306 M model)")
    startup_timeout_s: float = setting(300.0, "seconds allowed for start-up collectives", min=1.0)
    timeout_s: float = setting(600.0, "seconds a training step may make no progress before the hang watchdog dumps "
                               "stacks and stops the job", min=1.0)
    nccl_timeout_s: float = setting(0.0, "NCCL: seconds one collective may take before the process group aborts it; 0 "
                                    "= the larger of startup_timeout_s and timeout_s, plus 60 (the hang watchdog "
                                    "reports first)", min=0.0)
    nccl_async_error_handling: int = setting(3, "NCCL: what a failed or timed-out collective does "
                                             "(TORCH_NCCL_ASYNC_ERROR_HANDLING): 0 = nothing, 1 = abort the "
                                             "communicator and kill the process, 2 = abort only, 3 = kill the process "
                                             "without cleanup", choices=[0, 1, 2, 3])
    nccl_debug: str = setting("", "NCCL: NCCL_DEBUG log level; empty = leave it to the environment",
                              choices=["", "VERSION", "WARN", "INFO", "TRACE"])
    nccl_socket_ifname: str = setting("", "NCCL: network interfaces for bootstrap and sockets (NCCL_SOCKET_IFNAME, "
                                      "e.g. 'eth0' or '^lo,docker'); empty = NCCL's choice")


@dataclass
class LogConfig:
    tensorboard: bool = setting(False, "also write TensorBoard events to RUN/tensorboard")
    wandb_project: str = setting("", "also log to this Weights & Biases project (needs the wandb extra)")
    mlflow_experiment: str = setting("", "also log to this MLflow experiment (needs the mlflow extra)")
    progress: str = setting("auto", "progress bar on rank 0: auto = only on an interactive terminal",
                            choices=["auto", "bar", "lines", "off"], boolean=("bar", "off"))
    peak_tflops: float = setting(0.0, "peak dense TFLOP/s for MFU: of one GPU, or of one node's CPUs; 0 = a built-in "
                                 "table for known GPUs (16-bit or fp32 by train.precision), no MFU on CPU", min=0.0)
    telemetry: bool = setting(True, "per-rank cost accounting: gradient-communication timing (a DDP comm hook), "
                              "CPU/memory per rank, per-rank lists, straggler checks, FLOPs/MFU; off keeps loss, "
                              "rates and the step-time split")
    straggler_margin: float = setting(0.2, "a rank whose busy time per step exceeds the median over ranks by more "
                                      "than this fraction is slow in that log window", min=0.0)
    straggler_windows: int = setting(3, "consecutive slow log windows before a rank is named a straggler", min=1)


@dataclass
class DebugConfig:
    fault: str = setting("", "test-only fault injection, e.g. 'kill:rank=1:step=5', 'raise:rank=0:step=3', "
                         "'sleep:rank=1:step=3:seconds=60', 'nan:step=4', 'slow:rank=1:step=0:seconds=0.05' (sleeps "
                         "in every step from step on), 'slow_reference:seconds=0.5' (sleeps in every micro-batch of "
                         "the precomputed reference pass; step is optional) (attempt=N limits it to one elastic "
                         "attempt, default 0)")
