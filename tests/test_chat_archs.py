"""Chat on the model families people fine-tune, built from tiny transformers configs.

A packed row made by phalanx's collate and run through the task's forward gives each conversation the
loss (and the gradients) it has alone under the model's own default mask (plain transformers, no phalanx
code); so do padded unpacked rows. Sliding windows are shorter than the conversations; Gemma-2 runs eager
attention with soft-capping. Negative controls: positions that do not restart, and the 4-D mask phalanx
used to build, give other losses. Then model.attn_implementation (what is built, what the start line says,
what is refused before any worker starts) and LoRA training the rows of template tokens the base has."""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import SHAKESPEARE, phalanx

from phalanx.core.config import load_config
from phalanx.core.errors import ConfigError
from phalanx.tasks.chat import IGNORE, MODEL_INPUTS, ChatTask

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
    """What ChatTask.collate reads of a store's samples (data/units.py UnitSet): sequences(i), and lengths (None:
    packed rows)."""

    def __init__(self, rows, packed: bool):
        self.rows = rows
        self.lengths = None if packed else np.array([sum(len(x) for x, _ in r) for r in rows])

    def sequences(self, i):
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
    """Loss sum per (row, start, end) span, from the task's own forward (the output head only at the targets);
    and the logits of a plain forward of the whole batch (pad tails included)."""
    keep = batch["labels"] != IGNORE
    per_token = torch.zeros(keep.shape).masked_scatter(keep, -task.target_logps(model, batch).logp.float())
    logits = model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}, use_cache=False).logits
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


def packed_batch(task, conversations) -> tuple[dict, list, list[int]]:
    """Two packed rows from the task's own collate; the (row, start, end) span of each conversation, and
    which conversation each span is."""
    rows = [[conversations[c] for c in row] for row in PACKED]
    batch = task.collate(Rows(rows, packed=True), range(len(PACKED)))
    assert "attention_mask" not in batch and all(v.dim() <= 2 for v in batch.values() if torch.is_tensor(v))
    return batch, spans_of(PACKED, conversations), [c for row in PACKED for c in row]


@pytest.mark.parametrize("arch, impl", CASES)
def test_packed_rows_equal_each_conversation_alone(conversations, arch, impl):
    ref, model = models(arch, impl)
    task = chat_task()
    batch, spans, order = packed_batch(task, conversations)
    with torch.no_grad():
        want = [float(alone(ref, conversations[c])) for c in order]
        got, logits = per_conversation(task, model, batch, spans)
        assert torch.isfinite(logits).all()  # the pad tails too (their own segment, labels -100)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
        # negative controls: positions that do not restart let the second conversation see the first; the
        # old 4-D mask was taken as final (no sliding window) and eager attention added it to the scores (a
        # boolean adds 0 or 1: no mask at all); it was right only for sdpa without a window
        seen, _ = per_conversation(task, model, {**batch, "position_ids": torch.arange(WIDTH).expand(2, -1)}, spans)
        assert abs(seen[1] - want[1]) > 1e-3
        if impl != "flex_attention":
            before, _ = per_conversation(task, model, old_mask(batch), spans)
            assert (max(abs(a - b) for a, b in zip(before, want)) > 1e-3) == (impl == "eager" or arch in WINDOWED)


@pytest.mark.parametrize("arch, impl", [pytest.param(*c.values, marks=pytest.mark.slow) if "flex" in c.values[1]
                                        else c for c in CASES])
def test_padded_rows_equal_each_conversation_alone(conversations, arch, impl):
    """data.packing=false: one conversation per row, padded on the right to the longest, a 2-D mask."""
    ref, model = models(arch, impl)
    task = chat_task()
    padded = task.collate(Rows([[c] for c in conversations], packed=False), range(len(conversations)))
    assert padded["attention_mask"].shape == (3, max(LENGTHS)) and "position_ids" not in padded
    spans = [(r, 0, n) for r, n in enumerate(LENGTHS)]
    with torch.no_grad():
        want = [float(alone(ref, c)) for c in conversations]
        got, logits = per_conversation(task, model, padded, spans)
        assert torch.isfinite(logits).all()
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
        if impl != "flex_attention":  # negative control: the old 4-D mask (see above)
            before, _ = per_conversation(task, model, old_mask(padded), spans)
            assert (max(abs(a - b) for a, b in zip(before, want)) > 1e-3) == (impl == "eager" or arch in WINDOWED)


# torch's FlexAttention has no backward pass on the CPU (phalanx refuses it there: see below)
@pytest.mark.parametrize("arch, impl", [c for c in CASES if c.values[1] != "flex_attention"])
def test_packed_gradients_equal_each_conversation_alone(conversations, arch, impl):
    ref, model = models(arch, impl)
    task = chat_task()
    batch, _, _ = packed_batch(task, conversations)
    task.loss_sum(model, batch).backward()
    sum(alone(ref, c) for c in conversations).backward()
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-4, atol=1e-5, msg=name)


# ---- model.attn_implementation -------------------------------------------------------------------
@pytest.mark.parametrize("arch, impl, runs", [("gpt2", "auto", "sdpa"), ("gpt2", "eager", "eager"),
                                              ("llama", "auto", "sdpa"), ("llama", "flex_attention", "flex_attention")])
def test_the_built_model_runs_the_chosen_attention(arch, impl, runs):
    from phalanx.model.build import attention_in_use, build_causal_lm

    cfg = load_config(None, [f"model.arch={arch}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                             f"model.attn_implementation={impl}"], check_paths=False)
    model = build_causal_lm(cfg.model, 64, 0, seed=0)
    assert model.config._attn_implementation == attention_in_use(model) == runs
    assert attention_in_use(torch.compile(model)) == runs  # what the loop's forward may be


def test_flash_attention_gets_the_micro_batch_as_one_row(conversations, monkeypatch):
    """flash_attention_2 finds packed conversations from the position ids of a single row only
    (transformers' _is_packed_sequence): the task's forward hands it the micro-batch flattened into one
    row and gives the logits back per row. sdpa stands in for it here (no flash-attn on the CPU; it confines
    the segments of one row too); bench/gpu_big_check.py runs the real kernel."""
    import phalanx.tasks.chat as chat

    ref, model = models("llama", "sdpa")
    task = chat_task()
    batch, spans, order = packed_batch(task, conversations)
    shapes = []
    with torch.no_grad():
        task.target_logps(model, batch)
        monkeypatch.setattr(chat, "attention_in_use", lambda m: "flash_attention_2")
        model.register_forward_pre_hook(lambda m, args, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                        with_kwargs=True)
        got, _ = per_conversation(task, model, batch, spans)
        want = [float(alone(ref, conversations[c])) for c in order]
    assert shapes[0] == (1, 2 * WIDTH)  # the task's forward; then per_conversation's plain one
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_a_pretrained_model_keeps_its_own_default(tmp_path):
    """auto = what the architecture chooses (Gemma-2: eager, it has no SDPA); one it lacks is exit 2."""
    import transformers as T

    from phalanx.model.build import build_causal_lm

    hf_config("gemma2").save_pretrained(tmp_path)
    T.GenerationConfig().save_pretrained(tmp_path)
    torch.manual_seed(0)
    T.Gemma2ForCausalLM(hf_config("gemma2")).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.pretrained={tmp_path}"], check_paths=False)
    assert build_causal_lm(cfg.model, VOCAB, 0, seed=0).config._attn_implementation == "eager"
    cfg.model.attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match=r"'model.attn_implementation': sdpa is not available: Gemma2ForCausalLM"):
        build_causal_lm(cfg.model, VOCAB, 0, seed=0)


def test_attention_checks_against_the_machine():
    from phalanx.model.build import check_attention

    m = load_config(None, ["model.attn_implementation=flash_attention_2"], check_paths=False).model
    with pytest.raises(ConfigError, match="flash-attn package, which is not installed"):
        check_attention(m, "cuda")
    m.attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="no backward pass on the CPU"):
        check_attention(m, "cpu")
    check_attention(m, "cuda")
    for impl in ("auto", "sdpa", "eager"):
        m.attn_implementation = impl
        check_attention(m, "cpu")


TINY = ["task=chat", "model.arch=llama", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
        "model.block_size=64", "data.vocab_size=300", "train.global_batch_size=4", "train.micro_batch_size=4",
        "train.max_steps=2", "train.log_every=1", "train.eval_every=0", "log.progress=lines",
        "dist.threads_per_worker=1", "dist.backend=gloo"]


@pytest.fixture(scope="module")
def talk(tmp_path_factory):
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if line.strip()][:200]
    path = tmp_path_factory.mktemp("talk") / "talk.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": lines[i]},
                                                     {"role": "assistant", "content": lines[i + 1]}]}) + "\n"
                            for i in range(0, 200, 2)))
    return path


def test_the_start_line_names_the_attention_and_flash_without_its_package_is_exit_2(tmp_path, talk, cache_dir):
    common = ["train", f"data.train={talk}", f"data.cache_dir={cache_dir}", *TINY]
    proc = phalanx(*common, "--run-dir", tmp_path / "eager", "model.attn_implementation=eager", check=True,
                   timeout=240)
    start = next(line for line in proc.stdout.splitlines() if line.startswith("phalanx: task chat"))
    assert ", attention eager," in start + ",", start
    run = tmp_path / "flash"  # (flex on the CPU goes through the same launcher check: see above)
    proc = phalanx(*common, "--run-dir", run, "model.attn_implementation=flash_attention_2", timeout=120)
    assert proc.returncode == 2 and "flash-attn package" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and not (run / "logs").exists()


def test_the_start_line_says_auto(tmp_path):
    from phalanx.core import dist
    from phalanx.model.build import build_causal_lm
    from phalanx.run import train as train_mod

    cfg = load_config(None, ["model.arch=llama", "model.n_layer=1", "model.n_embd=32", "model.n_head=2"],
                      check_paths=False)
    info = dist.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, attempt=0,
                         backend="gloo", device=torch.device("cpu"))
    task = SimpleNamespace(build_model=lambda builder: build_causal_lm(cfg.model, 64, 0, seed=0))
    tr = train_mod.build_trainee(cfg, info, task)
    assert ", attention sdpa (auto)," in train_mod.start_line(cfg, info, tr, 1) + ","


# ---- LoRA: template tokens the base already has ---------------------------------------------------
def test_lora_trains_the_rows_of_template_tokens_the_base_already_has(tmp_path):
    """A base whose tokenizer already has <|im_start|>/<|im_end|> (the vocabulary does not grow) but whose
    rows for them never trained: under LoRA those rows (input embedding, and the untied output embedding)
    train as peft's trainable tokens; every other row stays bit-identical. Negative control: without the
    store's template_tokens no row moves."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from phalanx.data.chat import template
    from phalanx.data import tokenizer as toks
    from phalanx.model.optim import build_optimizer

    tok = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([SHAKESPEARE.read_text()[:50_000]], 300),
                                  **toks.SPECIALS["bpe"])
    tok.add_special_tokens({"additional_special_tokens": [template.START, template.END]})
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMALL, "vocab_size": len(tok)}, tie_word_embeddings=False,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tmp_path)
    template = sorted(tok.convert_tokens_to_ids([template.START, template.END]))
    cfg = load_config(None, ["task=chat", f"model.pretrained={tmp_path}", "model.lora.r=4", "model.block_size=32",
                             "train.lr=1e-2"], check_paths=False)
    rng = np.random.default_rng(0)
    rows = [[(np.array([template[0], *rng.integers(3, 200, 10), template[1]]), np.array([0] * 6 + [1] * 6, bool))]
            for _ in range(4)]

    def changed_rows(template_tokens):
        task = ChatTask(cfg, info=None)
        task.tokenizer, task.data = tok, SimpleNamespace(template_tokens=template_tokens)
        torch.manual_seed(0)
        model = task.build_model()
        assert task.base_vocab == len(tok)  # nothing grew
        opt = build_optimizer(model, cfg.train)
        for _ in range(3):
            task.loss_sum(model, task.collate(Rows(rows, packed=True), range(4))).backward()
            opt.step()
            opt.zero_grad()
        merged = model.merge_and_unload()
        return {name: sorted((merged.get_parameter(name) != base.get_parameter(name)).any(1).nonzero()[:, 0].tolist())
                for name in ("model.embed_tokens.weight", "lm_head.weight")}

    assert changed_rows(template) == {"model.embed_tokens.weight": template, "lm_head.weight": template}
    assert changed_rows([]) == {"model.embed_tokens.weight": [], "lm_head.weight": []}
