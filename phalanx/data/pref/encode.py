"""A preference pair -> two token sequences (prompt + chosen, prompt + rejected), each with its targets.

Each sequence is rendered and masked exactly as `task: chat` renders a conversation (chat/encode.py's ChatEncoder:
the same template handling, structural reply location and end-of-turn rule); its targets are the reply's
tokens through the reply's end-of-turn token, never the prompt's. The prompt alone, rendered with the
generation prompt (what the model reads before it writes), must tokenize as the first tokens of both
sequences: a pair where it does not (tokens that merge across the boundary, a template that renders a
prompt differently before a reply) is refused and counted (`prompt_not_prefix`), never trained on a context
that inference would not give.

Truncation cuts the prompt, never a reply, and the same prompt for both replies: the longer sequence is
fitted to `model.block_size` as chat's keep_end fits a conversation (the oldest exchanges first, the
system message stays, then the first user turn left is cut from its start), and the shorter one takes the
prompt that was kept. A pair that still does not fit is dropped and counted (too_long).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from phalanx.data.chat.encode import ChatEncoder, ChatSettings, Encoded
from phalanx.data.counts import Dropped
from phalanx.data.pref.records import Pair

REPLIES = ("chosen", "rejected")


@dataclass
class EncodedPair:
    chosen: Encoded       # ids of prompt + chosen reply, mask = the reply's targets
    rejected: Encoded
    prompt_tokens: int    # the shared prompt's tokens (generation prompt included)
    truncated: bool = False

    @property
    def supervised(self) -> int:
        return self.chosen.supervised + self.rejected.supervised

    @property
    def sequences(self) -> tuple[Encoded, Encoded]:
        """The unit's sequences, in store order (units.py): chosen, then rejected."""
        return self.chosen, self.rejected


class PairEncoder:
    """Encodes pairs for one tokenizer and settings (the end is always kept: the prompt is cut from the left)."""

    def __init__(self, tokenizer, settings: ChatSettings, tokens=None):
        self.chat = ChatEncoder(tokenizer, replace(settings, train_on="assistant", truncation="keep_end"), tokens)
        self.block = settings.block_size

    def encode(self, pair: Pair) -> EncodedPair | Dropped:
        replies = (pair.chosen, pair.rejected)
        fulls = [self.chat.full(pair.prompt + reply) for reply in replies]
        dropped = next((f for f in fulls if isinstance(f, Dropped)), None)
        if dropped is not None:
            return dropped
        prompt, truncated = pair.prompt, False
        longest = max(len(f.tokens.ids) for f in fulls)
        if longest > self.block:
            longer = int(len(fulls[1].tokens.ids) > len(fulls[0].tokens.ids))
            fitted = self.chat.keep_end(fulls[longer])
            if isinstance(fitted, Dropped):
                fitted.tokens = fitted.tokens or longest
                return fitted
            prompt = fitted.messages[:len(fitted.messages) - len(replies[longer])]
            other = self.chat.full(prompt + replies[1 - longer])
            if isinstance(other, Dropped):
                return other
            if len(other.tokens.ids) > self.block:
                return Dropped("too_long", f"the {REPLIES[1 - longer]} reply does not fit model.block_size="
                               f"{self.block} with the prompt kept for the {REPLIES[longer]} one", longest)
            fulls[longer], fulls[1 - longer], truncated = fitted, other, True
        return self._masked(prompt, fulls, truncated)

    def _masked(self, prompt: list[dict], fulls: list, truncated: bool) -> EncodedPair | Dropped:
        head = self.chat.prompt_ids(prompt)
        if isinstance(head, Dropped):
            return head
        out = []
        for name, full in zip(REPLIES, fulls):
            ids, n = full.tokens.ids, len(head)
            if len(ids) <= n or not np.array_equal(ids[:n], head):
                return Dropped("prompt_not_prefix", f"the prompt's {n} tokens (with the generation prompt) are not "
                               f"the first tokens of prompt + {name} reply", len(ids))
            mask = full.mask.copy()
            mask[:n] = False  # earlier assistant turns of the prompt are context here, not targets
            if not mask.any():
                return Dropped("nothing_to_learn", f"no token of the {name} reply to score", len(ids))
            out.append(Encoded(ids, mask, full.ends[-1] if full.ends else -1, truncated))
        return EncodedPair(out[0], out[1], len(head), truncated)
