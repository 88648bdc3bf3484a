"""task: preference, the math in-process: each loss type equals a float64 reference computed from per-token
log-probs by a plain script (each reply run alone through plain transformers); packed pairs equal unpacked
ones (with the negative control); the per-micro-batch parts of the loss add up to the global batch's loss
(the normalisers are global counts); the metrics."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import SHAKESPEARE

from phalanx.core.config import load_config
from phalanx.data.chat import template
from phalanx.data import tokenizer as toks
from phalanx.data.chat.encode import ChatSettings
from phalanx.data.pref.encode import PairEncoder
from phalanx.data.pref.records import Pair
from phalanx.tasks import pref_loss
from phalanx.tasks.preference import PreferenceTask

BLOCK = 64
PROMPTS = ["What is red?", "Name a beast of the field.", "Say something kind.", "Count to three.", "Why?"]
GOOD = ["A colour.", "The ox, that ploughs.", "You are welcome here, friend.", "One, two, three.", "Because."]
BAD = ["A fruit, surely not.", "Ploughs ox the.", "Go away.", "Three two one.", "No reason at all, sir, none."]


@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([SHAKESPEARE.read_text()[:200_000]], 512),
                                **toks.SPECIALS["bpe"])
    assert template.ensure_template(t)
    return t


class ListPairs:
    """What collate_pairs reads of a store's pairs (data/units.py Units of 2 sequences), from encoded pairs in
    memory."""

    def __init__(self, encoded):
        self.encoded = encoded
        self.truncated = np.zeros(2 * len(encoded), dtype=np.uint8)
        self.n = len(encoded)

    def unit(self, p):
        e = self.encoded[p]
        return (e.chosen.ids, e.chosen.mask), (e.rejected.ids, e.rejected.mask)


@pytest.fixture(scope="module")
def pairs(tok):
    enc = PairEncoder(tok, ChatSettings("assistant", "keep_end", BLOCK, "keep", "{}"))
    return ListPairs([enc.encode(Pair([{"role": "user", "content": q}], [{"role": "assistant", "content": a}],
                                      [{"role": "assistant", "content": b}])) for q, a, b in zip(PROMPTS, GOOD, BAD)])


def task_for(tok, *overrides) -> PreferenceTask:
    cfg = load_config(None, ["task=preference", f"model.block_size={BLOCK}", *overrides])
    task = PreferenceTask(cfg, None)
    task.tokenizer = tok
    return task


def model(arch: str, seed: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=4 * BLOCK, n_embd=32, n_layer=2,
                                          n_head=2)).eval()
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=4 * BLOCK)).eval()


def alone_logps(m, ids: np.ndarray, mask: np.ndarray) -> float:
    """The plain script: one reply's sequence alone through plain transformers, its targets' log-probs
    summed in float64."""
    with torch.no_grad():
        logits = m(input_ids=torch.from_numpy(ids)[None]).logits[0].double()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.from_numpy(ids[1:])[:, None])[:, 0]
    return float(logp[torch.from_numpy(mask[1:])].sum())


def reference_losses(kind: str, beta: float, gamma: float, pol, ref, counts) -> list[float]:
    """TRL 1.16's definitions (dpo_trainer.py `_compute_loss`; experimental/cpo `cpo_loss` for simpo), float64."""
    out = []
    for (pc, pr), (rc, rr), (nc, nr) in zip(pol, ref, counts):
        d = (pc - rc) - (pr - rr)
        if kind == "sigmoid":
            out.append(-math.log(1 / (1 + math.exp(-beta * d))))
        elif kind == "hinge":
            out.append(max(0.0, 1 - beta * d))
        elif kind == "ipo":
            out.append(((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2)
        else:
            out.append(-math.log(1 / (1 + math.exp(-(beta * (pc / nc - pr / nr) - gamma)))))
    return out


@pytest.mark.parametrize("kind, sft", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("simpo", 0.0),
                                       ("sigmoid", 0.3)])
def test_each_loss_equals_a_float64_reference_from_per_token_logprobs(tok, pairs, kind, sft):
    beta = 2.0 if kind == "hinge" else 0.1  # hinge: some pairs on each side of its kink
    task = task_for(tok, f"preference.loss={kind}", f"preference.beta={beta}", "preference.simpo_gamma=0.3",
                    f"preference.sft_weight={sft}")
    policy, reference = model("gpt2", 0, len(tok)), model("gpt2", 1, len(tok))
    groups = [[0, 1], [2, 3, 4]]
    batch = task.collate_pairs(pairs, groups, 4 * BLOCK)
    if kind != "simpo":
        task.reference.name, task.reference.model = "model", reference
    totals = task.step_counts(batch)
    loss, sums = task.step_loss(policy, batch, totals)
    seqs = [pairs.unit(p) for g in groups for p in g]
    pol = [(alone_logps(policy, *c), alone_logps(policy, *r)) for c, r in seqs]
    ref = [(alone_logps(reference, *c), alone_logps(reference, *r)) for c, r in seqs]
    counts = [(int(c[1][1:].sum()), int(r[1][1:].sum())) for c, r in seqs]
    want = reference_losses(kind, beta, 0.3, pol, ref, counts)
    nll = -sum(c for c, _ in pol) / sum(c for c, _ in counts)
    expected = sum(want) / len(want) + sft * nll
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert totals == [5.0, float(sum(c for c, _ in counts))]
    m = task.train_metrics(sums.tolist())
    rewards = [(beta * pc / nc, beta * pr / nr) if kind == "simpo" else (beta * (pc - rc), beta * (pr - rr))
               for (pc, pr), (rc, rr), (nc, nr) in zip(pol, ref, counts)]
    assert m["rewards/chosen"] == pytest.approx(np.mean([c for c, _ in rewards]), rel=1e-5, abs=1e-6)
    assert m["rewards/margins"] == pytest.approx(np.mean([c - r for c, r in rewards]), rel=1e-5, abs=1e-6)
    assert m["rewards/accuracies"] == np.mean([c > r for c, r in rewards])
    assert m["logps/rejected"] == pytest.approx(np.mean([r for _, r in pol]), rel=1e-6)
    assert m["pair_loss"] == pytest.approx(np.mean(want), rel=1e-6, abs=1e-7) and m["pairs"] == 5
    if kind == "hinge":
        assert min(want) == 0.0 < max(want)  # both sides of the kink were exercised


def test_the_parts_of_a_global_batch_add_up_to_its_loss(tok, pairs):
    """Micro-batches normalised by the global batch's counts (pairs; chosen tokens for the NLL term), as the
    loop's one all-reduce gives them, sum to the loss of the whole batch at once, though their pair and token
    counts differ; a per-micro-batch mean (what TRL's compute_loss does) does not."""
    task = task_for(tok, "preference.sft_weight=0.5")
    policy, reference = model("gpt2", 0, len(tok)), model("gpt2", 1, len(tok))
    task.reference.name, task.reference.model = "model", reference
    whole = task.collate_pairs(pairs, [[0, 1, 2, 3, 4]], 8 * BLOCK)
    want = float(task.step_loss(policy, whole, task.step_counts(whole))[0].detach())
    parts = [task.collate_pairs(pairs, g, 4 * BLOCK) for g in ([[0], [1, 2]], [[3, 4]])]
    totals = [sum(c) for c in zip(*(task.step_counts(b) for b in parts))]
    got = sum(float(task.step_loss(policy, b, totals)[0].detach()) for b in parts)
    assert got == pytest.approx(want, rel=1e-6)
    local_means = sum(float(task.step_loss(policy, b, task.step_counts(b))[0].detach()) for b in parts) / len(parts)
    assert abs(local_means - want) > 1e-4  # the negative control: per-micro-batch normalisation differs


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_pairs_equal_unpacked_pairs(tok, pairs, arch):
    """Per pair log-probs and losses of packed rows (several pairs per row, position ids restarting at each
    sequence) equal the same pairs unpacked (each sequence its own padded row, a 2-D mask). Negative control:
    packed rows whose positions run on through the row let sequences see each other."""
    task = task_for(tok)
    policy, reference = model(arch, 0, len(tok)), model(arch, 1, len(tok))
    task.reference.name, task.reference.model = "model", reference
    groups = [[0, 1, 2], [3, 4]]
    packed = task.collate_pairs(pairs, groups, 4 * BLOCK)
    unpacked = task.collate_pairs(pairs, groups, None)
    assert "attention_mask" not in packed and "attention_mask" in unpacked and unpacked["input_ids"].shape[0] == 10
    assert torch.equal(packed["seq_tokens"], unpacked["seq_tokens"])
    with torch.no_grad():
        a, b = task.sequence_logps(policy, packed), task.sequence_logps(policy, unpacked)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        losses = [task._terms(policy, x)[0] for x in (packed, unpacked)]
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        packed["position_ids"] = torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"])
        leaked = task.sequence_logps(policy, packed)
    assert leaked[0, 0] == pytest.approx(float(b[0, 0]), rel=1e-5)  # the first sees nothing before it either way
    assert (leaked[1:] - b[1:]).abs().max() > 1e-2


def test_metrics_from_sums_and_their_names():
    sums = [4, 2.0, 0.4, -0.2, 3, -40.0, -48.0, 1, 30.0, 20]
    m = pref_loss.metrics(sums, 0.5, "eval/")
    assert m["eval/rewards/chosen"] == 0.1 and m["eval/rewards/rejected"] == -0.05
    assert m["eval/rewards/margins"] == pytest.approx(0.15) and m["eval/rewards/accuracies"] == 0.75
    assert m["eval/logps/chosen"] == -10.0 and m["eval/nll/chosen"] == 1.5 and m["eval/pairs_truncated"] == 1
    assert m["eval/loss"] == pytest.approx(0.5 + 0.5 * 1.5)
    assert json.dumps(m)  # plain numbers for metrics.jsonl
