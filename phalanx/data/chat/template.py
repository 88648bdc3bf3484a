"""The chat template, used alike when preparing, in RUN/final and by `phalanx chat`.

    ensure_template(tok)          phalanx's ChatML template for a tokenizer without one
    bake_defaults(tok, kwargs)    template.kwargs written into the template as defaults, so that plain
                                  transformers (RUN/final, `phalanx chat`) renders as training did unless the
                                  caller passes the keyword itself
    Renderer(tok, kwargs)         renders conversations as `apply_chat_template(..., tokenize=False)` does
    system_policy(tok, setting)   'keep' or 'fold' for system messages (template.system_message), probed once
    fold_system(messages)         system messages folded into the next user turn ("system\\n\\nuser")
"""
from __future__ import annotations

import json
import re

from phalanx.core.errors import ConfigError

# phalanx's template for tokenizers without one (ChatML). The {% generation %} markers let transformers'
# `return_assistant_tokens_mask` and TRL's `assistant_only_loss` find the same tokens phalanx trains on.
START, END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
# Keywords transformers passes itself; one in template.kwargs would change how it renders, not the template.
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
             "tokenize", "return_dict", "return_assistant_tokens_mask"}


def ensure_template(tokenizer) -> bool:
    """Give a tokenizer without a chat template phalanx's ChatML one, with <|im_start|>/<|im_end|> as
    special tokens. Returns True when tokens were added (the model's embeddings must grow)."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.add_special_tokens({"additional_special_tokens": [START, END]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return True


# ---- template.kwargs -------------------------------------------------------------------------
def check_kwargs(kwargs: dict) -> None:
    """template.kwargs: names a template can read, values JSON can hold."""
    for key, value in (kwargs or {}).items():
        if not isinstance(key, str) or not _NAME.match(key) or key in _RESERVED:
            raise ConfigError(f"config key 'template.kwargs': {key!r} is not a keyword a chat template reads "
                              f"(expected a name like enable_thinking, not one of {sorted(_RESERVED)})")
        try:
            jinja_literal(value)
        except TypeError:
            raise ConfigError(f"config key 'template.kwargs.{key}': expected text, a number, true/false, null, "
                              f"or a list/mapping of those, got {type(value).__name__}") from None


def jinja_literal(value) -> str:
    """`value` as a Jinja expression that evaluates to it (JSON's true/false/null are Jinja's true/false/none)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value, ensure_ascii=False)  # Jinja reads JSON's string escapes and numbers as Python does
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(jinja_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {jinja_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value).__name__)


def _with_defaults(template: str, kwargs: dict) -> str:
    head = "".join(f"{{%- if {k} is not defined %}}{{%- set {k} = {jinja_literal(v)} %}}{{%- endif %}}"
                   for k, v in sorted(kwargs.items()))
    return head + template


def bake_defaults(tokenizer, kwargs: dict) -> None:
    """Write `kwargs` into the tokenizer's chat template(s) as defaults: a caller that passes a keyword still
    overrides it (`{% if k is not defined %}{% set k = v %}{% endif %}` per keyword, before the template)."""
    if not kwargs:
        return
    template = tokenizer.chat_template
    if isinstance(template, dict):
        tokenizer.chat_template = {name: _with_defaults(t, kwargs) for name, t in template.items()}
    else:
        tokenizer.chat_template = _with_defaults(template, kwargs)


# ---- rendering ------------------------------------------------------------------------------------
class Renderer:
    """Renders conversations with a tokenizer's chat template, exactly as `apply_chat_template(messages,
    tokenize=False, **kwargs)` does (the template sees the tokenizer's special tokens and `kwargs`), but
    many at once: transformers' per-call overhead is a third of a render."""

    def __init__(self, tokenizer, kwargs: dict | None = None):
        from transformers.utils.chat_template_utils import render_jinja_template  # lazy: ~0.5 s

        self._render = render_jinja_template
        self.template = tokenizer.get_chat_template()
        self.variables = {**tokenizer.special_tokens_map, **(kwargs or {})}
        self.key = (self.template, json.dumps(kwargs or {}, sort_keys=True))
        self._direct = self._direct_template()

    def _direct_template(self):
        """transformers' compiled template, called directly: `render_jinja_template` first rebuilds the
        messages as plain data (ours are: dicts of text) and copies `reasoning_content` to `thinking` (for
        templates that read that name) — a third of its cost. Used only where it renders a probe with
        reasoning exactly as transformers does; else None (the probe shows a template that reads `thinking`)."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.template)
            probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
                     {"role": "user", "content": "v"}, {"role": "assistant", "content": "b", "reasoning_content": "s"}]
            same = compiled.render(messages=probe, tools=None, documents=None, add_generation_prompt=False,
                                   **self.variables) == self._render([probe], chat_template=self.template,
                                                                     **self.variables)[0][0]
        except Exception:  # not in this transformers version, or the template refuses the probe
            return None
        return compiled if same else None

    def one(self, messages: list[dict], generation: bool = False) -> str:
        """One conversation; a template that refuses it raises ConfigError with its reason."""
        try:
            return self._render([messages], chat_template=self.template, add_generation_prompt=generation,
                                **self.variables)[0][0]
        except Exception as e:  # a template's own raise_exception (roles must alternate, no system role) or jinja's
            raise ConfigError(f"the chat template refused this conversation "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None

    def many(self, conversations: list[list[dict]]) -> list[str | ConfigError]:
        """Each conversation's text, or the ConfigError of one the template refuses."""
        try:
            if self._direct is not None:
                render = self._direct.render
                return [render(messages=m, tools=None, documents=None, add_generation_prompt=False, **self.variables)
                        for m in conversations]
            return self._render(conversations, chat_template=self.template, **self.variables)[0]
        except Exception:  # some conversation is refused: find which, one by one
            out = []
            for messages in conversations:
                try:
                    out.append(self.one(messages))
                except ConfigError as e:
                    out.append(e)
            return out


def split_reasoning(messages: list[dict]) -> list[dict] | None:
    """Assistant turns that write their reasoning inline (`<think>...</think>` before the reply) with it in
    `reasoning_content`, as Qwen3's and DeepSeek-R1's templates split it; None when there is none. Used only
    where the template renders both forms the same (chat_encode checks), so a reply is never guessed."""
    if not any(m["role"] == "assistant" and "</think>" in m["content"] and not m.get("reasoning_content")
               for m in messages):
        return None
    out = []
    for m in messages:
        if m["role"] == "assistant" and "</think>" in m["content"] and not m.get("reasoning_content"):
            head, _, reply = m["content"].partition("</think>")
            m = {**m, "content": reply.lstrip("\n"), "reasoning_content": head.rstrip("\n").split("<think>")[-1]
                 .lstrip("\n")}
        out.append(m)
    return out


# ---- system messages ------------------------------------------------------------------------------
_POLICIES: dict[tuple, str] = {}


def fold(messages: list[dict]) -> tuple[list[dict], list[tuple[int, int]]]:
    """System messages folded into the next user turn ("system\\n\\nuser"; one with no user turn after it
    becomes a user turn), and where each message's text went: (folded message, offset in its content)."""
    out, origin, pending = [], [(0, 0)] * len(messages), []

    def flush(user: int | None) -> None:  # the pending system texts open record message `user`, or a new turn
        texts, at = [], 0
        for k in [*pending, *([user] if user is not None else [])]:
            origin[k] = (len(out), at)
            texts.append(messages[k]["content"])
            at += len(texts[-1]) + 2
        out.append({**(messages[user] if user is not None else {"role": "user"}), "content": "\n\n".join(texts)})
        pending.clear()

    for k, m in enumerate(messages):
        if m["role"] == "system":
            pending.append(k)
        elif m["role"] == "user" and pending:
            flush(k)
        else:
            if pending:
                flush(None)
            origin[k] = (len(out), 0)
            out.append(m)
    if pending:
        flush(None)
    return out, origin


def fold_system(messages: list[dict]) -> list[dict]:
    """System messages folded into the next user turn ("system\\n\\nuser"); one with no user turn after it
    becomes a user turn. For templates that refuse a system role (Gemma-2); `phalanx chat --system` too."""
    return fold(messages)[0]


def accepts_system(renderer: Renderer) -> bool:
    """Whether the template renders a system message's text (probed with marker contents; cached)."""
    if renderer.key not in _POLICIES:
        probe = [{"role": "system", "content": "\ue000probe-system\ue001"},
                 {"role": "user", "content": "\ue000probe-user\ue001"},
                 {"role": "assistant", "content": "\ue000probe-reply\ue001"}]
        try:
            text = renderer.one(probe)
            _POLICIES[renderer.key] = "keep" if probe[0]["content"] in text else "fold"
        except ConfigError:
            _POLICIES[renderer.key] = "fold"
    return _POLICIES[renderer.key] == "keep"


def system_policy(tokenizer, setting: str = "auto", kwargs: dict | None = None) -> str:
    """template.system_message resolved for this tokenizer's template: 'keep' or 'fold'. auto = keep where the
    template renders a system message (Gemma-3's folds it itself: accepted), else fold; keep with a template
    that refuses or drops it is exit 2."""
    if setting == "fold":
        return "fold"
    accepted = accepts_system(tokenizer if isinstance(tokenizer, Renderer) else Renderer(tokenizer, kwargs))
    if setting == "keep" and not accepted:
        raise ConfigError("config key 'template.system_message': keep, but this chat template refuses (or drops) a "
                          "system message; use auto or fold (the system text goes before the first user turn)")
    return "keep" if accepted else "fold"
