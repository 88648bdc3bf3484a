"""Typed config schema, YAML loading, dotted overrides and validation.

Every field carries its documentation in `metadata["help"]`; `phalanx config --show` prints it.
Errors are `ConfigError`: one line that names the key or file and what was expected.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from phalanx.core.errors import ConfigError  # also re-exported: `from phalanx.core.config import ConfigError`
from phalanx.core.faults import parse_fault
from phalanx.core.registry import TASKS
from phalanx.core.runfolder import write_text


class _Loader(yaml.SafeLoader):
    """YAML 1.2 scalars: only true/false are booleans ('off' stays a string), and 3e-4 is a float."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def _f(default, help: str, *, min=None, max=None, choices=None, path=False, factory=None):
    meta = {"help": help, "min": min, "max": max, "choices": choices, "path": path}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DataConfig:
    train: str = _f("", "training data: a file (.txt, .jsonl, .json, .csv, .parquet), a folder of them, "
                    "or 'hf:NAME[:CONFIG]' for a Hugging Face hub dataset; empty = built-in corpus "
                    "(Python standard-library docstrings, offline)", path=True)
    validation: str = _f("", "validation data (same forms as data.train); empty = hold out "
                         "data.val_fraction of the training data", path=True)
    val_fraction: float = _f(0.05, "fraction of the training data held out for validation when "
                             "data.validation is empty", min=0.0, max=0.5)
    format: str = _f("auto", "file format; auto = from the file extension",
                     choices=["auto", "text", "jsonl", "csv", "parquet"])
    text_field: str = _f("text", "field holding the text in JSONL/CSV/Parquet/hub data")
    text_pair_field: str = _f("", "classify: second text field for sentence pairs (e.g. hypothesis)")
    label_field: str = _f("label", "classify: field holding the label (int or string)")
    labels: list = _f(None, "classify: label names in class-id order; empty = discovered from the "
                      "training split (sorted)", factory=list)
    tokenizer: str = _f("", "tokenizer: a local folder with a Hugging Face tokenizer, or 'hf:NAME'; "
                        "empty = train a byte-level BPE (lm) or WordPiece (classify) tokenizer on the "
                        "training text", path=True)
    vocab_size: int = _f(4096, "vocabulary size of a tokenizer trained on the data", min=256, max=1_000_000)
    max_length: int = _f(128, "classify: truncate sequences to this many tokens", min=8, max=65536)
    group_by_length: str = _f("auto", "classify, and chat with data.packing=false: put sequences of similar "
                              "length into the same optimizer step (less padding, faster steps, but each step "
                              "sees one length band); auto = the task's choice by held-out quality at equal "
                              "steps (bench/order_quality.py): true for classify (accuracy unchanged, ~1/5 of "
                              "the padding), false for chat (length goes with content there: grouped steps "
                              "learned less)", choices=["auto", "true", "false"])
    cache_dir: str = _f("", "token cache folder; empty = $XDG_CACHE_HOME/phalanx or ~/.cache/phalanx. With "
                        "data.store_url: a local folder, the node-local cache of the remote store")
    store_url: str = _f("", "where prepared stores and their tokenizer are kept: an object-storage URL "
                        "(s3://bucket/prefix; gs://, az://, ... through fsspec's installed backends) or a shared "
                        "folder; empty = in data.cache_dir. Each node's workers read the shards through its "
                        "cache (data.cache_dir, data.cache_limit_gb). Moving a store does not change a run")
    cache_limit_gb: float = _f(0.0, "with data.store_url: the most disk the node-local cache of shards may use "
                               "(0 = no limit); it must hold the order's lookahead (exit 2 at start otherwise)",
                               min=0.0)
    order: str = _f("auto", "training sample order: global = one shuffle of the whole training set per epoch; "
                    "windowed = the shards in windows of data.order_window, the windows shuffled and the samples "
                    "shuffled within each (a cache smaller than the store keeps hitting); auto = windowed with "
                    "data.store_url, else global. Both are functions of (seed, epoch, position): the same on "
                    "any world size; a resumed run keeps the order its checkpoint recorded",
                    choices=["auto", "global", "windowed"])
    order_window: int = _f(8, "shards per window of the windowed order", min=1)
    shard_mb: float = _f(32.0, "input megabytes per piece of work and store shard, at most (a corpus is cut "
                         "into ~64 pieces of at least 1 MB so every core has work); memory per preparing "
                         "process is about twice this", min=0.001, max=4096.0)
    tokenizer_sample_mb: float = _f(32.0, "megabytes of training data (a deterministic sample spread over "
                                    "the corpus) a tokenizer is trained on", min=0.01, max=100_000.0)
    val_max_tokens: int = _f(5_000_000, "lm: at most this many tokens held out by data.val_fraction",
                             min=0)
    prepare_workers: int = _f(0, "processes that encode the data; 0 = the available cores", min=0)
    chat_format: str = _f("auto", "chat: record format; auto = from each record's keys (messages, "
                          "conversations, instruction, prompt)",
                          choices=["auto", "messages", "sharegpt", "alpaca", "prompt_completion"])
    messages_field: str = _f("", "chat: field with the list of turns; empty = 'messages' (messages format) or "
                             "'conversations' (sharegpt)")
    prompt_field: str = _f("", "chat: field with the prompt; empty = 'instruction' (alpaca) or 'prompt' "
                           "(prompt_completion); preference: the prompt of explicit pairs, empty = 'prompt'")
    input_field: str = _f("", "chat: alpaca's optional extra input, appended to the prompt; empty = 'input'")
    completion_field: str = _f("", "chat: field with the reply; empty = 'output' (alpaca) or 'completion' "
                               "(prompt_completion)")
    system_field: str = _f("", "chat: optional field with a system message (alpaca, prompt_completion); "
                           "empty = 'system'")
    train_on: str = _f("assistant", "chat: tokens that are training targets: every assistant message and its "
                       "end-of-turn token, only the last assistant message, or all tokens",
                       choices=["assistant", "last", "all"])
    truncation: str = _f("keep_end", "chat: a conversation longer than model.block_size keeps its end: keep_end "
                         "drops the oldest turns first (the system message stays), then cuts the first user turn "
                         "that is left from its start, and never cuts a reply (a record whose last exchange "
                         "still does not fit is dropped and counted); turns drops whole turns from the end (a "
                         "first exchange that is too long is cut on the right); right cuts on the right",
                         choices=["keep_end", "turns", "right"])
    max_dropped_fraction: float = _f(0.05, "chat: the most training records the data step may drop (too long "
                                     "for model.block_size, refused by the chat template, nothing left to learn) "
                                     "before it stops with exit 2; truncated records are kept and do not count",
                                     min=0.0, max=1.0)
    template_kwargs: dict = _f(None, "chat: keyword arguments for the chat template, e.g. {enable_thinking: "
                               "false} (Qwen3); used alike when preparing, in RUN/final's template and by "
                               "phalanx chat", factory=dict)
    system_message: str = _f("auto", "chat: system messages: keep = as the template renders them (a template "
                             "that refuses a system role is exit 2); fold = prepended to the first user turn "
                             "(blank line between); auto = keep where the template accepts a system role, "
                             "else fold", choices=["auto", "keep", "fold"])
    packing: bool = _f(True, "chat: pack whole conversations into rows of model.block_size tokens (each "
                       "attends only to itself); train.global_batch_size then counts rows. Off: one "
                       "conversation per row, padded per micro-batch, length-grouped. preference: whole pairs "
                       "(both replies) into rows of 2 x model.block_size; off: one pair (two padded rows) per "
                       "sample")
    pair_format: str = _f("auto", "preference: record format; explicit = prompt, chosen and rejected fields "
                          "(strings, or lists of messages); implicit = chosen and rejected whole conversations "
                          "whose shared first messages are the prompt; auto = explicit where a record has the "
                          "prompt field", choices=["auto", "explicit", "implicit"])
    chosen_field: str = _f("", "preference: field with the better reply (or conversation); empty = 'chosen'")
    rejected_field: str = _f("", "preference: field with the worse reply (or conversation); empty = 'rejected'")


@dataclass
class LoraSettings:
    r: int = _f(0, "LoRA rank; 0 = off (full fine-tuning)", min=0, max=4096)
    alpha: float = _f(16.0, "LoRA scaling numerator (the update is scaled by alpha / r)", min=0.0)
    dropout: float = _f(0.05, "dropout on the LoRA branch's input", min=0.0, max=0.9)
    target_modules: list = _f(None, "module names to adapt (e.g. c_attn,c_proj or q_proj,v_proj); empty = every "
                              "linear layer but the output head (peft's all-linear)", factory=list)


@dataclass
class PreferenceConfig:
    loss: str = _f("sigmoid", "the pair loss, as TRL 1.16's DPOTrainer defines each (d = the policy's minus the "
                   "reference's log-prob ratio of chosen over rejected): sigmoid (DPO) = -log sigmoid(beta d); "
                   "hinge = max(0, 1 - beta d); ipo = (d per token - 1/(2 beta))^2, each reply's log-ratio "
                   "divided by its token count; simpo (reference-free, TRL's CPOTrainer) = -log sigmoid(beta "
                   "(mean chosen log-prob - mean rejected log-prob) - simpo_gamma)",
                   choices=["sigmoid", "hinge", "ipo", "simpo"])
    beta: float = _f(0.1, "the loss's beta (IPO's tau)", min=1e-6)
    simpo_gamma: float = _f(0.5, "simpo: the target reward margin gamma", min=0.0)
    sft_weight: float = _f(0.0, "weight of an NLL term on the chosen replies (RPO-style), normalised by the "
                           "chosen tokens of the whole global batch; 0 = off", min=0.0)
    reference: str = _f("auto", "the reference model's log-probs: adapters_off = the policy with its LoRA "
                        "adapters disabled (no second copy; needs model.lora.r > 0); precomputed = one pass "
                        "before training writes them beside the prepared data, keyed by the base's content, the "
                        "data, template, truncation, precision and attention (reused by later runs, recomputed "
                        "when any differs); model = a frozen second copy built like the policy (sharded under "
                        "fsdp); auto = adapters_off under LoRA, else precomputed. simpo needs none",
                        choices=["auto", "adapters_off", "precomputed", "model"])
    reference_dtype: str = _f("fp32", "reference=model: the dtype the frozen copy is stored in (its compute "
                              "dtype is train.precision's)", choices=["fp32", "bf16", "fp16"])
    disable_dropout: bool = _f(True, "zero every dropout of the policy and of a reference=model copy, as TRL's "
                               "DPOConfig.disable_dropout (default true) does: every nn.Dropout's p (peft's LoRA "
                               "dropout included), and the float attention_dropout that the Llama-family attention "
                               "(llama, mistral, qwen2/3, gemma2/3, phi3) reads at forward time, which TRL's rule "
                               "misses. With dropout on, the first step's sigmoid loss is not log 2 and the "
                               "margins pick up noise. Task chat keeps the model's dropout, as TRL's SFT does")


@dataclass
class ModelConfig:
    arch: str = _f("gpt2", "architecture of a model built from scratch",
                   choices=["gpt2", "llama", "bert", "roberta", "distilbert"])
    pretrained: str = _f("", "start from a pretrained model: a local folder, 'hf:NAME', or a GGUF file "
                         "(llama.cpp, Ollama; 'hf:OWNER/REPO/FILE.gguf' fetches one from the hub), which the "
                         "launcher dequantises once to an fp32 folder in data.cache_dir's gguf/ that RUN/config.yaml "
                         "then names (the base's identity: the GGUF's sha256); empty = random init from the fields "
                         "below", path=True)
    n_layer: int = _f(4, "transformer blocks", min=1, max=512)
    n_head: int = _f(4, "attention heads", min=1, max=512)
    n_embd: int = _f(256, "hidden width (divisible by n_head)", min=8, max=65536)
    block_size: int = _f(128, "lm: tokens per training sequence (context length)", min=8, max=1_000_000)
    dropout: float = _f(0.0, "dropout probability (masks are seeded per micro-batch, so runs stay "
                        "identical across world sizes)", min=0.0, max=0.9)
    attn_implementation: str = _f("auto", "attention kernel of a transformers model: auto = the model's own "
                                  "default (sdpa where the architecture supports it, else eager); sdpa, eager, "
                                  "flex_attention (a GPU: no CPU backward), flash_attention_2 (the flash-attn "
                                  "package and a GPU); "
                                  "the start line says which one runs",
                                  choices=["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"])
    lora: LoraSettings = _f(None, "chat: low-rank adapters through peft (only they train; the base stays frozen)",
                            factory=LoraSettings)
    base_dtype: str = _f("auto", "LoRA: the dtype the frozen base weights are stored in (adapters, their "
                         "gradients and AdamW state stay fp32; the compute dtype is train.precision's): auto = the "
                         "pretrained checkpoint's own dtype under fsdp, or under ddp when train.precision computes "
                         "in 16 bit, else fp32; bf16/fp16 under ddp need a 16-bit train.precision. Full "
                         "fine-tuning keeps fp32 master weights", choices=["auto", "fp32", "bf16", "fp16"])


@dataclass
class TrainConfig:
    global_batch_size: int = _f(32, "sequences per optimizer step, over all processes", min=1)
    micro_batch_size: int = _f(8, "sequences per process per forward pass", min=1)
    max_steps: int = _f(300, "optimizer steps to train for", min=1)
    lr: float = _f(1e-3, "peak learning rate (AdamW)", min=0.0, max=10.0)
    min_lr_ratio: float = _f(0.1, "cosine decay ends at lr * min_lr_ratio", min=0.0, max=1.0)
    warmup_steps: int = _f(30, "linear warm-up steps before cosine decay", min=0)
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only; not biases or norms)", min=0.0)
    beta1: float = _f(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = _f(0.95, "AdamW beta2", min=0.0, max=1.0)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)", min=0.0)
    optimizer_impl: str = _f("auto", "AdamW implementation (speed only; the same math and state, so a "
                             "checkpoint resumes under any): auto = torch's fused kernel where torch supports "
                             "it for the parameters, else foreach on CUDA and the single-tensor loop elsewhere",
                             choices=["auto", "fused", "foreach", "loop"])
    seed: int = _f(1337, "seed for init, data order and dropout", min=0)
    log_every: int = _f(10, "optimizer steps between metric lines", min=1)
    eval_every: int = _f(100, "optimizer steps between evaluations (0 = only at the end)", min=0)
    eval_max_samples: int = _f(0, "evaluate on the first N validation samples (0 = all)", min=0)
    checkpoint_every: int = _f(0, "optimizer steps between checkpoints (0 = only at the end)", min=0)
    checkpoint_every_minutes: float = _f(0.0, "also checkpoint when this many minutes passed (0 = off)",
                                         min=0.0)
    keep_checkpoints: int = _f(2, "complete checkpoints to keep", min=1)
    precision: str = _f("fp32", "autocast precision; auto = bf16 where the hardware runs it natively "
                        "(CUDA compute capability >= 8.0, or a CPU with AVX512-BF16/AMX), else fp32; fp16 "
                        "adds a dynamic loss scaler whose state is checkpointed",
                        choices=["auto", "fp32", "bf16", "fp16"])
    tf32: bool = _f(False, "CUDA (Ampere and newer): run fp32 matrix multiplies and convolutions on TF32 tensor "
                    "cores (several times faster, 10-bit mantissa inputs, fp32 accumulation); torch's default is "
                    "off. No effect on CPU or on what autocast computes in bf16/fp16. Applied in every worker "
                    "(`torch.backends.cuda.matmul.allow_tf32` and `torch.backends.cudnn.allow_tf32`, both set to the "
                    "key's value) and shown in the start line (`tf32 on`/`off`) on CUDA")
    compile: bool = _f(False, "torch.compile the model for training steps (the uncompiled model is "
                       "saved, evaluated and exported)")
    strategy: str = _f("ddp", "data parallel strategy: ddp = full replica per process; fsdp = FSDP2 "
                       "fully_shard per transformer block, then the root (parameters, gradients and "
                       "optimizer state sharded; the model is built on the meta device and each process "
                       "materialises, initialises or loads only its own shards); checkpoints load into either",
                       choices=["ddp", "fsdp"])
    fsdp_sync: str = _f("micro_batch", "fsdp with gradient accumulation: when gradients are reduce-scattered. "
                        "micro_batch = after every micro-batch, so each rank accumulates only its shard of the "
                        "gradient (memory falls with the world size, as FSDP's point is); step = once, after the "
                        "step's last micro-batch (set_requires_gradient_sync(False) before it: every rank holds the "
                        "whole model's unsharded gradient until then, less communication, more memory). The same "
                        "update either way; ddp always all-reduces once per step", choices=["micro_batch", "step"])
    activation_checkpointing: str = _f("none", "recompute transformer blocks' activations in the backward pass "
                                       "instead of keeping them (less memory, ~1/3 more compute; same losses "
                                       "and gradients): none, full = every block, every_k = blocks 0, k, 2k, ... "
                                       "with k = train.activation_checkpointing_every",
                                       choices=["none", "full", "every_k"])
    activation_checkpointing_every: int = _f(2, "k of activation_checkpointing=every_k: checkpoint every k-th "
                                             "transformer block", min=1)
    cpu_offload: bool = _f(False, "fsdp on GPUs: keep parameter shards, their gradients and the optimizer state "
                           "in host memory (FSDP2's CPUOffloadPolicy; the optimizer step runs on the CPU); "
                           "exit 2 without a GPU")
    export_shard_mb: float = _f(2048.0, "RUN/final: a model larger than this many megabytes (in "
                                "train.export_dtype) is written "
                                "as sharded safetensors files of at most this size each, with "
                                "model.safetensors.index.json, by all processes in parallel, each tensor "
                                "gathered only to the process that writes it; smaller models are one "
                                "model.safetensors written by rank 0", min=0.001)
    export_dtype: str = _f("auto", "dtype of RUN/final's weights, cast from the fp32 master weights at export: "
                           "auto = the pretrained base's own dtype (its config.json / safetensors), fp32 when "
                           "training from scratch; fp32, bf16, fp16", choices=["auto", "fp32", "bf16", "fp16"])
    memory_check: str = _f("error", "when the memory plan (printed before workers start) says a rank will not fit "
                           "its GPU, or its share of host RAM on CPU: error = exit 2 naming the smallest change "
                           "that fits; warn = say so and start anyway", choices=["error", "warn"])
    nan_policy: str = _f("skip", "on a non-finite loss or gradient norm: skip the step or stop",
                         choices=["skip", "stop"])
    max_nan_skips: int = _f(5, "stop after this many consecutive skipped steps", min=1)


@dataclass
class DistConfig:
    backend: str = _f("auto", "process group backend; auto = nccl with CUDA, else gloo",
                      choices=["auto", "gloo", "nccl", "mpi"])
    threads_per_worker: int = _f(0, "CPU threads per process; 0 = available cores / local processes",
                                 min=0)
    keep_freed_memory: bool = _f(True, "glibc: keep freed memory for reuse (mmap threshold 32 MiB, trim "
                                 "threshold 1 GiB) instead of handing it back to the OS and faulting it in "
                                 "again every step; ~8% faster CPU steps here. Off, and always under fsdp "
                                 "(where memory per rank is the point): blocks of 1 MiB or more are mapped and "
                                 "unmapped, so a rank holds about its live tensors (kept memory grew each "
                                 "step: +1 GB per rank on a 306 M model)")
    startup_timeout_s: float = _f(300.0, "seconds allowed for start-up collectives", min=1.0)
    timeout_s: float = _f(600.0, "seconds a training step may make no progress before the hang "
                          "watchdog dumps stacks and stops the job", min=1.0)
    nccl_timeout_s: float = _f(0.0, "NCCL: seconds one collective may take before the process group "
                               "aborts it; 0 = the larger of startup_timeout_s and timeout_s, plus 60 (the "
                               "hang watchdog reports first)", min=0.0)
    nccl_async_error_handling: int = _f(3, "NCCL: what a failed or timed-out collective does "
                                        "(TORCH_NCCL_ASYNC_ERROR_HANDLING): 0 = nothing, 1 = abort the "
                                        "communicator and kill the process, 2 = abort only, 3 = kill the "
                                        "process without cleanup", choices=[0, 1, 2, 3])
    nccl_debug: str = _f("", "NCCL: NCCL_DEBUG log level; empty = leave it to the environment",
                         choices=["", "VERSION", "WARN", "INFO", "TRACE"])
    nccl_socket_ifname: str = _f("", "NCCL: network interfaces for bootstrap and sockets "
                                 "(NCCL_SOCKET_IFNAME, e.g. 'eth0' or '^lo,docker'); empty = NCCL's choice")


@dataclass
class LogConfig:
    tensorboard: bool = _f(False, "also write TensorBoard events to RUN/tensorboard")
    wandb_project: str = _f("", "also log to this Weights & Biases project (needs the wandb extra)")
    mlflow_experiment: str = _f("", "also log to this MLflow experiment (needs the mlflow extra)")
    progress: str = _f("auto", "progress bar on rank 0: auto = only on an interactive terminal",
                       choices=["auto", "bar", "lines", "off"])
    peak_tflops: float = _f(0.0, "peak dense TFLOP/s for MFU: of one GPU, or of one node's CPUs; 0 = a "
                            "built-in table for known GPUs (16-bit or fp32 by train.precision), no MFU on CPU",
                            min=0.0)
    telemetry: bool = _f(True, "per-rank cost accounting: gradient-communication timing (a DDP comm hook), "
                         "CPU/memory per rank, per-rank lists, straggler checks, FLOPs/MFU; off keeps loss, "
                         "rates and the step-time split")
    straggler_margin: float = _f(0.2, "a rank whose busy time per step exceeds the median over ranks by "
                                 "more than this fraction is slow in that log window", min=0.0)
    straggler_windows: int = _f(3, "consecutive slow log windows before a rank is named a straggler",
                                min=1)


@dataclass
class DebugConfig:
    fault: str = _f("", "test-only fault injection, e.g. 'kill:rank=1:step=5', 'raise:rank=0:step=3', "
                    "'sleep:rank=1:step=3:seconds=60', 'nan:step=4', 'slow:rank=1:step=0:seconds=0.05' "
                    "(sleeps in every step from step on), 'slow_reference:seconds=0.5' (sleeps in every "
                    "micro-batch of the precomputed reference pass; step is optional) (attempt=N limits it to "
                    "one elastic attempt, default 0)")


@dataclass
class Config:
    task: str = _f("lm", "what to train: " + "; ".join(f"{t.name} = {t.help}" for t in TASKS.values()),
                   choices=list(TASKS))
    name: str = _f("", "run name; default = the config file name, or 'default'")
    run_dir: str = _f("", "run folder; default = runs/<name>")
    resume: str = _f("auto", "auto = continue from the run folder's latest checkpoint if there is one; "
                     "never = start from scratch; or a checkpoint folder to start from")
    data: DataConfig = _f(None, "data sources and tokenization", factory=DataConfig)
    model: ModelConfig = _f(None, "model architecture or pretrained weights", factory=ModelConfig)
    train: TrainConfig = _f(None, "optimisation, batch, schedule and checkpoints", factory=TrainConfig)
    preference: PreferenceConfig = _f(None, "preference tuning (task: preference): the loss and the reference",
                                      factory=PreferenceConfig)
    dist: DistConfig = _f(None, "distributed settings", factory=DistConfig)
    log: LogConfig = _f(None, "logging sinks and progress display", factory=LogConfig)
    debug: DebugConfig = _f(None, "test-only hooks", factory=DebugConfig)


# Fields that change the training trajectory: a checkpoint is only resumed if these match.
TRAINING_RELEVANT = ("task", "data.train", "data.validation", "data.val_fraction", "data.val_max_tokens",
                     "data.tokenizer_sample_mb", "data.format",
                     "data.text_field", "data.text_pair_field", "data.label_field", "data.labels",
                     "data.chat_format", "data.messages_field", "data.prompt_field", "data.input_field",
                     "data.completion_field", "data.system_field", "data.train_on", "data.truncation",
                     "data.template_kwargs", "data.system_message", "data.pair_format", "data.chosen_field",
                     "data.rejected_field", "preference",
                     "data.packing", "data.order", "data.order_window",
                     "data.tokenizer", "data.vocab_size", "data.max_length", "data.group_by_length",
                     "model", "train.global_batch_size", "train.lr", "train.min_lr_ratio",
                     "train.warmup_steps", "train.weight_decay", "train.beta1", "train.beta2",
                     "train.grad_clip", "train.seed")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str):
    """Check `value` against the annotated type; ints are accepted for floats."""
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '3e-4' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is list:
        if isinstance(value, list):
            return [str(v) for v in value]
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
    elif tp is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        if value is None or value == "":
            return {}
    shown = type(value).__name__ if value is not None else "nothing"
    raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {shown} ({value!r})")


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': expected a mapping, "
                          f"got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}' (known: {', '.join(sorted(names))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        tp, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, raw[f.name] if raw[f.name] is not None else {}, key + ".")
        elif isinstance(raw[f.name], bool) and "true" in (f.metadata.get("choices") or ()):
            kwargs[f.name] = "true" if raw[f.name] else "false"  # YAML's true/false for an auto|true|false key
        else:
            kwargs[f.name] = _coerce(raw[f.name], tp, key)
    return cls(**kwargs)


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value, e.g. train.lr=3e-4")
    key, _, value = text.partition("=")
    try:
        parsed = _yaml(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        raw = _yaml(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        reason = str(e).replace("\n", " ")
        raise ConfigError(f"config file '{path}': not valid YAML ({reason})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file '{path}': expected a mapping at the top level")
    return raw


def load_config(path: str | None = None, overrides: list[str] = (), *, check_paths: bool = True) -> Config:
    """Load YAML (or the built-in default when `path` is None), apply overrides, validate."""
    raw = read_yaml(path) if path else {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    cfg = _build(Config, raw, "")
    if not cfg.name:
        cfg.name = Path(path).stem if path else "default"
    if not cfg.run_dir:
        cfg.run_dir = str(Path("runs") / cfg.name)
    validate(cfg, check_paths=check_paths)
    return cfg


def _walk(cfg, prefix=""):
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _walk(value, prefix + f.name + ".")
        else:
            yield prefix + f.name, f, value


def hub_name(spec: str) -> str:
    """'hf:NAME' (a Hugging Face hub name) -> 'NAME'; a local path stays as it is."""
    return spec[3:] if spec.startswith("hf:") else spec


def _check_path(key: str, value: str) -> None:
    if not value or value.startswith("hf:") or "://" in value:  # a hub name, or a URL listed when it is read
        return
    if not Path(value).exists():
        raise ConfigError(f"config key '{key}': file or folder '{value}' not found "
                          f"(use 'hf:NAME' for a hub name)")


def validate(cfg: Config, *, check_paths: bool = True) -> None:
    for key, f, value in _walk(cfg):
        meta = f.metadata
        if meta.get("choices") and value not in meta["choices"]:
            raise ConfigError(f"config key '{key}': expected one of {meta['choices']}, got {value!r}")
        if meta.get("min") is not None and value < meta["min"]:
            raise ConfigError(f"config key '{key}': must be >= {meta['min']}, got {value}")
        if meta.get("max") is not None and value > meta["max"]:
            raise ConfigError(f"config key '{key}': must be <= {meta['max']}, got {value}")
        if meta.get("path") and check_paths:
            _check_path(key, value)
    m, t = cfg.model, cfg.train
    if m.n_embd % m.n_head:
        raise ConfigError(f"config key 'model.n_embd': {m.n_embd} is not divisible by model.n_head={m.n_head}")
    if t.cpu_offload and t.strategy != "fsdp":
        raise ConfigError("config key 'train.cpu_offload': offloads FSDP2's shards; it needs train.strategy=fsdp")
    if m.base_dtype in ("bf16", "fp16") and not m.lora.r:
        raise ConfigError(f"config key 'model.base_dtype': {m.base_dtype} stores a frozen base, and only LoRA "
                          f"(model.lora.r > 0) freezes one; full fine-tuning keeps fp32 master weights")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(f"config key 'train.global_batch_size': {t.global_batch_size} is not a multiple "
                          f"of train.micro_batch_size={t.micro_batch_size}")
    if cfg.debug.fault:
        parse_fault(cfg.debug.fault)
    _check_extras(cfg.log)


def _check_extras(log: LogConfig) -> None:
    """An optional sink whose package is missing fails here, before any worker starts."""
    for key, enabled, module in (("log.tensorboard", log.tensorboard, "tensorboard"),
                                 ("log.wandb_project", log.wandb_project, "wandb"),
                                 ("log.mlflow_experiment", log.mlflow_experiment, "mlflow")):
        if enabled and importlib.util.find_spec(module) is None:
            raise ConfigError(f"config key '{key}': the {module} package is not installed "
                              f"(pip install 'phalanx[{module}]')")


def check_world(cfg: Config, world_size: int) -> int:
    """Gradient accumulation steps for this world size, or a ConfigError naming the fields."""
    t = cfg.train
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        raise ConfigError(f"config key 'train.global_batch_size': {t.global_batch_size} is not divisible by "
                          f"micro_batch_size ({t.micro_batch_size}) x world size ({world_size}) = {per_step}")
    return t.global_batch_size // per_step


def save_yaml(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))


def group_by_length(cfg: Config) -> bool:
    """data.group_by_length resolved for the config's task (auto = the task's own choice)."""
    return bool(_grouping(cfg.task, cfg.data.group_by_length))


def _grouping(task: str, value) -> bool | None:
    """The length grouping a task trains with; None where the key does not apply (lm). `value` as
    configured (auto|true|false) or as checkpoints before the auto choice recorded it (a bool)."""
    default = TASKS[task].group_by_length if task in TASKS else None
    if default is None:
        return None
    return default if value == "auto" else value in (True, "true")


def relevant_subset(cfg: Config) -> dict:
    flat = {}
    for key, _, value in _walk(cfg):
        if any(key == k or key.startswith(k + ".") for k in TRAINING_RELEVANT):
            flat[key] = value
    return comparable(flat)


def comparable(flat: dict) -> dict:
    """Training-relevant settings as they act: data.group_by_length resolved for the task (so a checkpoint
    that recorded `true` compares equal to today's `auto` where that means true)."""
    key = "data.group_by_length"
    if key in flat:
        flat = {**flat, key: _grouping(flat.get("task", "lm"), flat[key])}
    return flat


def config_hash(cfg: Config) -> str:
    blob = json.dumps(relevant_subset(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def describe(cls=Config, prefix: str = "") -> list[str]:
    """One line per field: dotted key, type, default and doc (feeds `phalanx config --show`)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"\n[{prefix}{f.name}]  {f.metadata['help']}")
            lines.extend(describe(tp, prefix + f.name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        extra = f"  one of {f.metadata['choices']}" if f.metadata.get("choices") else ""
        lines.append(f"  {prefix}{f.name} ({_type_name(tp)}, default {default!r}): {f.metadata['help']}{extra}")
    return lines


def describe_markdown(cls=Config, prefix: str = "") -> list[str]:
    """The same as `describe`, as Markdown table rows (the README's config section is generated from it)."""
    rows = [] if prefix else ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe_markdown(tp, prefix + f.name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = ", ".join(str(c) or "'' (unset)" for c in f.metadata.get("choices") or [])
        extra = f" One of: {shown}." if shown else ""
        doc = (f.metadata["help"] + "." + extra).replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {_type_name(tp)} | `{default!r}` | {doc} |")
    return rows
