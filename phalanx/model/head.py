"""A causal LM's output head only at the positions a loss reads, in chunks.

The head maps a position's hidden state to V logits (49,152 for SmolLM2, 128,256 for Llama-3); a chat
micro-batch supervises a few percent of its positions, and a `B x T x V` fp32 tensor with its log-softmax
and gradient was most of a step's activation memory. `target_logprobs(model, inputs, labels)` runs the
model's own forward with transformers' `logits_to_keep` set to the boolean mask of the positions that have a
target (transformers selects those hidden states before its head, packed rows included), and returns each
target's log-prob, in row-major order of the mask. No full-vocabulary tensor of more than `CHUNK_BYTES`
exists at once:

- fused (the families phalanx claims, whose head is a plain `nn.Linear` and whose logits are at most
  soft-capped): a forward pre-hook on the head takes the selected hidden states, computes the log-probs chunk
  by chunk (`TargetLogProbs`: the logits of one chunk of rows at a time, recomputed in backward), and hands
  the head an empty input. It runs inside the model's forward, so DDP's hooks and FSDP2's unsharded
  parameters are what the head would have used, and a tied embedding gets its gradient through the weight.
- otherwise (another architecture, a head with adapters): the model's own logits at the selected positions
  only (`logits_to_keep`), then the same log-softmax. Correct for any head, and still only where needed.

torch 2.13's `F.linear_cross_entropy` (chunked) is not used: on this CPU it ran 4-17x slower than the
unchunked reference, and its chunked path returns a reduced loss (its gradients are computed in forward),
while preference tuning needs each target's log-prob.
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100
CHUNK_BYTES = 32 << 20  # fp32 logits of one chunk of rows
# model_type -> the head's logits are F.linear(hidden, weight) (then soft-capped where the config says):
# checked against each model's own loss in tests/test_chat_archs.py and tests/test_head.py
FUSED_TYPES = frozenset({"gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
                         "gemma2", "gemma3_text", "phi3"})


@dataclass
class Targets:
    logp: torch.Tensor                  # (N,) fp32 log-prob of each target, row-major over the mask (or their sum)
    correct: torch.Tensor | None = None  # (N,) bool: the argmax is the target (when asked for)


def target_logprobs(model: nn.Module, inputs: dict, labels: torch.Tensor, correct: bool = False,
                    summed: bool = False, temperature: float = 1.0) -> Targets:
    """Each target's log-prob under `model` (a causal LM, possibly wrapped by DDP, torch.compile or peft) for
    `inputs` (input_ids and the model's other inputs, shaped like `labels`); -100 marks no target. `summed`:
    only their sum (a 0-d `logp`), whose gradient is cheaper (TargetLogProbSum). `temperature`: of the
    distribution logits / temperature (GRPO's sampling distribution, as TRL scores it)."""
    keep = labels != IGNORE
    targets = labels[keep]
    head = _fusable_head(model)
    if head is not None and temperature != 1.0 and (head.bias is not None or _softcap(model)):
        head = None  # (h W + b) / T is not (h / T) W + b, nor cap(z) / T cap(z / T): the model's own logits
    if head is None:
        logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
        logits = logits[keep] if logits.dim() == 3 else logits  # a model that ignores logits_to_keep
        if temperature != 1.0:
            logits = logits.float() / temperature
        got = _from_logits(logits, targets, correct)
        return Targets(got.logp.sum(), got.correct) if summed else got
    capture = _Capture.of(head)
    capture.pending = (keep, targets, _softcap(model), correct, summed, temperature)
    try:
        # use_cache=False: a key/value cache would turn off transformers' packed-sequence masks
        model(**inputs, logits_to_keep=keep, use_cache=False)
        if capture.result is None:
            raise RuntimeError("the model's forward never called its output head")
        return capture.result
    finally:
        capture.pending = capture.result = None


def _from_logits(logits: torch.Tensor, targets: torch.Tensor, correct: bool) -> Targets:
    logp = -F.cross_entropy(logits.float(), targets, reduction="none")
    return Targets(logp, (logits.argmax(-1) == targets) if correct else None)


def _inner(model: nn.Module) -> nn.Module:
    """The transformers model under DDP and torch.compile wrappers (their attributes forward to it)."""
    return getattr(model, "module", model)


def _fusable_head(model: nn.Module) -> nn.Linear | None:
    inner = _inner(model)
    config = getattr(inner, "config", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if config is None or config.model_type not in FUSED_TYPES or type(head) is not nn.Linear:
        return None
    return head


def _softcap(model: nn.Module) -> float | None:
    return getattr(_inner(model).config, "final_logit_softcapping", None) or None


class _Capture:
    """The forward pre-hook on a head, installed once per head (a hook added per call would make
    torch.compile recompile): with a pending request it computes the targets' log-probs from the selected
    hidden states and gives the head an empty input; without one it lets the head run as usual."""
    _installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, head: nn.Linear):
        self.pending = None
        self.result: Targets | None = None
        # under torch.compile (dynamo already loaded by it): run eagerly, a graph break before the head;
        # importing dynamo just for this would cost every worker seconds of start-up
        hook = torch.compiler.disable(self._hook) if "torch._dynamo" in sys.modules else self._hook
        self._handle = head.register_forward_pre_hook(hook)

    @classmethod
    def of(cls, head: nn.Linear) -> _Capture:
        if head not in cls._installed:
            cls._installed[head] = cls(head)
        return cls._installed[head]

    def _hook(self, head: nn.Linear, args):
        if self.pending is None:
            return None
        keep, targets, softcap, correct, summed, temperature = self.pending
        hidden = args[0]
        if hidden.dim() == 3:  # the model did not select (it ignores logits_to_keep)
            hidden = hidden[keep.view(hidden.shape[:2])]
        if temperature != 1.0:  # no bias, no soft-cap here: (h / T) W = (h W) / T
            hidden = hidden / temperature
        if summed:
            logp, right = TargetLogProbSum.apply(hidden, head.weight, head.bias, targets, softcap, correct,
                                                 torch.is_grad_enabled())
        else:
            logp, right = TargetLogProbs.apply(hidden, head.weight, head.bias, targets, softcap, correct)
        self.result = Targets(logp, right if correct else None)
        return (hidden[:0],)


def chunk_rows(vocab: int) -> int:
    """Rows per chunk: CHUNK_BYTES of fp32 logits."""
    return max(1, CHUNK_BYTES // (4 * vocab))


class TargetLogProbs(torch.autograd.Function):
    """log softmax(cap(h W^T + b))[target] per row of h, chunk by chunk: forward keeps only each row's
    log-sum-exp; backward recomputes one chunk's logits at a time (each row's gradient is scaled by its own
    incoming gradient: preference tuning sums them per sequence). Matmuls run in the autocast dtype where
    autocast is on (as the model's head would), the softmax in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, softcap, correct):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        right = torch.zeros(n if correct else 0, dtype=torch.bool, device=hidden.device)
        for rows in _chunks(n, weight.shape[0]):
            z, _ = _logits(hidden[rows], weight, bias, softcap)
            lse[rows] = torch.logsumexp(z, -1)
            logp[rows] = z.gather(1, targets[rows, None]).squeeze(1) - lse[rows]
            if correct:
                right[rows] = z.argmax(-1) == targets[rows]
        ctx.autocast, ctx.softcap = _autocast_state(hidden), softcap
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.mark_non_differentiable(right)
        return logp, right

    @staticmethod
    def backward(ctx, grad_logp, _grad_right):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        grads = _Grads(hidden, weight, bias, ctx.needs_input_grad[:3], ctx.autocast)
        with grads.autocast():
            for rows in _chunks(hidden.shape[0], weight.shape[0]):
                z, capped = _logits(hidden[rows], weight, bias, ctx.softcap)
                grads.add(rows, _dlogp_dz(z, capped, lse[rows], targets[rows], grad_logp[rows]))
        return (*grads.result(), None, None, None)


class TargetLogProbSum(torch.autograd.Function):
    """The sum of TargetLogProbs over every row (the loss of causal LM and chat: each target weighs the same),
    its gradients computed in forward chunk by chunk and scaled by the incoming gradient in backward: no
    chunk is recomputed (3 head matmuls per chunk, as the unchunked head; TargetLogProbs needs 4). Holds the
    gradients from forward to backward: the head weight's (V x H, fp32: the size of its own gradient) and the
    selected hidden states'. `train`: the caller's grad mode (inside forward autograd has turned it off)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, softcap, correct, train):
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        right = torch.zeros(n if correct else 0, dtype=torch.bool, device=hidden.device)
        needs = tuple(train and t is not None and t.requires_grad for t in (hidden, weight, bias))
        grads = _Grads(hidden, weight, bias, needs, _autocast_state(hidden))
        for rows in _chunks(n, weight.shape[0]):
            z, capped = _logits(hidden[rows], weight, bias, softcap)
            lse = torch.logsumexp(z, -1)
            total += (z.gather(1, targets[rows, None]).squeeze(1) - lse).sum(dtype=torch.float64)
            if correct:
                right[rows] = z.argmax(-1) == targets[rows]
            if any(needs):
                grads.add(rows, _dlogp_dz(z, capped, lse, targets[rows], None))
        found = grads.result()
        ctx.found = tuple(g is not None for g in found)
        ctx.save_for_backward(*(g for g in found if g is not None))
        ctx.mark_non_differentiable(right)
        return total.float(), right

    @staticmethod
    def backward(ctx, grad_total, _grad_right):
        saved = iter(ctx.saved_tensors)
        scaled = [next(saved) * grad_total if found else None for found in ctx.found]
        return (*scaled, None, None, None, None)


def _chunks(n: int, vocab: int):
    step = chunk_rows(vocab)
    return (slice(a, min(n, a + step)) for a in range(0, n, step))


def _autocast_state(t: torch.Tensor) -> tuple:
    device = t.device.type
    return device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


def _dlogp_dz(z: torch.Tensor, capped: torch.Tensor | None, lse: torch.Tensor, targets: torch.Tensor,
              scale: torch.Tensor | None) -> torch.Tensor:
    """d log p(target) / d (the head's output) for one chunk, each row times `scale` (None: 1), computed in
    place of `z` (the chunk's fp32 logits): onehot(target) - softmax, through the soft-cap where there is one
    (cap * tanh(x / cap): d/dx = 1 - tanh^2)."""
    g = z.sub_(lse[:, None]).exp_().neg_()
    if scale is None:
        g.scatter_add_(1, targets[:, None], torch.ones_like(targets[:, None], dtype=g.dtype))
    else:
        g.mul_(scale[:, None]).scatter_add_(1, targets[:, None], scale[:, None].to(g.dtype))
    if capped is not None:
        g.mul_(1 - capped.square())
    return g


class _Grads:
    """The head's input, weight and bias gradients, accumulated chunk by chunk from d/d(output)."""

    def __init__(self, hidden, weight, bias, needs, autocast):
        self.hidden, self.weight, self._autocast = hidden, weight, autocast
        need_h, need_w, need_b = needs
        self.h = torch.zeros_like(hidden) if need_h else None
        self.w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        self.b = torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        self.bias_dtype = bias.dtype if bias is not None else None

    def autocast(self):
        device, enabled, dtype = self._autocast
        return torch.autocast(device, dtype=dtype, enabled=enabled)

    def add(self, rows: slice, g: torch.Tensor) -> None:
        enabled = self._autocast[1]
        if not enabled and self.weight.dtype == self.hidden.dtype == torch.float32:
            # into the accumulators (GEMM with beta 1): a V x H product per chunk, then a pass to add it,
            # made the head 1.6x slower than the unchunked one at Llama-3's vocabulary (65-row chunks)
            if self.h is not None:
                torch.mm(g, self.weight, out=self.h[rows])
            if self.w is not None:
                self.w.addmm_(g.t(), self.hidden[rows])
            if self.b is not None:
                self.b += g.sum(0)
            return
        with self.autocast():
            gm = g if enabled else g.to(self.weight.dtype)  # autocast casts mm's operands itself
            if self.h is not None:
                self.h[rows] = torch.mm(gm, self.weight).to(self.h.dtype)
            if self.w is not None:
                h = self.hidden[rows]
                self.w += torch.mm(gm.t(), h if enabled else h.to(self.weight.dtype)).float()
        if self.b is not None:
            self.b += g.sum(0)

    def result(self) -> tuple:
        return (self.h, self.w.to(self.weight.dtype) if self.w is not None else None,
                self.b.to(self.bias_dtype) if self.b is not None else None)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's fp32 logits (soft-capped), and tanh(x / cap) where capped (backward needs it)."""
    z = F.linear(h, weight, bias).float()
    if not softcap:
        return z, None
    capped = torch.tanh(z / softcap)
    return capped * softcap, capped
