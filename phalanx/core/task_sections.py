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


@dataclass
class GRPOConfig:
    """task grpo: its prompts, generation, rewards and loss (defaults are TRL 1.16's GRPOConfig's)."""
    prompt_field: str = setting("prompt", "field with the prompt: text (one user turn) or a list of messages; every "
                                "other field of the record goes to the reward functions")
    system_field: str = setting("system", "optional field with a system message (text prompts)")
    num_generations: int = setting(8, "completions per prompt (G); all G of a prompt are generated and trained on one "
                                   "rank", min=2, max=1024)
    max_completion_length: int = setting(512, "most tokens a completion may have (TRL's default 512; one that reaches "
                                         "it is truncated); a prompt longer than model.block_size minus this is cut "
                                         "from the left (its oldest turns first, as chat's keep_end) or dropped and "
                                         "counted", min=1)
    temperature: float = setting(1.0, "sampling temperature; the loss's log-probs are of the same tempered "
                                 "distribution, as in TRL", min=1e-3)
    top_p: float = setting(1.0, "nucleus sampling: keep the most probable tokens whose mass reaches top_p",
                           min=1e-6, max=1.0)
    top_k: int = setting(0, "keep only the k most probable tokens; 0 = all", min=0)
    epsilon: float = setting(0.2, "the clipped surrogate's lower epsilon (ratio >= 1 - epsilon)", min=0.0, max=1.0)
    epsilon_high: float = setting(0.0, "the upper epsilon (ratio <= 1 + epsilon_high); 0 = epsilon (DAPO's paper "
                                  "recommends 0.28)", min=0.0)
    beta: float = setting(0.0, "weight of the KL term against the reference (k3 estimator, per token); 0 = none, and "
                          "no reference is computed", min=0.0)
    reference: str = setting("auto", "beta > 0: the reference's log-probs: adapters_off = the policy with its LoRA "
                             "adapters disabled (needs model.lora.r > 0); model = a frozen copy of the initial model; "
                             "auto = adapters_off under LoRA, else model", choices=["auto", "adapters_off", "model"])
    num_iterations: int = setting(1, "updates per generation batch (mu, TRL's num_iterations): the same prompts and "
                                  "completions are trained on for mu steps in a row against the old policy's "
                                  "log-probs (clipped ratio); 1 = on-policy (the old log-probs are the current ones, "
                                  "detached, as TRL does)", min=1)
    loss_type: str = setting("dapo", "the loss's normalisation, as TRL 1.16 defines each, over the whole global batch: "
                             "grpo = each completion's mean token loss, averaged over completions; dr_grpo = the "
                             "token losses' sum over completions x max_completion_length; dapo = their sum over the "
                             "completion tokens (TRL's bnpo, per process, is dapo made global)",
                             choices=["grpo", "dr_grpo", "dapo"])
    scale_rewards: str = setting("group", "advantages = reward - the group's mean, divided by the std (+1e-4) of: "
                                 "the group, the whole global batch, or nothing (none)",
                                 choices=["group", "batch", "none"], boolean=("group", "none"))
    mask_truncated_completions: bool = setting(False, "leave completions that hit max_completion_length out of the "
                                               "loss (they still count as completions for grpo and dr_grpo, as in TRL)")
    reward_funcs: list = setting(None, "reward functions, summed with reward_weights: math_answer (1 when the last "
                                 "number or \\boxed{} of the completion equals the reference answer, else 0), format "
                                 "(1 when format_pattern is found in the completion), or 'module:function' with "
                                 "TRL's signature", factory=lambda: ["math_answer"])
    reward_weights: list = setting(None, "a weight per reward function; empty = 1 each", factory=list)
    answer_field: str = setting("answer", "math_answer: the field with the reference answer (the number after '####' "
                                "where there is one, as in GSM8K)")
    format_pattern: str = setting("", "format: a regular expression searched in the completion (re.DOTALL); needed "
                                  "when reward_funcs has format")
    disable_dropout: bool = setting(False, "zero every dropout of the policy (as preference.disable_dropout); TRL's "
                                    "GRPOConfig.disable_dropout defaults to false")
    log_completions_every: int = setting(0, "every this many steps, log a few sampled completions with their rewards "
                                         "(rank 0's, with prompt and advantage) to RUN/completions.jsonl; 0 = never",
                                         min=0)
    log_completions_count: int = setting(4, "completions logged each time", min=1)
    eval_max_tokens: int = setting(0, "evaluation's greedy completions: most tokens; 0 = max_completion_length", min=0)


@dataclass
class TokenClassifyConfig:
    """task token_classify: its fields and CoNLL columns, labels, alignment and windows."""
    tokens_field: str = setting("tokens", "JSONL/Parquet/hub data: field with the sentence's words (a list of strings)")
    tags_field: str = setting("ner_tags", "JSONL/Parquet/hub data: field with one tag per word (strings, or integers "
                              "naming token_classify.labels or the dataset's ClassLabel names)")
    token_column: int = setting(0, "CoNLL files: column of the word (0 = first)", min=0)
    tag_column: int = setting(-1, "CoNLL files: column of the tag (-1 = last)")
    separator: str = setting("auto", "CoNLL files: column separator; auto = a tab where a line has one (WNUT 2017: "
                             "words may hold spaces), else runs of whitespace; or the separator itself, e.g. ' '")
    labels: list = setting(None, "tag names in id order (needed for integer tags without the dataset's names); empty "
                           "= the training tags: O first, then by entity type and B/I/E/S prefix", factory=list)
    max_length: int = setting(128, "subwords per window, special tokens included; a longer sentence is split into "
                              "overlapping windows and each word is predicted by the window where it has the most "
                              "context", min=8, max=65536)
    stride: int = setting(32, "subwords of context two consecutive windows share (at least, in whole words; at most "
                          "half a window)", min=0)
    label_all_subwords: bool = setting(False, "train on every subword of a word (B- becomes I- after the first), not "
                                       "only its first; prediction always reads the first subword")
