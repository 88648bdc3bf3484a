"""Chat data in-process: record formats, rendering and the loss mask, truncation, packing, and the
attention confinement of packed rows (packed == each conversation alone, with its negative control)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import SHAKESPEARE

from phalanx.core.errors import ConfigError
from phalanx.data.chat import formats, template
from phalanx.data.chat.encode import ChatEncoder, ChatSettings, Encoded
from phalanx.data import tokenizer as toks
from phalanx.data.counts import Dropped
from phalanx.data.units import pack
from phalanx.tasks.chat import IGNORE, collate_rows

GOLDEN = [{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "Héllo wörld — ça va?"},
          {"role": "user", "content": ""},
          {"role": "assistant", "content": "Très bien!"},
          {"role": "user", "content": "More?"},
          {"role": "assistant", "content": "No."}]


@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([SHAKESPEARE.read_text()[:200_000]], 512),
                                **toks.SPECIALS["bpe"])
    assert template.ensure_template(t)
    return t


def encode_one(tok, messages, train_on: str, block: int, truncation: str, where: str = "") -> Encoded | None:
    """One conversation's ids and mask (None: dropped), through the encoder preparation uses; an error names
    `where` as preparation names the record."""
    try:
        got = ChatEncoder(tok, ChatSettings(train_on, truncation, block, template.system_policy(tok))).encode(messages)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return got if isinstance(got, Encoded) else None


def fields(fmt: str, **over) -> formats.ChatFields:
    return formats.chat_fields(fmt, over)


# ---- formats ------------------------------------------------------------------------------------
def test_every_format_gives_the_same_messages():
    want = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    records = {"messages": {"messages": want},
               "sharegpt": {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                              {"from": "gpt", "value": "A"}]},
               "alpaca": {"instruction": "Q", "input": "", "output": "A", "system": "S"},
               "prompt_completion": {"prompt": "Q", "completion": "A", "system": "S"}}
    for fmt, record in records.items():
        assert formats.detect(record, "x") == fmt
        assert formats.to_messages(record, fields(fmt), "x") == want, fmt
    alpaca = formats.to_messages({"instruction": "Q", "input": "ctx", "output": "A"}, fields("alpaca"), "x")
    assert alpaca[0] == {"role": "user", "content": "Q\n\nctx"}
    renamed = formats.to_messages({"q": "Q", "a": "A"}, fields("prompt_completion", prompt="q", completion="a"), "x")
    assert renamed[-1] == {"role": "assistant", "content": "A"}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Q"}]},
                          {"role": "assistant", "content": "A"}]}
    assert formats.to_messages(parts, fields("messages"), "x")[0]["content"] == "Q"


@pytest.mark.parametrize("record, fmt, message", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "field 'messages[0].role': unknown role 'robot'"),
    ({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 1}]}, "messages",
     "field 'messages[0].reasoning_content' should be text"),
    ({"messages": [{"role": "assistant", "content": 3}]}, "messages", "field 'messages[0].content' should be text"),
    ({"messages": "hello"}, "messages", "field 'messages' should be a list of objects, got str"),
    ({"messages": ["hello"]}, "messages", "field 'messages' should be a list of objects"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "sharegpt", "unknown role 'bot'"),
    ({"instruction": "x"}, "alpaca", "missing field 'output'"),
    ({"prompt": "x", "completion": None}, "prompt_completion", "field 'completion' should be text, got NoneType"),
])
def test_records_that_do_not_fit_name_the_field(record, fmt, message):
    with pytest.raises(ConfigError, match="^line 7: .*" + message.replace("[", r"\[").replace("]", r"\]")):
        formats.to_messages(record, fields(fmt), "line 7")
    with pytest.raises(ConfigError, match="not a conversation in a known format"):
        formats.detect({"text": "x"}, "line 7")


# ---- rendering and the mask ---------------------------------------------------------------------
def test_golden_rendering_ids_and_mask(tok):
    enc = encode_one(tok, GOLDEN, "assistant", 1000, "turns", "x")
    # the ids are exactly what transformers' own tokenization of the template gives (no doubled BOS)
    assert enc.ids.tolist() == tok.apply_chat_template(GOLDEN, tokenize=True)["input_ids"]
    text = tok.apply_chat_template(GOLDEN, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHéllo wörld — ça va?<|im_end|>\n"
                    "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\nTrès bien!<|im_end|>\n"
                    "<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\nNo.<|im_end|>\n")
    eot = tok.convert_tokens_to_ids(template.END)
    assert enc.end_of_turn == eot
    # supervised: exactly each assistant reply and its end-of-turn token
    runs, cur = [], []
    for i, m in zip(enc.ids.tolist(), enc.mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [cur], []
    assert [tok.decode(r) for r in runs] == ["Très bien!<|im_end|>", "No.<|im_end|>"]
    assert [r[-1] for r in runs] == [eot, eot]
    # the transformers generation markers agree with the offsets-based mask
    marked = tok.apply_chat_template(GOLDEN, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert np.array_equal(np.asarray(marked["assistant_masks"], dtype=bool), enc.mask)
    last = encode_one(tok, GOLDEN, "last", 1000, "turns", "x")
    assert tok.decode(last.ids[last.mask]) == "No.<|im_end|>"
    everything = encode_one(tok, GOLDEN, "all", 1000, "turns", "x")
    assert everything.mask[1:].all() and not everything.mask[0]


def test_the_mask_follows_any_template(tok):
    """A Llama-3-like template (headers, a different end-of-turn token) masks by offsets, not markers."""
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, **toks.SPECIALS["bpe"])
    other.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    other.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                           "{{ m['content'] | trim }}<|eot_id|>{% endfor %}")
    enc = encode_one(other, GOLDEN, "assistant", 1000, "turns", "x")
    assert enc.ids.tolist() == other.apply_chat_template(GOLDEN, tokenize=True)["input_ids"]
    assert other.decode(enc.ids[enc.mask]) == "Très bien!<|eot_id|>No.<|eot_id|>"


def test_templates_that_cannot_be_masked_drop_the_record_or_are_errors(tok):
    """A record the template changes (upper-cases) or refuses is dropped (counted by the data step, see
    test_chat_templates.py); a template that writes no special end-of-turn token is an error for every record."""
    from transformers import PreTrainedTokenizerFast

    upper = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, **toks.SPECIALS["bpe"])
    upper.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}<|endoftext|>{% endfor %}"
    assert encode_one(upper, GOLDEN, "assistant", 1000, "turns", "x") is None
    no_end = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, **toks.SPECIALS["bpe"])
    no_end.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="^x: the chat template writes no special end-of-turn token"):
        encode_one(no_end, GOLDEN, "assistant", 1000, "turns", "x")
    strict = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, **toks.SPECIALS["bpe"])
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' and loop.previtem is defined and "
                            "loop.previtem['role'] == 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    assert encode_one(strict, GOLDEN, "assistant", 1000, "turns", "x") is None


def _encoder(tok, block: int, truncation: str):
    return ChatEncoder(tok, ChatSettings("assistant", truncation, block, "keep"))


LONG = [{"role": "system", "content": "Speak as in a play."},
        {"role": "user", "content": "First Citizen: Before we proceed any further, hear me speak."},
        {"role": "assistant", "content": "Speak, speak."},
        {"role": "user", "content": "You are all resolved rather to die than to famish?"},
        {"role": "assistant", "content": "Resolved. resolved."},
        {"role": "user", "content": "First, you know Caius Marcius is chief enemy to the people."},
        {"role": "assistant", "content": "We know't, we know't."},
        {"role": "user", "content": "(a trailing question, never answered)"}]


def test_keep_end_drops_the_oldest_exchanges_then_cuts_the_prompt_from_its_start(tok):
    def length(messages):
        return len(tok.apply_chat_template(messages, tokenize=True)["input_ids"])

    full, last_two, last = length(LONG[:7]), length(LONG[:1] + LONG[3:7]), length(LONG[:1] + LONG[5:7])
    kept = _encoder(tok, last_two, "keep_end").encode(LONG)  # the oldest exchange and the trailing turn go
    assert kept.truncated and kept.ids.tolist() == tok.apply_chat_template(LONG[:1] + LONG[3:7], tokenize=True)[
        "input_ids"]
    assert encode_one(tok, LONG, "assistant", full, "keep_end", "x").ids.tolist() == \
        tok.apply_chat_template(LONG[:7], tokenize=True)["input_ids"]  # what follows the last reply: dropped
    block = last - 6
    cut = _encoder(tok, block, "keep_end").encode(LONG)  # the last exchange alone is too long: its prompt is cut
    text = tok.decode(cut.ids)
    assert len(cut.ids) <= block and cut.truncated
    assert text.startswith("<|im_start|>system\nSpeak as in a play.<|im_end|>\n<|im_start|>user\n")  # system stays
    assert text.endswith("<|im_start|>assistant\nWe know't, we know't.<|im_end|>\n")                 # reply whole
    kept_prompt = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    question = LONG[5]["content"]
    assert question.endswith(kept_prompt) and len(kept_prompt) < len(question)
    # cut where a token of the rendering started, not inside one
    rendered = tok.apply_chat_template(LONG[:1] + LONG[5:7], tokenize=False)
    starts = {a for a, _ in tok(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]}
    assert rendered.index(question) + len(question) - len(kept_prompt) in starts
    assert tok.decode(cut.ids[cut.mask]) == "We know't, we know't.<|im_end|>"
    too_long = _encoder(tok, 12, "keep_end").encode(LONG)  # the system message and the reply alone do not fit
    assert isinstance(too_long, Dropped) and too_long.reason == "too_long" and too_long.tokens == length(LONG)


def test_turns_and_right_truncation(tok):
    full = len(encode_one(tok, GOLDEN, "assistant", 1000, "turns", "x").ids)
    first = len(tok.apply_chat_template(GOLDEN[:4], tokenize=True)["input_ids"])
    turns = encode_one(tok, GOLDEN, "assistant", full - 1, "turns", "x")
    assert len(turns.ids) == first and tok.decode(turns.ids[turns.mask]) == "Très bien!<|im_end|>"  # last turn dropped
    right = encode_one(tok, GOLDEN, "assistant", full - 3, "right", "x")
    assert len(right.ids) == full - 3 and tok.decode(right.ids[right.mask]).startswith("Très bien!<|im_end|>")
    cut = encode_one(tok, GOLDEN, "assistant", first - 2, "turns", "x")  # first exchange too long: cut on the right
    assert len(cut.ids) == first - 2 and tok.decode(cut.ids[cut.mask]) in "Très bien!"
    assert encode_one(tok, GOLDEN, "assistant", 20, "turns", "x") is None  # nothing left to learn: dropped


# ---- packing -------------------------------------------------------------------------------------
def test_best_fit_packing_keeps_conversations_whole_and_is_deterministic():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=500)
    order, offsets = pack(lengths, 64)
    assert sorted(order.tolist()) == list(range(500))  # every conversation exactly once
    rows = [order[a:b] for a, b in zip(offsets, offsets[1:])]
    assert all(lengths[r].sum() <= 64 for r in rows)
    fill = np.array([lengths[r].sum() for r in rows])
    assert (fill <= 32).sum() <= 1  # no two rows could be merged: at most one is half empty
    assert len(rows) < 1.1 * lengths.sum() / 64
    again = pack(lengths.copy(), 64)
    assert np.array_equal(again[0], order) and np.array_equal(again[1], offsets)
    shifted, _ = pack(lengths, 64, first=1000)
    assert np.array_equal(shifted, order + 1000)
    with pytest.raises(ValueError):
        pack(np.array([65]), 64)


# ---- packed rows attend within a conversation --------------------------------------------------
def _model(arch: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=520, n_positions=128, n_embd=32, n_layer=2, n_head=2)).eval()
    return LlamaForCausalLM(LlamaConfig(vocab_size=520, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=128)).eval()


def _conversations(tok):
    convs = [GOLDEN[:4], [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}],
             [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One two three"}]]
    return [(e.ids, e.mask) for e in (encode_one(tok, c, "assistant", 64, "turns", "x") for c in convs)]


def _forward(model, batch) -> torch.Tensor:
    """What ChatTask.logits runs: the model inputs the batch has, no key/value cache."""
    return model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch},
                 use_cache=False).logits


def _loss_per_conversation(model, batch, spans) -> tuple[list[torch.Tensor], torch.Tensor]:
    logits = _forward(model, batch)
    per_token = F.cross_entropy(logits.float()[0], batch["labels"][0], ignore_index=IGNORE, reduction="none")
    return [per_token[a:b].sum() for a, b in spans], per_token.sum()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_equals_each_conversation_alone(tok, arch):
    model, convs = _model(arch), _conversations(tok)
    width = sum(len(x) for x, _ in convs) + 5  # and a few pad slots, a segment of their own
    spans, t = [], 0
    for x, _ in convs:
        spans.append((t, t + len(x)))
        t += len(x)

    def packed_run(confine: bool):
        model.zero_grad()
        batch = collate_rows([convs], width, 0)
        assert "attention_mask" not in batch  # transformers builds the masks from the restarting positions
        if not confine:  # the negative control: positions that run on through the whole row
            batch["position_ids"] = torch.arange(width)[None]
        losses, total = _loss_per_conversation(model, batch, spans)
        total.backward()
        return [float(v) for v in losses], {n: p.grad.clone() for n, p in model.named_parameters()}

    alone, grads = [], None
    model.zero_grad()
    for conv in convs:
        batch = collate_rows([[conv]], len(conv[0]), 0)
        (loss,), total = _loss_per_conversation(model, batch, [(0, len(conv[0]))])
        total.backward()
        alone.append(float(loss))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    got, got_grads = packed_run(confine=True)
    assert got == pytest.approx(alone, rel=1e-5, abs=1e-5)
    for n, g in grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=1e-5, msg=n)
    # negative control: without restarting positions, conversations see each other
    leaked, _ = packed_run(confine=False)
    assert leaked[0] == pytest.approx(alone[0], rel=1e-5)  # the first sees nothing before it either way
    assert any(abs(a - b) > 1e-3 for a, b in zip(leaked[1:], alone[1:]))


def test_masked_loss_equals_a_float64_reference(tok):
    from phalanx.tasks.chat import ChatTask

    model, convs = _model("gpt2"), _conversations(tok)
    width = max(sum(len(x) for x, _ in convs[:2]), len(convs[2][0]))
    batch = collate_rows([convs[:2], convs[2:]], width, 0)
    task = ChatTask.__new__(ChatTask)
    with torch.no_grad():
        got = task.loss_sum(model, batch) / task.target_count(batch)
        logits = _forward(model, batch)
    labels = batch["labels"]
    keep = labels != IGNORE
    logp = torch.log_softmax(logits.double(), -1)
    ref = -logp[keep].gather(-1, labels[keep][:, None]).sum() / keep.sum()
    assert abs(float(got) - float(ref)) < 1e-6
    # the count is the supervised tokens only (pads, prompts and headers are never in it)
    assert task.target_count(batch) == sum(int(m[1:].sum()) for _, m in convs)
