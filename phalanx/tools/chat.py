"""`phalanx chat RUN`: talk to a finished chat run (RUN/final) in the terminal, with plain transformers.

The saved chat template renders the history exactly as training did, and generation stops at the
end-of-turn token that RUN/final's generation config names. Interactive: the history is kept, replies
stream as they are generated; `/reset` forgets the history, `/exit` (or Ctrl-D) leaves. `--message TEXT`
answers once (greedy unless --temperature is given) and prints only the reply, for scripts.
"""
from __future__ import annotations

import sys

import torch

from phalanx.core.config import ConfigError, load_config
from phalanx.core.registry import check_command
from phalanx.core.runfolder import EXIT_OK, RunFolder
from phalanx.data.chat.template import fold_system, system_policy
from phalanx.model.build import load_causal_lm


def add_arguments(p) -> None:
    """Flags of `phalanx chat` (cli.py dispatches here)."""
    p.add_argument("run", help="run folder of a finished chat run (uses RUN/final)")
    p.add_argument("--message", default=None, help="answer this one message, print only the reply, and exit")
    p.add_argument("--system", default="", help="a system message at the start of the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature; 0 = greedy (default: 0 with --message, else 0.7)")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


class Chat:
    """A conversation with RUN/final's model: `reply(text)` appends the user's turn and the answer.

    The context holds the prompt and the reply: at most half of it is reserved for the reply (up to
    max_new_tokens), so the history keeps the other half; the oldest exchanges are dropped first when the
    prompt outgrows it. A last message so long that no token of reply would fit is a ConfigError."""

    def __init__(self, final, system: str = "", device: torch.device | None = None, system_message: str = "auto"):
        self.model, self.tokenizer = load_causal_lm(final)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"'{final}' has no chat template (train it with task: chat)")
        # --system as training treated system messages (template.system_message): kept where the template takes
        # one, else folded into the first user turn. template.kwargs are baked into the saved template.
        self.fold = bool(system) and system_policy(self.tokenizer, system_message) == "fold"
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device)
        self.system = system
        self.history: list[dict] = []
        config = self.model.config
        self.positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        self.notes: list[str] = []  # said once each (the caller prints them)
        self._said: set[str] = set()

    def reset(self) -> None:
        self.history = []

    def _note(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            self.notes.append(text)

    def _render(self) -> torch.Tensor:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.history
        if self.fold:
            messages = fold_system(messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="pt")["input_ids"]

    def _prompt(self, max_new_tokens: int) -> tuple[torch.Tensor, int]:
        """The rendered history with the assistant's turn opened, and the reply budget that fits after it."""
        ids = self._render()
        if self.positions is None:
            return ids.to(self.device), max_new_tokens
        reserve = min(max_new_tokens, self.positions // 2)
        dropped = 0
        while ids.shape[1] + reserve > self.positions and len(self.history) > 1:
            self.history = self.history[2:]  # the oldest exchange (user + assistant)
            dropped += 1
            ids = self._render()
        if dropped:
            self._note(f"phalanx: the conversation outgrew the model's {self.positions} positions: the oldest "
                       f"turns are dropped")
        budget = min(max_new_tokens, self.positions - ids.shape[1])
        if budget < 1:
            self.history.pop()  # the message that does not fit is not kept either
            raise ConfigError(f"the message is {ids.shape[1]} tokens with the chat template; the model has "
                              f"{self.positions} positions: shorten it (or use a shorter --system)")
        if budget < max_new_tokens:
            self._note(f"phalanx: replies are limited to what the context leaves ({self.positions} positions; "
                       f"--max-new-tokens {max_new_tokens} asked for more)")
        return ids.to(self.device), budget

    def ask(self, text: str, max_new_tokens: int = 256) -> tuple[torch.Tensor, int]:
        """Append the user's turn; the prompt to answer it and the reply budget (ConfigError: it does not fit)."""
        self.history.append({"role": "user", "content": text})
        return self._prompt(max_new_tokens)

    @torch.no_grad()
    def answer(self, ids: torch.Tensor, budget: int, temperature: float = 0.0, top_k: int = 50,
               stream: bool = False) -> str:
        """Generate the reply to the prompt `ids` (from `ask`) and append it to the history."""
        streamer = None
        if stream:
            from transformers import TextStreamer  # lazy: only interactive sessions stream

            streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                                  do_sample=temperature > 0, temperature=temperature or None,
                                  top_k=top_k if temperature > 0 else None, streamer=streamer)
        answer = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        self.history.append({"role": "assistant", "content": answer})
        return answer

    def reply(self, text: str, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 50) -> str:
        return self.answer(*self.ask(text, max_new_tokens), temperature, top_k)

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes


def run(args) -> int:
    folder = RunFolder(args.run)
    if folder.config.is_file():
        check_command(load_config(str(folder.config), check_paths=False).task, "chat", args.run)
    if not (folder.final / "config.json").is_file():
        raise ConfigError(f"run '{args.run}': no final/ model (has the run finished?)")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    torch.manual_seed(args.seed)
    trained = load_config(str(folder.config), check_paths=False) if folder.config.is_file() else None
    chat = Chat(folder.final, args.system, system_message=trained.template.system_message if trained else "auto")
    if args.message is not None:
        temperature = args.temperature if args.temperature is not None else 0.0
        answer = chat.reply(args.message, args.max_new_tokens, temperature, args.top_k)
        _say(chat.take_notes())
        print(answer)
        return EXIT_OK
    temperature = args.temperature if args.temperature is not None else 0.7
    print(f"phalanx chat with {folder.final} (/reset forgets the conversation, /exit or Ctrl-D leaves)",
          file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return EXIT_OK
        if text in ("/exit", "/quit"):
            return EXIT_OK
        if text == "/reset":
            chat.reset()
            continue
        if text:
            try:
                ids, budget = chat.ask(text, args.max_new_tokens)
            except ConfigError as e:  # a message too long for the context: said, and the session goes on
                print(f"phalanx: {e}", file=sys.stderr)
                continue
            _say(chat.take_notes())
            print("assistant> ", end="", flush=True)
            chat.answer(ids, budget, temperature, args.top_k, stream=True)


def _say(notes: list[str]) -> None:
    for note in notes:
        print(note, file=sys.stderr)
