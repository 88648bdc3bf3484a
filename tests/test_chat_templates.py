"""Chat templates of the model families (tests/chat_families.py): every reply found by structure, never by
searching for its text; templates that change content (Qwen3's reasoning), refuse a role (Gemma's system),
take keyword arguments (enable_thinking); train_on all; the two tokenizer paths agree."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from chat_families import FAMILIES, family_tokenizer, marker_text

from phalanx.core.errors import ConfigError
from phalanx.data.chat import template
from phalanx.data.chat.encode import ChatEncoder, ChatSettings, Encoded, TiktokenTokens
from phalanx.data.counts import Dropped

EOT = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "mistral": "</s>", "gemma": "<end_of_turn>",
       "gemma3": "<end_of_turn>", "qwen3": "<|im_end|>", "phi3": "<|end|>"}
CASES = 150


def encoder(tok, train_on="assistant", block=100_000, truncation="keep_end", system="auto", tokens=None, **kwargs):
    policy = template.system_policy(tok, system, kwargs)
    return ChatEncoder(tok, ChatSettings(train_on, truncation, block, policy, json.dumps(kwargs, sort_keys=True)),
                       tokens)


def runs(tok, enc: Encoded) -> list[str]:
    """The supervised stretches, decoded."""
    idx = np.flatnonzero(enc.mask)
    return [tok.decode(enc.ids[g].tolist()) for g in np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1) if len(g)]


# ---- the oracle: each reply's place from renderings of the conversation before it ------------------
def opening(tok, name: str, before: list[dict], after_last_user: bool, kwargs: dict) -> str:
    """The text up to where the reply after `before` starts, as each family writes it."""
    if name == "mistral":  # no generation prompt: the reply follows '[/INST]' and a space
        return tok.apply_chat_template(before, tokenize=False) + " "
    if name == "qwen3":  # the think block opens only the turns after the last user message
        return tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=not after_last_user)
    return tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True, **kwargs)


def expected_mask(tok, name: str, messages: list[dict], kwargs: dict) -> np.ndarray:
    """Exactly the tokens whose characters overlap a reply, and the end-of-turn token written after it."""
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"]).reshape(-1, 2)
    mask = np.zeros(len(enc["input_ids"]), dtype=bool)
    last_user = max(k for k, m in enumerate(messages) if m["role"] == "user")
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = opening(tok, name, messages[:i], i > last_user, kwargs)
        lo, hi = len(head), len(head) + len(m["content"])
        assert text.startswith(head) and text[lo:hi] == m["content"] and text.startswith(EOT[name], hi), name
        mask |= (offsets[:, 0] < hi) & (offsets[:, 1] > lo)
        mask[np.flatnonzero(offsets[:, 0] == hi)[0]] = True  # the end-of-turn token
    return mask


def random_conversation(rng: random.Random, marks: str, system: bool) -> list[dict]:
    def text(lo, hi, chars):
        return "".join(rng.choice(chars) for _ in range(rng.randint(lo, hi)))

    messages = [{"role": "system", "content": text(1, 12, marks + " ")}] if system else []
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": text(1, 12, marks + " ").strip() or "?"},
                     {"role": "assistant", "content": text(1, 3, marks)}]
    return messages


def naive_mask(tok, messages: list[dict], text: str) -> np.ndarray:
    """Search for each reply after the previous one (the old way): the permanent negative control."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"]).reshape(-1, 2)
    mask, pos = np.zeros(len(offsets), dtype=bool), 0
    for m in messages:
        if m["role"] == "assistant":
            lo = text.find(m["content"], pos)
            pos = lo + len(m["content"])
            mask |= (offsets[:, 0] < pos) & (offsets[:, 1] > lo)
    return mask


@pytest.mark.parametrize("name", list(FAMILIES))
def test_targets_are_exactly_each_reply_and_its_end_of_turn(name):
    """Replies of 1-3 characters of the template's own markup ("e", "in", "d", "<|"...), every family."""
    tok = family_tokenizer(name)
    kwargs = {"enable_thinking": False} if name == "qwen3" else {}
    enc = encoder(tok, **kwargs)
    marks = "".join(c for c in marker_text(name) if not c.isspace())
    rng, naive_wrong = random.Random(name), 0
    for _ in range(CASES):
        record = random_conversation(rng, marks, rng.random() < 0.3)
        got = enc.encode(record)
        shown = template.fold_system(record) if enc.settings.system == "fold" else record
        assert isinstance(got, Encoded), (name, record, got)
        assert got.ids.tolist() == tok.apply_chat_template(shown, tokenize=True, **kwargs)["input_ids"]
        want = expected_mask(tok, name, shown, kwargs)
        assert np.array_equal(got.mask, want), (name, record, runs(tok, got))
        assert got.end_of_turn == tok.convert_tokens_to_ids(EOT[name])
        text = tok.apply_chat_template(shown, tokenize=False, **kwargs)
        naive_wrong += not np.array_equal(naive_mask(tok, shown, text), want & (got.ids != got.end_of_turn))
    assert naive_wrong > CASES // 10, naive_wrong  # these replies do trip a search for their text


def test_the_issue_cases():
    """'d' under Llama-3, 'e' / 'end' under ChatML (the whole prepare used to exit 2), and a two-turn
    Qwen3 chat whose last reply is 'in' (it used to supervise <think> and <|im_end|> but not 'in')."""
    for name, reply in (("llama3", "d"), ("chatml", "e"), ("chatml", "end")):
        tok = family_tokenizer(name)
        got = encoder(tok).encode([{"role": "user", "content": "Say it"}, {"role": "assistant", "content": reply}])
        assert runs(tok, got) == [reply + EOT[name]]
    tok = family_tokenizer("qwen3")
    chat = [{"role": "user", "content": "Where?"}, {"role": "assistant", "content": "out"},
            {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "in"}]
    assert runs(tok, encoder(tok, enable_thinking=False).encode(chat)) == ["out<|im_end|>", "in<|im_end|>"]
    # without enable_thinking=false the generation prompt does not open the think block: the model writes it
    assert runs(tok, encoder(tok).encode(chat)) == ["out<|im_end|>", "<think>\n\n</think>\n\nin<|im_end|>"]


def test_trimmed_and_untouched_whitespace():
    """Llama-3 and Gemma trim content (`| trim`): the reply's rendered text is what is supervised."""
    for name in ("llama3", "gemma"):
        tok = family_tokenizer(name)
        got = encoder(tok).encode([{"role": "user", "content": "  Hi \n"},
                                   {"role": "assistant", "content": " \nfine \n"}])
        assert runs(tok, got) == ["fine" + EOT[name]]
    tok = family_tokenizer("chatml")  # no trim: the whitespace is part of the reply
    got = encoder(tok).encode([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " fine \n"}])
    assert runs(tok, got) == [" fine \n<|im_end|>"]


# ---- templates that change content, refuse roles, take keyword arguments ----------------------------
def test_qwen3_reasoning_is_trained_where_rendered_and_dropped_before_the_last_user_turn():
    tok = family_tokenizer("qwen3")
    chat = [{"role": "user", "content": "Two plus two?"},
            {"role": "assistant", "content": "Four.", "reasoning_content": "Add them: EARLIER-REASONING."},
            {"role": "user", "content": "Times three?"},
            {"role": "assistant", "content": "Twelve.", "reasoning_content": "Four times three."}]
    got = encoder(tok).encode(chat)
    assert isinstance(got, Encoded)
    assert "EARLIER-REASONING" not in tok.decode(got.ids)  # the template drops it: nothing of it is trained
    assert runs(tok, got) == ["Four.<|im_end|>", "<think>\nFour times three.\n</think>\n\nTwelve.<|im_end|>"]
    # reasoning written inline in the reply (<think>...</think>), which the template moves: same targets
    inline = [{"role": m["role"], "content": (f"<think>{m['reasoning_content']}</think>" if "reasoning_content" in m
                                               else "") + m["content"]} for m in chat]
    again = encoder(tok).encode(inline)
    assert again.ids.tolist() == got.ids.tolist() and np.array_equal(again.mask, got.mask)
    # the old code raised on these (the reasoning is not in the rendering): now a prepare keeps them
    with pytest.raises(ConfigError, match="does not render"):
        old_locate(tok, inline)


def old_locate(tok, messages):
    """The substring search this replaced, for the record (it refused reasoning moved by the template)."""
    text = tok.apply_chat_template(messages, tokenize=False)
    for m in messages:
        if m["content"] not in text and m["content"].strip() not in text:
            raise ConfigError("the chat template does not render a message's content verbatim")


def test_enable_thinking_is_passed_to_the_template_and_baked_into_the_saved_one(tmp_path):
    from transformers import AutoTokenizer

    tok = family_tokenizer("qwen3")
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    off = encoder(tok, enable_thinking=False)
    assert off.renderer.many([chat])[0] == encoder(tok).renderer.many([chat])[0]  # the last turn always opens one
    assert off.renderer.one(chat[:1], True).endswith("<think>\n\n</think>\n\n")
    assert not encoder(tok).renderer.one(chat[:1], True).endswith("</think>\n\n")
    template.bake_defaults(tok, {"enable_thinking": False})
    tok.save_pretrained(tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    prompt = saved.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # rendered as training did
    explicit = saved.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert explicit.endswith("<|im_start|>assistant\n")  # a caller's keyword still wins
    assert template.jinja_literal({"a": [1, None, "x\"y"], "b": True}) == '{"a": [1, none, "x\\"y"], "b": true}'
    with pytest.raises(ConfigError, match="template.kwargs"):
        template.check_kwargs({"add_generation_prompt": True})


def test_a_system_message_the_template_refuses_is_folded_or_exit_2():
    tok = family_tokenizer("gemma")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}]
    assert template.system_policy(tok, "auto") == "fold"
    got = encoder(tok).encode(chat)
    assert "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>" in tok.decode(got.ids)
    assert runs(tok, got) == ["Hello.<end_of_turn>"]
    # keep_end cuts the user's own text from its start, never the folded system text
    question = " ".join(f"word{i}" for i in range(40)) + " end?"
    long = [chat[0], {"role": "user", "content": question}, chat[2]]
    n = len(tok.apply_chat_template(template.fold_system(long), tokenize=True)["input_ids"])
    cut = encoder(tok, block=n - 10).encode(long)
    text = tok.decode(cut.ids)
    kept = text.split("<start_of_turn>user\nBe brief.\n\n")[1].split("<end_of_turn>")[0]
    assert cut.truncated and len(cut.ids) <= n - 10 and question.endswith(kept) and len(kept) < len(question) - 10
    assert runs(tok, cut) == ["Hello.<end_of_turn>"]
    with pytest.raises(ConfigError, match="config key 'template.system_message': keep, but this chat template refuses"):
        template.system_policy(tok, "keep")
    assert isinstance(encoder(tok, system="fold").encode(chat), Encoded)
    # Gemma-3's template folds the system message itself: accepted, kept as it is
    assert template.system_policy(family_tokenizer("gemma3"), "auto") == "keep"
    assert template.fold_system([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]) == [
        {"role": "user", "content": "S"}, {"role": "assistant", "content": "A"}]


def test_records_a_template_cannot_take_are_dropped_with_their_reason():
    tok = family_tokenizer("mistral")
    both = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    got = encoder(tok).encode(both)
    assert isinstance(got, Dropped) and got.reason == "template_refused" and "must alternate" in got.detail
    upper = family_tokenizer("chatml")
    upper.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] | upper }}<|im_end|>{% endfor %}"
    got = encoder(upper).encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert isinstance(got, Dropped) and got.reason == "template_changed"
    none = encoder(family_tokenizer("chatml")).encode([{"role": "user", "content": "only a question"}])
    assert isinstance(none, Dropped) and none.reason == "nothing_to_learn"
    no_end = family_tokenizer("chatml")
    no_end.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="no special end-of-turn token"):  # the template's fault: every record
        encoder(no_end).encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_train_on_all_still_records_the_end_of_turn():
    for name in ("gemma", "chatml"):
        tok = family_tokenizer(name)
        got = encoder(tok, train_on="all").encode([{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Yo"}])
        assert got.mask[1:].all() and got.end_of_turn == tok.convert_tokens_to_ids(EOT[name])
        ends = {tok.convert_tokens_to_ids(t) for t in FAMILIES[name][1]} & set(got.ids.tolist())
        assert encoder(tok).template_tokens([got.ids]) == ends
    tok = family_tokenizer("qwen3")  # <think> is an added token that is not special: the template writes it too
    got = encoder(tok).encode([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    assert encoder(tok).template_tokens([got.ids]) == set(tok.convert_tokens_to_ids(
        ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]))


def test_tiktoken_and_tokenizers_give_the_same_ids_and_masks():
    """Offsets from token byte lengths (tiktoken) equal the tokenizer's own (non-ASCII text included)."""
    from phalanx.data.encoder import _tiktoken_for

    for name in ("llama3", "qwen3"):
        tok = family_tokenizer(name)
        fast = _tiktoken_for(json.loads(tok.backend_tokenizer.to_str()))
        rng = random.Random(1)
        marks = "".join(c for c in marker_text(name) if not c.isspace()) + "héllo wörld — ça va? 日本語 🎭"
        chats = [random_conversation(rng, marks, rng.random() < 0.5) for _ in range(60)]
        for block in (100_000, 40):  # 40: keep_end cuts prompts at token boundaries (bytes vs characters)
            slow, quick = encoder(tok, block=block), encoder(tok, block=block, tokens=TiktokenTokens(fast))
            cut = 0
            for a, b in zip(slow.encode_batch(chats), quick.encode_batch(chats)):
                assert type(a) is type(b)
                if isinstance(a, Encoded):
                    assert a.ids.tolist() == b.ids.tolist() and np.array_equal(a.mask, b.mask)
                    cut += a.truncated
            assert cut > 5 or block > 40
