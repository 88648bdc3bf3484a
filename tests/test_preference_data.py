"""task: preference, the data: TRL's pair formats, rendering exactly as task chat renders, truncation of the
prompt from the left for both replies alike, prompts that do not prefix their replies refused and counted,
bad records exit 2 naming file, line and field, the store (whole pairs per packed row), --show."""
from __future__ import annotations

import json
import numpy as np
import pytest
from chat_families import FAMILIES, family_tokenizer
from conftest import SHAKESPEARE, phalanx

from phalanx.core.config import load_config
from phalanx.core.errors import ConfigError
from phalanx.data import builtin, counts, prepare
from phalanx.data.chat import template
from phalanx.data import tokenizer as toks
from phalanx.data.chat.encode import ChatEncoder, ChatSettings
from phalanx.data.counts import Dropped
from phalanx.data.pref.encode import EncodedPair, PairEncoder
from phalanx.data.pref.records import Pair, PairFields, to_pair
from phalanx.data.pref.store import PREFERENCE

SYSTEM, Q, A, B = "Be brief.", "What is red?", "A colour.", "A fruit, surely."
WANT = Pair([{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q}],
            [{"role": "assistant", "content": A}], [{"role": "assistant", "content": B}])


@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([SHAKESPEARE.read_text()[:200_000]], 512),
                                **toks.SPECIALS["bpe"])
    assert template.ensure_template(t)
    return t


def encoder(tok, block=100_000, **kwargs) -> PairEncoder:
    policy = template.system_policy(tok, "auto", kwargs)
    return PairEncoder(tok, ChatSettings("assistant", "keep_end", block, policy, json.dumps(kwargs, sort_keys=True)))


# ---- formats and bad records ----------------------------------------------------------------------------
def test_every_format_gives_the_same_pair():
    conv = [m for m in WANT.prompt]
    records = {"explicit text": ({"prompt": Q, "chosen": A, "rejected": B, "system": SYSTEM}, "explicit"),
               "explicit messages": ({"prompt": conv, "chosen": WANT.chosen, "rejected": WANT.rejected}, "explicit"),
               "implicit": ({"chosen": conv + WANT.chosen, "rejected": conv + WANT.rejected}, "implicit")}
    for name, (record, fmt) in records.items():
        assert to_pair(record, PairFields(), "auto", "x") == WANT, name
        assert to_pair(record, PairFields(), fmt, "x") == WANT, name
    renamed = {"q": conv, "good": A, "bad": B}
    assert to_pair(renamed, PairFields("q", "good", "bad"), "auto", "x") == WANT


@pytest.mark.parametrize("record, message", [
    ({"prompt": Q, "rejected": B}, "missing field 'chosen'"),
    ({"prompt": Q, "chosen": 3, "rejected": B}, "field 'chosen' should be text or a list of messages, got int"),
    ({"prompt": Q, "chosen": {"x": 1}, "rejected": B}, "field 'chosen' should be text or a list of messages"),
    ({"prompt": Q, "chosen": A, "rejected": A}, "field 'rejected': the same reply as 'chosen'"),
    ({"prompt": Q, "chosen": [{"role": "user", "content": A}], "rejected": B},
     "field 'chosen[0].role': a reply holds assistant messages, got 'user'"),
    ({"prompt": 7, "chosen": A, "rejected": B}, "field 'prompt' should be text or a list of messages, got int"),
    ({"chosen": [{"role": "user", "content": Q}, {"role": "assistant", "content": A}],
      "rejected": [{"role": "user", "content": "Other?"}, {"role": "assistant", "content": B}]},
     "fields 'chosen' and 'rejected' share no prompt"),
    ({"chosen": Q + A, "rejected": Q + B}, "field 'chosen' should be a list of messages"),
    ({"chosen": [{"role": "user", "content": Q}, {"role": "assistant", "content": A}]}, "missing field 'rejected'"),
    ({"prompt": [{"role": "user", "content": 5}], "chosen": A, "rejected": B}, "field 'prompt[0].content' should "
                                                                                "be text"),
])
def test_malformed_records_name_the_field(record, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        to_pair(record, PairFields(), "auto", "x")


def test_bad_records_are_exit_2_naming_file_line_and_field_before_any_worker(tmp_path, cache_dir):
    good = {"prompt": Q, "chosen": A, "rejected": B}
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good, good, {"prompt": Q, "chosen": A, "rejected": A}]) + "\n")
    proc = phalanx("train", "task=preference", f"data.train={path}", f"data.cache_dir={tmp_path / 'c'}",
                   "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.vocab_size=300",
                   "--run-dir", tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert f"data file '{path}' line 3: field 'rejected': the same reply as 'chosen'" in line
    assert not (tmp_path / "run" / "logs").exists()  # no worker started
    assert not list((tmp_path / "c").glob("pref-*/index.json"))  # nothing half-written is taken as done


# ---- rendering, exactly as chat --------------------------------------------------------------------------
def _chat_last_reply(tok, messages, **kwargs):
    """What task chat trains on for the conversation's last reply (train_on=last)."""
    policy = template.system_policy(tok, "auto", kwargs)
    enc = ChatEncoder(tok, ChatSettings("last", "keep_end", 100_000, policy, json.dumps(kwargs, sort_keys=True)))
    return enc.encode(messages)


@pytest.mark.parametrize("family", ["chatml-phalanx", *sorted(FAMILIES)])
def test_each_reply_renders_and_masks_exactly_as_chat(tok, family):
    """Prompt + reply ids are the template's own tokenization (apply_chat_template), the prompt's ids (with
    the generation prompt) prefix them, and the targets are exactly what task chat trains on for that last
    reply: never a prompt token, though the prompt holds an earlier assistant turn."""
    t = tok if family == "chatml-phalanx" else family_tokenizer(family)
    prompt = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": Q}]
    got = encoder(t).encode(Pair(prompt, WANT.chosen, WANT.rejected))
    assert isinstance(got, EncodedPair), got
    head = t.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert got.prompt_tokens == len(head)
    for seq, reply in ((got.chosen, WANT.chosen), (got.rejected, WANT.rejected)):
        assert seq.ids.tolist() == t.apply_chat_template(prompt + reply, tokenize=True)["input_ids"]
        assert seq.ids[:len(head)].tolist() == head
        chat = _chat_last_reply(t, prompt + reply)
        assert np.array_equal(seq.mask, chat.mask) and not seq.mask[:len(head)].any()
        assert seq.mask.any() and not seq.truncated


def test_truncation_cuts_the_prompt_from_the_left_the_same_for_both_replies(tok):
    """A prompt too long for model.block_size loses its oldest exchange, then the start of the user turn
    left, the system message staying; the cut is fitted to the longer reply and the same prompt tokens go
    before both; no reply token is cut. A pair whose reply alone does not fit is dropped."""
    long_user = " ".join(SHAKESPEARE.read_text().split()[:60])
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question?"},
              {"role": "assistant", "content": "First answer."}, {"role": "user", "content": long_user}]
    chosen, rejected = [{"role": "assistant", "content": "Short."}], [{"role": "assistant", "content": B * 3}]
    full = encoder(tok).encode(Pair(prompt, chosen, rejected))
    block = len(full.rejected.ids) - 40
    got = encoder(tok, block).encode(Pair(prompt, chosen, rejected))
    assert isinstance(got, EncodedPair) and got.truncated and got.chosen.truncated and got.rejected.truncated
    assert len(got.rejected.ids) <= block and len(got.rejected.ids) > block - 8  # fitted to the longer reply
    head = got.chosen.ids[:got.prompt_tokens]
    assert np.array_equal(got.rejected.ids[:got.prompt_tokens], head)
    text = tok.decode(head.tolist())
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>") and "First question" not in text
    assert long_user.split()[-1] in text and long_user.split()[0] not in text.split("user\n")[-1][:20]
    for seq, reply in ((got.chosen, chosen), (got.rejected, rejected)):
        assert tok.decode(seq.ids[seq.mask].tolist()) == reply[0]["content"] + template.END
        assert np.array_equal(seq.mask[got.prompt_tokens:], getattr(full, "chosen" if reply is chosen else
                                                                    "rejected").mask[full.prompt_tokens:])
    dropped = encoder(tok, 12).encode(Pair(prompt, chosen, rejected))
    assert isinstance(dropped, Dropped) and dropped.reason == "too_long"


# A template whose generation prompt opens the reply with '<think>\n' while a rendered reply has none (as
# DeepSeek-R1's does): the prompt alone is not what precedes a reply in training.
THINK_PROMPT = template.CHATML_TEMPLATE.replace("{{ '<|im_start|>assistant\\n' }}",
                                         "{{ '<|im_start|>assistant\\n<think>\\n' }}")


def test_a_prompt_that_does_not_prefix_its_reply_is_refused_and_counted(tok):
    """The prompt's tokens (with the generation prompt) must be the first tokens of prompt + reply, else the
    model would be trained on a context inference never gives (trl#2054): the pair is dropped as
    prompt_not_prefix, counted, and the dropped-fraction gate names it. Negative control: the same pair under
    the template whose generation prompt is what precedes a reply is kept."""
    import copy

    assert THINK_PROMPT != template.CHATML_TEMPLATE
    think = copy.deepcopy(tok)
    think.chat_template = THINK_PROMPT
    bad = encoder(think).encode(WANT)
    assert isinstance(bad, Dropped) and bad.reason == "prompt_not_prefix" and "chosen" in bad.detail
    assert isinstance(encoder(tok).encode(WANT), EncodedPair)
    tally = counts.Tally()
    tally.add(0, bad)
    record = {**tally.record(), "source": "pairs.jsonl", "kind": "docs", "range": [0, 1]}
    index = {"summary": counts.summary([record]), "shards": [record]}
    assert index["summary"]["dropped_by"] == {"prompt_not_prefix": 1}
    message = counts.gate("data.train", "pairs.jsonl", index, 0.05, "keep_end", 128)
    assert "prompt tokens not a prefix of prompt + reply 1" in message and "token boundary" in message


# ---- the store and --show ----------------------------------------------------------------------------
def test_builtin_pairs_and_the_store_hold_whole_pairs_per_row(tmp_path):
    pairs = builtin.stdlib_preference_pairs()
    assert len(pairs) > 1000 and pairs == builtin.stdlib_preference_pairs()
    for p in pairs[:50]:
        assert sorted(p["chosen"][0]["content"].split()) == sorted(p["rejected"][0]["content"].split())
        assert p["chosen"] != p["rejected"] and p["prompt"][-1]["role"] == "user"
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs[:120]))
    cfg = load_config(None, ["task=preference", f"data.train={path}", f"data.cache_dir={tmp_path / 'c'}",
                             "data.vocab_size=400", "model.block_size=96", "data.max_dropped_fraction=0.5"])
    summary = prepare.prepare(cfg, PREFERENCE, workers=1, progress=False, say=lambda s: None)["train"]
    data = prepare.open_prepared(cfg, PREFERENCE)
    seen = [p for part in (data.train, data.validation) for i in range(len(part)) for p in part.unit_ids(i)]
    assert sorted(seen) == list(range(summary["pairs"])) and summary["pairs"] + summary["dropped"] == 120
    for i in range(len(data.train)):
        ids = data.train.unit_ids(i)
        assert sum(len(s[0]) for p in ids for s in data.train.units.unit(p)) <= 2 * 96
    (c, cm), (r, rm) = data.train.units.unit(0)
    first = int(np.argmax(cm))
    assert np.array_equal(c[:first], r[:first]) and cm.sum() and rm.sum()


def test_prepare_show_prints_the_prompt_both_replies_and_their_targets(tmp_path, cache_dir):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{Q} {i}", "chosen": A, "rejected": B}) + "\n" for i in range(30)))
    proc = phalanx("prepare", "task=preference", f"data.train={path}", f"data.cache_dir={cache_dir}",
                   "data.vocab_size=300", "--quiet", "--show", 2, check=True)
    assert "pairs 30" in proc.stdout and proc.stdout.count("--- pair ") == 2
    shown = proc.stdout.split("--- pair ")[1]
    assert "[prompt]\n<|im_start|>user\nWhat is red?" in shown and "<|im_start|>assistant\n" in shown
    assert f"[chosen]\n[[{A}<|im_end|>]]" in shown and f"[rejected]\n[[{B}<|im_end|>]]" in shown
