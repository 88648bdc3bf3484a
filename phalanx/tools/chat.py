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
    """A conversation with RUN/final's model: `reply(text)` appends the user's turn and the answer."""

    def __init__(self, final, system: str = "", device: torch.device | None = None):
        self.model, self.tokenizer = load_causal_lm(final)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"'{final}' has no chat template (train it with task: chat)")
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device)
        self.system = system
        self.history: list[dict] = []
        self.positions = getattr(self.model.config, "n_positions", None) or \
            getattr(self.model.config, "max_position_embeddings", 2048)

    def reset(self) -> None:
        self.history = []

    def _prompt(self, max_new_tokens: int) -> torch.Tensor:
        """The rendered history with the assistant's turn opened; the oldest turns go first if too long."""
        while True:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.history
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, return_tensors="pt")["input_ids"]
            if ids.shape[1] + max_new_tokens <= self.positions or len(self.history) <= 1:
                return ids[:, -(self.positions - max_new_tokens):].to(self.device)
            self.history = self.history[2:]

    @torch.no_grad()
    def reply(self, text: str, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 50,
              stream: bool = False) -> str:
        self.history.append({"role": "user", "content": text})
        ids = self._prompt(max_new_tokens)
        streamer = None
        if stream:
            from transformers import TextStreamer  # lazy: only interactive sessions stream

            streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=temperature > 0, temperature=temperature or None,
                                  top_k=top_k if temperature > 0 else None, streamer=streamer)
        answer = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        self.history.append({"role": "assistant", "content": answer})
        return answer


def run(args) -> int:
    folder = RunFolder(args.run)
    if folder.config.is_file():
        check_command(load_config(str(folder.config), check_paths=False).task, "chat", args.run)
    if not (folder.final / "config.json").is_file():
        raise ConfigError(f"run '{args.run}': no final/ model (has the run finished?)")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    torch.manual_seed(args.seed)
    chat = Chat(folder.final, args.system)
    if args.message is not None:
        temperature = args.temperature if args.temperature is not None else 0.0
        print(chat.reply(args.message, args.max_new_tokens, temperature, args.top_k))
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
            print("assistant> ", end="", flush=True)
            chat.reply(text, args.max_new_tokens, temperature, args.top_k, stream=True)
