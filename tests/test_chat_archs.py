"""Chat rows on the model families people fine-tune, built from tiny transformers configs: a packed row
made by phalanx's collate and run through the task's forward gives each conversation the loss (and the
gradients) it has alone under the model's own default mask (plain transformers, no phalanx code); so do
padded unpacked rows. Sliding windows are shorter than the conversations; Gemma-2 runs eager attention
with soft-capping. Negative controls: positions that do not restart, and the 4-D mask phalanx used to
build, give other losses."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from phalanx.core.config import load_config
from phalanx.tasks.chat import IGNORE, ChatTask

VOCAB, WINDOW = 128, 4
LENGTHS = (9, 6, 13)          # every one longer than the sliding window
PACKED = [[0, 1], [2]]        # two packed rows, each with a pad tail
WIDTH = 18
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)

# architecture -> attention implementations tested (each one the architecture supports); flex compiles per
# shape (~13 s each on this machine), so it runs for two families only
IMPLEMENTATIONS = {"gpt2": ("sdpa", "eager"), "llama": ("sdpa", "eager", "flex_attention"),
                   "mistral": ("sdpa", "eager"), "gemma2": ("eager", "flex_attention"), "gemma3": ("sdpa", "eager"),
                   "qwen2": ("sdpa", "eager"), "qwen3": ("sdpa", "eager"), "phi3": ("sdpa", "eager")}
WINDOWED = {"mistral", "gemma2", "gemma3", "qwen2", "phi3"}
CASES = [pytest.param(arch, impl, marks=[pytest.mark.slow] if impl == "flex_attention" and arch != "llama" else [])
         for arch, impls in IMPLEMENTATIONS.items() for impl in impls]


def hf_config(arch: str):
    import transformers as T

    if arch == "gpt2":
        return T.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    if arch == "llama":
        return T.LlamaConfig(**SMALL)
    if arch == "mistral":
        return T.MistralConfig(**SMALL, sliding_window=WINDOW)
    if arch == "gemma2":  # a small soft-cap, so that it shapes the scores
        return T.Gemma2Config(**SMALL, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=2.0)
    if arch == "gemma3":
        return T.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"])
    if arch == "qwen2":
        return T.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if arch == "qwen3":
        return T.Qwen3Config(**SMALL, head_dim=16)
    return T.Phi3Config(**SMALL, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def models(arch: str, impl: str):
    """(the reference: the architecture's default attention, plain transformers; the same weights under
    `impl`)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(arch)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
    model.load_state_dict(ref.state_dict())
    assert model.config._attn_implementation == impl
    if arch in WINDOWED and hasattr(config, "layer_types"):  # both kinds of layer are there
        assert set(model.config.layer_types) >= {"sliding_attention"}
    return ref, model


def make_conversations() -> list[tuple[np.ndarray, np.ndarray]]:
    """Random token ids with random targets (the first token is never one)."""
    rng = np.random.default_rng(0)
    out = []
    for n in LENGTHS:
        ids = rng.integers(3, VOCAB, n)
        mask = rng.random(n) < 0.6
        mask[0] = False
        out.append((ids, mask))
    return out


@pytest.fixture(scope="module")
def conversations():
    return make_conversations()


class Rows:
    """What ChatTask.collate reads of a ChatSet: segments(i), and lengths (None: packed rows)."""

    def __init__(self, rows, packed: bool):
        self.rows = rows
        self.lengths = None if packed else np.array([sum(len(x) for x, _ in r) for r in rows])

    def segments(self, i):
        return self.rows[i]


def chat_task() -> ChatTask:
    task = ChatTask(load_config(None, ["task=chat", f"model.block_size={WIDTH}"], check_paths=False), info=None)
    task.tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    return task


def alone(ref, conv) -> torch.Tensor:
    """A conversation's loss sum alone: plain transformers, no mask, no position ids, no phalanx code."""
    ids, mask = conv
    logits = ref(input_ids=torch.from_numpy(ids)[None]).logits[0, :-1].float()
    targets = torch.from_numpy(np.where(mask[1:], ids[1:], IGNORE))
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


def per_conversation(task, model, batch, spans) -> tuple[list[float], torch.Tensor]:
    """Loss sum per (row, start, end) span, from the task's own forward; and all logits."""
    logits = task.logits(model, batch).float()
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE,
                                reduction="none").view(batch["labels"].shape)
    return [float(per_token[r, a:b].sum()) for r, a, b in spans], logits


def old_mask(batch) -> dict:
    """The batch as phalanx collated it before: a boolean block-diagonal causal 4-D mask (segments where
    positions restart; pad slots a segment of their own)."""
    ids = batch["input_ids"]
    b, w = ids.shape
    if "position_ids" in batch:
        positions = batch["position_ids"]
    else:
        real = batch["attention_mask"].sum(1, keepdim=True)
        k = torch.arange(w)[None]
        positions = torch.where(k < real, k, k - real)
    segment = (positions == 0).cumsum(1)
    mask = (segment[:, :, None] == segment[:, None, :]) & torch.ones(w, w, dtype=torch.bool).tril()
    return {"input_ids": ids, "labels": batch["labels"], "position_ids": positions, "attention_mask": mask[:, None]}


def spans_of(rows, convs) -> list[tuple[int, int, int]]:
    out = []
    for r, row in enumerate(rows):
        t = 0
        for c in row:
            out.append((r, t, t + len(convs[c][0])))
            t += len(convs[c][0])
    return out


@pytest.mark.parametrize("arch, impl", CASES)
def test_packed_and_padded_rows_equal_each_conversation_alone(conversations, arch, impl):
    ref, model = models(arch, impl)
    task = chat_task()
    with torch.no_grad():
        want = [float(alone(ref, c)) for c in conversations]
    leaks = impl == "eager" or arch in WINDOWED  # where the old 4-D mask was wrong

    packed_rows = [[conversations[c] for c in row] for row in PACKED]
    batch = task.collate(Rows(packed_rows, packed=True), range(len(PACKED)))
    assert "attention_mask" not in batch and all(v.dim() <= 2 for v in batch.values() if torch.is_tensor(v))
    spans = spans_of(PACKED, conversations)
    with torch.no_grad():
        got, logits = per_conversation(task, model, batch, spans)
        assert torch.isfinite(logits).all()  # the pad tails too
        assert got == pytest.approx([want[c] for row in PACKED for c in row], rel=1e-4, abs=1e-4)
        # negative controls: positions that do not restart let the second conversation see the first; the old
        # 4-D mask was taken as final (no window) and eager attention added it (a boolean adds 0 or 1)
        seen, _ = per_conversation(task, model, {**batch, "position_ids": torch.arange(WIDTH).expand(2, -1)}, spans)
        assert abs(seen[1] - want[1]) > 1e-3
        if impl != "flex_attention":
            before, _ = per_conversation(task, model, old_mask(batch), spans)
            assert (max(abs(a - want[c]) for a, c in zip(before, [0, 1, 2])) > 1e-3) == leaks

    padded = task.collate(Rows([[c] for c in conversations], packed=False), range(3))
    assert padded["attention_mask"].shape == (3, max(LENGTHS)) and "position_ids" not in padded
    with torch.no_grad():
        got, logits = per_conversation(task, model, padded, [(r, 0, n) for r, n in enumerate(LENGTHS)])
        assert torch.isfinite(logits).all()
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
        if impl != "flex_attention":
            before, _ = per_conversation(task, model, old_mask(padded), [(r, 0, n) for r, n in enumerate(LENGTHS)])
            assert (max(abs(a - b) for a, b in zip(before, want)) > 1e-3) == leaks

    if impl == "flex_attention":
        return
    # gradients: the packed micro-batch's loss sum against the sum over each conversation alone
    model.zero_grad()
    task.loss_sum(model, batch).backward()
    ref.zero_grad()
    sum(alone(ref, c) for c in conversations).backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)
