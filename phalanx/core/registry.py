"""The task registry: every task's name, where its implementation lives, and what the torch-free parts of
phalanx need to know about it (config choices, sweep metrics, which commands use a finished run).

A task's class is imported only when that task runs (`phalanx.tasks.get_task`); everything here is plain
data, so `phalanx config`, `phalanx report` and `phalanx sweep` never import torch for it. Adding a task is
one entry here plus its module under phalanx/tasks/.
"""
from __future__ import annotations

from dataclasses import dataclass

from phalanx.core.errors import ConfigError


@dataclass(frozen=True)
class TaskSpec:
    name: str
    impl: str                       # "module:Class" of the Task implementation
    help: str
    eval_metrics: tuple[str, ...]   # evaluation keys a sweep may optimise (metrics.jsonl / summary.json)
    uses: tuple[str, ...]           # commands that use a finished run of this task (RUN/final)
    token_logits: bool              # the model outputs vocabulary logits at every position (memory plan)
    example: str                    # the shipped example config (the README's and the tests' starting point)
    sections: tuple[str, ...]       # the task's own config sections (core/task_sections.py) it reads
    # data.group_by_length=auto for this task, chosen by held-out quality at equal steps as well as speed
    # (bench/order_quality.py); None: its batches are all as long (lm), the key does not apply
    group_by_length: bool | None = None
    shows: str = ""                 # what `phalanx prepare --show N` prints of its store (data/units.py); "" = none


TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (
    TaskSpec("lm", "phalanx.tasks.lm:LMTask", "causal language modelling on packed token blocks",
             ("eval/loss", "eval/ppl"), ("generate",), True, "examples/shakespeare.yaml", ("lm",)),
    TaskSpec("classify", "phalanx.tasks.classify:ClassifyTask", "text (or text-pair) classification",
             ("eval/loss", "eval/accuracy", "eval/macro_f1"), ("predict",), False, "examples/sst2.yaml",
             ("classify",), True),
    TaskSpec("chat", "phalanx.tasks.chat:ChatTask", "supervised fine-tuning of a causal LM on conversations",
             ("eval/loss", "eval/ppl", "eval/token_accuracy"), ("generate", "chat"), True, "examples/chat.yaml",
             ("chat", "template"), False, shows="rendered conversations"),
    TaskSpec("preference", "phalanx.tasks.preference:PreferenceTask",
             "preference tuning (DPO, IPO, hinge, SimPO) of a chat model on pairs of a better and a worse reply",
             ("eval/loss", "eval/rewards/accuracies", "eval/rewards/margins"), ("generate", "chat"), True,
             "examples/preference.yaml", ("preference", "template"), False,
             shows="pairs (the prompt and both replies)"),
    TaskSpec("grpo", "phalanx.tasks.grpo:GRPOTask",
             "reinforcement learning with verifiable rewards (GRPO, Dr. GRPO, DAPO) of a chat model on prompts",
             ("eval/reward", "eval/accuracy"), ("generate", "chat"), True, "examples/grpo.yaml", ("grpo", "template")),
    TaskSpec("token_classify", "phalanx.tasks.token_classify:TokenClassifyTask",
             "token classification (named entities, tags): one prediction per word",
             ("eval/loss", "eval/f1", "eval/precision", "eval/recall", "eval/strict_f1", "eval/accuracy"),
             ("predict",), False, "examples/ner.yaml", ("token_classify",), True,
             shows="sentences (words, subwords and labels side by side)"),
)}

# Every task's own section (a task reads only its own: the others stay out of its resume check and --show)
TASK_SECTIONS = frozenset(s for spec in TASKS.values() for s in spec.sections)

# Every command that uses a finished run, and what it does (for the error naming the right one).
RUN_COMMANDS = {"generate": "samples text from a language model",
                "predict": "labels texts with a classifier or words with a tagger", "chat": "talks with a chat model"}


def task_spec(name: str) -> TaskSpec:
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"config key 'task': unknown task {name!r}, expected one of {list(TASKS)}") from None


def check_command(task: str, command: str, run: str) -> None:
    """`phalanx COMMAND RUN` applies to this run's task, or a one-line ConfigError saying which would."""
    spec = task_spec(task)
    if command not in spec.uses:
        others = ", ".join(f"`phalanx {c}`" for c in spec.uses) or "no command"
        raise ConfigError(f"run '{run}': task is '{task}'; `phalanx {command}` {RUN_COMMANDS.get(command, '')} "
                          f"and applies to {', '.join(t.name for t in TASKS.values() if command in t.uses)} runs; "
                          f"for this run use {others}")
