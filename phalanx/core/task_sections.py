"""Each task's own config section: the keys only that task reads (its record format and fields, its
loss), so that no key means two things. `template` is the chat template's, read alike by every task that
renders conversations with it (chat, preference). The registry (core/registry.py) says which sections a
task reads; `phalanx config task=TASK --show` prints those.
"""
from __future__ import annotations

from dataclasses import dataclass

from phalanx.core.sections import setting


@dataclass
class LMConfig:
    """task lm."""
    val_max_tokens: int = setting(5_000_000, "at most this many tokens held out by data.val_fraction", min=0)


@dataclass
class ClassifyConfig:
    """task classify: its fields and its length limit."""
    text_pair_field: str = setting("", "second text field for sentence pairs (e.g. hypothesis); the first is "
                                   "data.text_field")
    label_field: str = setting("label", "field holding the label (int or string)")
    labels: list = setting(None, "label names in class-id order; empty = discovered from the training split (sorted)",
                           factory=list)
    max_length: int = setting(128, "truncate sequences to this many tokens", min=8, max=65536)


@dataclass
class ChatConfig:
    """task chat: its record formats and fields, what trains, and truncation."""
    format: str = setting("auto", "record format; auto = from each record's keys (messages, conversations, "
                          "instruction, prompt)",
                          choices=["auto", "messages", "sharegpt", "alpaca", "prompt_completion"])
    messages_field: str = setting("", "field with the list of turns; empty = 'messages' (messages format) or "
                                  "'conversations' (sharegpt)")
    prompt_field: str = setting("", "field with the prompt; empty = 'instruction' (alpaca) or 'prompt' "
                                "(prompt_completion)")
    input_field: str = setting("", "alpaca's optional extra input, appended to the prompt; empty = 'input'")
    completion_field: str = setting("", "field with the reply; empty = 'output' (alpaca) or 'completion' "
                                    "(prompt_completion)")
    system_field: str = setting("", "optional field with a system message (alpaca, prompt_completion); empty = "
                                "'system'")
    train_on: str = setting("assistant", "tokens that are training targets: every assistant message and its "
                            "end-of-turn token, only the last assistant message, or all tokens",
                            choices=["assistant", "last", "all"])
    truncation: str = setting("keep_end", "a conversation longer than model.block_size keeps its end: keep_end drops "
                              "the oldest turns first (the system message stays), then cuts the first user turn that "
                              "is left from its start, and never cuts a reply (a record whose last exchange still "
                              "does not fit is dropped and counted); turns drops whole turns from the end (a first "
                              "exchange that is too long is cut on the right); right cuts on the right. (Preference "
                              "tuning always keeps the end, cutting the prompt alone)",
                              choices=["keep_end", "turns", "right"])


@dataclass
class TemplateConfig:
    """The chat template, for every task that renders with it (chat, preference)."""
    kwargs: dict = setting(None, "keyword arguments for the chat template, e.g. {enable_thinking: false} (Qwen3); "
                           "used alike when preparing, in RUN/final's template and by phalanx chat", factory=dict)
    system_message: str = setting("auto", "system messages: keep = as the template renders them (a template that "
                                  "refuses a system role is exit 2); fold = prepended to the first user turn (blank "
                                  "line between); auto = keep where the template accepts a system role, else fold",
                                  choices=["auto", "keep", "fold"])


@dataclass
class PreferenceConfig:
    """task preference: its records (pairs) and its loss, reference and dropout."""
    format: str = setting("auto", "record format; explicit = prompt, chosen and rejected fields (strings, or lists of "
                          "messages); implicit = chosen and rejected whole conversations whose shared first messages "
                          "are the prompt; auto = explicit where a record has preference.prompt_field",
                          choices=["auto", "explicit", "implicit"])
    prompt_field: str = setting("", "explicit pairs: field with the prompt; empty = 'prompt'")
    chosen_field: str = setting("", "field with the better reply (or conversation); empty = 'chosen'")
    rejected_field: str = setting("", "field with the worse reply (or conversation); empty = 'rejected'")
    system_field: str = setting("", "explicit pairs: optional field with a system message; empty = 'system'")
    loss: str = setting("sigmoid", "the pair loss, as TRL 1.16's DPOTrainer defines each (d = the policy's minus the "
                        "reference's log-prob ratio of chosen over rejected): sigmoid (DPO) = -log sigmoid(beta d); "
                        "hinge = max(0, 1 - beta d); ipo = (d per token - 1/(2 beta))^2, each reply's log-ratio "
                        "divided by its token count; simpo (reference-free, TRL's CPOTrainer) = -log sigmoid(beta "
                        "(mean chosen log-prob - mean rejected log-prob) - simpo_gamma)",
                        choices=["sigmoid", "hinge", "ipo", "simpo"])
    beta: float = setting(0.1, "the loss's beta (IPO's tau)", min=1e-6)
    simpo_gamma: float = setting(0.5, "simpo: the target reward margin gamma", min=0.0)
    sft_weight: float = setting(0.0, "weight of an NLL term on the chosen replies (RPO-style), normalised by the "
                                "chosen tokens of the whole global batch; 0 = off", min=0.0)
    reference: str = setting("auto", "the reference model's log-probs: adapters_off = the policy with its LoRA "
                             "adapters disabled (no second copy; needs model.lora.r > 0); precomputed = one pass "
                             "before training writes them beside the prepared data, keyed by the base's content, the "
                             "data, template, truncation, precision and attention (reused by later runs, recomputed "
                             "when any differs); model = a frozen second copy built like the policy (sharded under "
                             "fsdp); auto = adapters_off under LoRA, else precomputed. simpo needs none",
                             choices=["auto", "adapters_off", "precomputed", "model"])
    reference_dtype: str = setting("fp32", "reference=model: the dtype the frozen copy is stored in (its compute "
                                   "dtype is train.precision's)", choices=["fp32", "bf16", "fp16"])
    disable_dropout: bool = setting(True, "zero every dropout of the policy and of a reference=model copy, as TRL's "
                                    "DPOConfig.disable_dropout (default true) does: every nn.Dropout's p (peft's LoRA "
                                    "dropout included), and the float attention_dropout that the Llama-family "
                                    "attention (llama, mistral, qwen2/3, gemma2/3, phi3) reads at forward time, which "
                                    "TRL's rule misses. With dropout on, the first step's sigmoid loss is not log 2 "
                                    "and the margins pick up noise. Task chat keeps the model's dropout, as TRL's SFT "
                                    "does")
