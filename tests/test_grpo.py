"""Task grpo (issue 34): prompt data, rewards, the sampler, advantages and losses against float64 scripts, the
global normalisation (with a negative control), 1 process = 2 processes = accumulation 2, and SIGKILL resume.

The model is a tiny random Llama with a ChatML tokenizer (tests/chat_families.py); its completions are noise,
so the rewards come from grpo_test_rewards.length_reward (spread within a group, None for some)."""
from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, final_params, metrics, phalanx, train_losses

from phalanx.core.config import ConfigError, load_config
from phalanx.data.grpo import arithmetic, store
from phalanx.model.sampling import Sampler, Sampling
from phalanx.tasks import grpo_loss as L
from phalanx.tasks.grpo import ROLLOUT, GenerationBatch, GRPOTask
from phalanx.tasks.grpo_rewards import answer_number, load_rewards, reference_number, score

TESTS = Path(__file__).parent
PROMPTS = [{"prompt": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a, b in
           [(2, 3), (4, 4), (10, 3), (6, 2), (9, 9), (5, 5), (3, 3), (7, 1), (8, 2), (1, 1), (12, 30), (40, 2)]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny random Llama with the ChatML family tokenizer, saved as a pretrained folder."""
    from chat_families import family_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = family_tokenizer("chatml")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=256, eos_token_id=tok.eos_token_id,
                                         tie_word_embeddings=False))
    with torch.no_grad():  # the end-of-turn token about 1 draw in 8, so completions have many lengths
        mean = model.model(input_ids=torch.randint(5, 500, (8, 40))).last_hidden_state.reshape(-1, 32).mean(0)
        model.lm_head.weight[tok.eos_token_id] = mean / mean.norm() ** 2 * 2.5
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("grpo-data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return path


def grpo_args(tiny: Path, prompts: Path, cache: Path, *extra) -> list[str]:
    return ["task=grpo", f"model.pretrained={tiny}", f"data.train={prompts}", f"data.validation={prompts}",
            f"data.cache_dir={cache}", "model.block_size=96", "grpo.max_completion_length=16", "grpo.num_generations=4",
            "grpo.reward_funcs=[grpo_test_rewards:length_reward]", "train.lr=2e-3", "train.warmup_steps=0",
            "train.eval_max_samples=2", *extra]


def make_task(tiny, prompts, cache, *extra):
    """A GRPOTask on one process (no worker), with its prompts prepared, model built and attached."""
    cfg = load_config(None, grpo_args(tiny, prompts, cache, *extra))
    GRPOTask.check_config(cfg)
    store.prepare_prompts(cfg, say=lambda _: None)
    info = SimpleNamespace(is_local_main=True, is_main=True, world_size=1, rank=0, device=torch.device("cpu"))
    task = GRPOTask(cfg, info)
    task.open_data()
    torch.manual_seed(0)
    model = task.build_model()
    trainee = SimpleNamespace(model=model, autocast=contextlib.nullcontext, amp_dtype=None)
    task.attach(trainee)
    return task, trainee


# ---- data and rewards ------------------------------------------------------------------------------
def test_math_answer_parses_references_and_completions():
    assert reference_number("She pays 3 + 4 = <<3+4=7>>7.\n#### 1,234") == 1234
    assert reference_number("-12") == -12 and reference_number(7) == 7.0 and reference_number("none") is None
    assert answer_number("so the answer is \\boxed{-3.5}, not 4") == -3.5
    assert answer_number("first 12, then 1,000") == 1000
    assert answer_number("it is \u22125") == -5 and answer_number("$18 in all") == 18
    assert answer_number("\\boxed{\\frac{1}{2}} then 7") == 2  # the boxed part's last number wins over the tail
    assert answer_number("no number") is None


def test_rewards_combine_with_weights_and_user_functions(tmp_path):
    cfg = load_config(None, ["task=grpo", "grpo.reward_funcs=[math_answer, format, grpo_test_rewards:sees_fields]",
                             "grpo.reward_weights=[1.0, 0.5, 2.0]", "grpo.format_pattern=^The answer is"],
                      check_paths=False)
    rewards = load_rewards(cfg)
    got = score(rewards, ["q1", "q2"], ["The answer is 5", "6?"], [[1], [2]], [{"answer": "#### 5"}, {"answer": 6}])
    np.testing.assert_array_equal(got, [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    np.testing.assert_array_equal(L.combined(got, np.array([1.0, 0.5, 2.0])), [3.5, 1.0])


@pytest.mark.parametrize("name, message", [("grpo_test_rewards:raises", "reward function 'grpo_test_rewards:raises' "
                                                                         "raised ValueError: no reward today"),
                                           ("grpo_test_rewards:too_few", "'grpo_test_rewards:too_few' returned 1 "
                                                                         "values for 2 completions")])
def test_a_failing_reward_function_is_named(name, message):
    cfg = load_config(None, ["task=grpo", f"grpo.reward_funcs=[{name}]"], check_paths=False)
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(")):
        score(load_rewards(cfg), ["a", "b"], ["x", "y"], [[1], [2]], [{}, {}])


@pytest.mark.parametrize("overrides, message", [
    (["grpo.reward_funcs=[no_such_module:f]"], "grpo.reward_funcs': cannot import 'no_such_module:f'"),
    (["grpo.reward_funcs=[format]"], "grpo.format_pattern': empty"),
    (["grpo.reward_weights=[1, 2]"], "grpo.reward_weights': 2 weights for 1 reward functions"),
    (["model.pretrained="], "starts from a trained chat model")])
def test_config_errors_before_any_worker(tiny, overrides, message):
    cfg = load_config(None, ["task=grpo", f"model.pretrained={tiny}", "grpo.max_completion_length=16", *overrides],
                      check_paths=False)
    with pytest.raises(ConfigError, match=message):
        GRPOTask.check_config(cfg)
        load_rewards(cfg)


def test_a_malformed_record_names_file_line_and_field(tiny, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "answer": "1"}\n{"question": "no prompt"}\n')
    cfg = load_config(None, grpo_args(tiny, bad, tmp_path / "cache"))
    with pytest.raises(ConfigError, match=rf"data file '{bad}' line 2: missing field 'prompt'"):
        store.prepare_prompts(cfg, say=lambda _: None)
    bad.write_text('{"prompt": "ok"}\n{"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", '
                   '"content": "y"}]}\n')
    with pytest.raises(ConfigError, match=r"line 2: field 'prompt\[1\].role': a prompt ends before the reply"):
        store.prepare_prompts(cfg, say=lambda _: None)


def test_long_prompts_keep_their_end_or_are_dropped_and_counted(tiny, tmp_path):
    data = tmp_path / "long.jsonl"
    long_turns = [{"role": "user", "content": "old " * 30}, {"role": "assistant", "content": "reply"},
                  {"role": "user", "content": "What is 1 + 1?"}]
    data.write_text(json.dumps({"prompt": long_turns}) + "\n" + json.dumps({"prompt": "long " * 80}) + "\n"
                    + json.dumps({"prompt": "short"}) + "\n")
    cfg = load_config(None, grpo_args(tiny, data, tmp_path / "cache", "data.max_dropped_fraction=0.5"))
    summary = store.prepare_prompts(cfg, say=lambda _: None)["train"]
    assert (summary["records"], summary["documents"], summary["truncated"], summary["dropped_by"]) == \
        (3, 2, 1, {"too_long": 1})
    opened = store.open_prompts(cfg).train.records
    assert opened[0]["messages"] == long_turns[2:]  # the oldest exchange went first
    cfg = load_config(None, grpo_args(tiny, data, tmp_path / "cache", "data.max_dropped_fraction=0.1"))
    with pytest.raises(ConfigError, match="data.max_dropped_fraction': 1 of 3 prompts"):
        GRPOTask.check_prepared(cfg)


def test_the_builtin_task_holds_out_a_fixed_set():
    train, held = arithmetic.train(), arithmetic.held_out()
    assert len(train) == arithmetic.TRAIN_SIZE and len(held) == arithmetic.HELD_OUT_SIZE
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert held == arithmetic.held_out()  # a pure function of its seed
    for r in held[:50]:
        assert answer_number(r["answer"]) == eval(r["prompt"].split("What is ")[1].split("?")[0])


# ---- the sampler ----------------------------------------------------------------------------------
def test_completions_depend_on_the_seed_alone(tiny):
    """A row's tokens are a function of (weights, prompt, its seed): the same with other rows beside it, and
    top-k / top-p restrict the draws. Negative control: another seed gives another completion."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    sampler = Sampler(model, [1], Sampling(temperature=0.9))
    prompt = np.arange(5, 25)
    four = sampler.generate(prompt, [11, 12, 13, 14], 12)
    one = sampler.generate(prompt, [13], 12)
    np.testing.assert_array_equal(four.ids[2], one.ids[0])
    # (another batch shape moves the logits' low bits: the task keeps a group's shape fixed, one group per call)
    assert four.truncated[2] == one.truncated[0] and math.isclose(four.entropy[2], one.entropy[0], rel_tol=1e-6)
    assert not np.array_equal(four.ids[0], four.ids[1])
    top1 = Sampler(model, [1], Sampling(top_k=1)).generate(prompt, [1, 2], 10)
    greedy = Sampler(model, [1], Sampling(greedy=True)).generate(prompt, [0], 10)
    np.testing.assert_array_equal(top1.ids[0], greedy.ids[0])
    np.testing.assert_array_equal(top1.ids[1], greedy.ids[0])
    tiny_p = Sampler(model, [1], Sampling(top_p=1e-6)).generate(prompt, [3], 10)
    np.testing.assert_array_equal(tiny_p.ids[0], greedy.ids[0])


# ---- advantages and losses against float64 scripts -----------------------------------------------------
def script_advantages(total: list[float], g: int, scale: str) -> list[float]:
    """TRL's advantages, written out: NaN rewards left out of mean and std, their advantage 0."""
    groups = [total[i:i + g] for i in range(0, len(total), g)]
    everything = [r for r in total if not math.isnan(r)]

    def std(xs):
        xs = [x for x in xs if not math.isnan(x)]
        if len(xs) < 2:
            return math.nan
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    out = []
    for grp in groups:
        ok = [r for r in grp if not math.isnan(r)]
        mean = sum(ok) / len(ok) if ok else math.nan
        for r in grp:
            a = r - mean
            if scale == "group":
                a /= std(grp) + 1e-4
            elif scale == "batch":
                a /= std(everything) + 1e-4
            out.append(0.0 if math.isnan(a) else a)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_the_script_and_an_all_equal_group_is_zero(scale):
    total = np.array([1.0, 0.0, 2.0, 1.0, 3.0, 3.0, 3.0, 3.0, np.nan, 1.0, np.nan, 2.0, np.nan, np.nan, np.nan, np.nan])
    std = L.std_of(L.batch_moments(total)) if scale == "batch" else None
    adv, zero = L.advantages(total, 4, scale, std)
    np.testing.assert_allclose(adv, script_advantages(total.tolist(), 4, scale), rtol=1e-12, atol=1e-12)
    assert adv[4:8].tolist() == [0.0] * 4 and adv[12:].tolist() == [0.0] * 4
    assert zero.tolist() == [False, True, False, True]  # the all-equal group and the unscored one


def test_clipped_surrogate_and_kl_equal_the_script():
    rng = np.random.default_rng(0)
    logp, old, ref = (rng.normal(-2, 0.3, 64) for _ in range(3))
    adv = rng.normal(0, 1, 64)
    got, terms = L.token_losses(*(torch.tensor(x) for x in (logp, old, adv)), 0.2, 0.28, 0.04, torch.tensor(ref))
    for i in range(64):
        ratio = math.exp(logp[i] - old[i])
        want = -min(ratio * adv[i], min(max(ratio, 0.8), 1.28) * adv[i])
        want += 0.04 * (math.exp(ref[i] - logp[i]) - (ref[i] - logp[i]) - 1)
        assert math.isclose(float(got[i]), want, rel_tol=1e-12, abs_tol=1e-12)
        assert bool(terms["low"][i]) == (ratio < 0.8 and adv[i] < 0)
        assert bool(terms["high"][i]) == (ratio > 1.28 and adv[i] > 0)


def float64_logps(model, batch: dict, temperature: float) -> list[list[float]]:
    """Each row's completion-token log-probs from a float64 copy of the model, each row run alone, unpadded."""
    import copy

    m = copy.deepcopy(model).double().eval()
    out = []
    with torch.no_grad():
        for r in range(batch["input_ids"].shape[0]):
            n = int(batch["attention_mask"][r].sum())
            ids, labels = batch["input_ids"][r, :n], batch["labels"][r, :n]
            logits = m(input_ids=ids[None]).logits[0] / temperature
            logp = torch.log_softmax(logits, -1)
            keep = labels != -100
            out.append(logp[keep].gather(1, labels[keep][:, None]).squeeze(1).tolist())
    return out


@pytest.mark.parametrize("loss_type, extra", [("grpo", ["grpo.temperature=0.7"]), ("dr_grpo", []),
                                              ("dapo", ["grpo.beta=0.05", "grpo.mask_truncated_completions=true"])])
def test_the_loss_of_each_type_equals_a_float64_script(tiny, prompts, tmp_path, loss_type, extra):
    """The loss and its gradient's direction: each type's loss of a rollout equals a float64 script over the
    per-token log-probs (a float64 copy of the model, rows alone) and the rewards."""
    task, trainee = make_task(tiny, prompts, tmp_path / "cache", f"grpo.loss_type={loss_type}", *extra)
    g = task.cfg.grpo
    (batch,) = task.rollout(trainee, [task.collate(task.train_set, [0, 1, 2])], step=0)
    totals = task.step_counts(batch)
    loss, sums = task.step_loss(trainee.model, batch, totals)

    total = batch["row_rewards"].tolist()
    adv = script_advantages(total, g.num_generations, g.scale_rewards)
    logps = float64_logps(trainee.model, batch, g.temperature)
    ref = logps  # beta > 0: the reference is the initial model, which the policy still is
    per_row = []
    for r, row in enumerate(logps):
        # on-policy: ratio 1, so l = -A per token, plus beta x k3(ref, logp) (0 here: the reference is the policy)
        per_row.append([-adv[r] + g.beta * (math.exp(ref[r][t] - x) - (ref[r][t] - x) - 1) for t, x in enumerate(row)])
    n, tokens = len(per_row), sum(len(row) for row in per_row)
    if loss_type == "grpo":
        want = sum(sum(row) / max(len(row), 1) for row in per_row) / n
    elif loss_type == "dr_grpo":
        want = sum(map(sum, per_row)) / (n * g.max_completion_length)
    else:
        want = sum(map(sum, per_row)) / max(tokens, 1)
    assert totals == [float(n), float(tokens)]
    assert abs(float(loss) - want) < 1e-6, (float(loss), want)
    assert any(a != 0 for a in adv) and any(len(row) < g.max_completion_length for row in per_row)
    if "grpo.mask_truncated_completions=true" in extra:  # truncated rows: counted as completions, no tokens
        assert tokens < n * g.max_completion_length and sums[1] == n
    # the gradient is the policy gradient: d loss / d logp_t = -A / (normaliser) per token
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainee.model.parameters())


def test_the_adapters_off_reference_under_lora(tiny, prompts, tmp_path):
    """beta > 0 under LoRA: the reference is the policy with its adapters off (no second copy). At the start (B = 0)
    it equals the policy's log-probs; once the adapters move it stays the base's, and the KL is no longer 0."""
    task, trainee = make_task(tiny, prompts, tmp_path / "cache", "model.lora.r=4", "grpo.beta=0.1")
    assert task.reference is None
    (batch,) = task.rollout(trainee, [task.collate(task.train_set, [0, 1])], step=0)
    with torch.no_grad():
        policy = task._token_logps(trainee.model, batch)
    torch.testing.assert_close(batch["ref_logps"], policy, rtol=0, atol=1e-6)
    with torch.no_grad():
        for name, p in trainee.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    (moved,) = task.rollout(trainee, [task.collate(task.train_set, [0, 1])], step=0)
    _, sums = task.step_loss(trainee.model, moved, task.step_counts(moved))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():  # the base, loaded apart
        base = task._token_logps(AutoModelForCausalLM.from_pretrained(tiny).eval(), moved)
    torch.testing.assert_close(moved["ref_logps"], base, rtol=0, atol=1e-6)
    assert sums[len(ROLLOUT) + 3] > 0  # the KL sum
    assert all(p.requires_grad for n, p in trainee.model.named_parameters() if "lora_" in n)


def test_global_normalisation_and_its_negative_control(tiny, prompts, tmp_path):
    """Two micro-batches with the global counts sum to the one-micro-batch loss, and their completions are the
    same; each micro-batch normalised by its own counts (then averaged, as a per-micro-batch mean does) is not."""
    task, trainee = make_task(tiny, prompts, tmp_path / "cache", "grpo.loss_type=dapo")
    whole = task.rollout(trainee, [task.collate(task.train_set, [0, 1, 2, 3])], step=5)
    parts = task.rollout(trainee, [task.collate(task.train_set, [0, 1]), task.collate(task.train_set, [2, 3])], step=5)
    assert torch.equal(torch.cat([p["labels"][p["labels"] != -100] for p in parts]),
                       whole[0]["labels"][whole[0]["labels"] != -100])  # the same completions
    totals = [sum(c) for c in zip(*(task.step_counts(b) for b in parts))]
    with torch.no_grad():
        one = float(task.step_loss(trainee.model, whole[0], task.step_counts(whole[0]))[0])
        split = sum(float(task.step_loss(trainee.model, b, totals)[0]) for b in parts)
        local = sum(float(task.step_loss(trainee.model, b, task.step_counts(b))[0]) for b in parts) / 2
    assert abs(one - split) < 1e-6
    assert task.step_counts(parts[0])[1] != task.step_counts(parts[1])[1]  # the token counts differ ...
    assert abs(one - local) > 1e-4  # ... so per-micro-batch means are another loss


def test_num_iterations_trains_a_generation_batch_again_against_its_old_logps(tiny, prompts, tmp_path):
    """num_iterations = 2: step 0 generates and keeps its rows with the old policy's log-probs (the current ones
    then: ratio 1); step 1 draws the same prompts and trains on the same rows without generating, and once the
    weights moved its loss is the clipped surrogate of exp(logp - old) (a float64 script over a float64 copy of
    the model); the kept rows survive the checkpoint's JSON exactly; step 2 generates anew, and a rank without
    the batch (a resume on another world size) is a config error. Negative control: on-policy log-probs at step
    1 give another loss."""
    task, trainee = make_task(tiny, prompts, tmp_path / "cache", "grpo.num_iterations=2", "grpo.loss_type=dapo",
                              "grpo.epsilon=0.05")
    g, drawn = task.cfg.grpo, [task.collate(task.train_set, [0, 1, 2])]
    (first,) = task.rollout(trainee, drawn, step=0)
    with torch.no_grad():
        torch.testing.assert_close(first["old_logps"], task._token_logps(trainee.model, first), rtol=0, atol=1e-6)
        gen = torch.Generator().manual_seed(0)
        for p in trainee.model.parameters():  # a step's worth of change
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    (again,) = task.rollout(trainee, drawn, step=1)
    for k in ("input_ids", "labels", "token_adv", "old_logps", "row_rewards"):
        torch.testing.assert_close(again[k], first[k], rtol=0, atol=0, equal_nan=True)
    timed = ROLLOUT.index("generation_s")
    assert first["rollout_sums"][timed] > 0 and again["rollout_sums"][timed] == 0

    totals = task.step_counts(again)
    loss, sums = task.step_loss(trainee.model, again, totals)
    logp = [x for row in float64_logps(trainee.model, again, g.temperature) for x in row]
    old, adv = again["old_logps"].double().tolist(), again["token_adv"].double().tolist()
    want = 0.0
    for x, o, a in zip(logp, old, adv):
        ratio = math.exp(x - o)
        want -= min(ratio * a, min(max(ratio, 1 - g.epsilon), 1 + g.epsilon) * a)
    want /= len(logp)
    assert abs(float(loss) - want) < 1e-6, (float(loss), want)
    assert sums[len(ROLLOUT) + 1] + sums[len(ROLLOUT) + 2] > 0  # some tokens clipped: the ratio is not 1
    on_policy, _ = task.step_loss(trainee.model, {k: v for k, v in again.items() if k != "old_logps"}, totals)
    assert abs(float(on_policy) - float(loss)) > 1e-4

    saved = GenerationBatch()
    saved.load_state_dict(json.loads(json.dumps(task.generation.state_dict())))
    assert (saved.step, saved.prompts) == (0, [[0, 1, 2]])
    for k, v in first.items():
        if torch.is_tensor(v):
            torch.testing.assert_close(saved.batches[0][k], v, rtol=0, atol=0, equal_nan=True)
    (fresh,) = task.rollout(trainee, [task.collate(task.train_set, [3, 4, 5])], step=2)
    assert task.generation.step == 2 and fresh["rollout_sums"][timed] > 0
    task.generation = GenerationBatch()
    with pytest.raises(ConfigError, match="resumes on the number of processes that saved it"):
        task.rollout(trainee, [task.collate(task.train_set, [3, 4, 5])], step=3)


def test_the_sampler_repeats_each_global_batch_num_iterations_times():
    """Steps 2k and 2k+1 draw the same global batch, which is step k's of the order without repeats: every
    sample once per num_iterations passes of the steps (TRL's RepeatSampler, per global batch)."""
    from phalanx.data.samplers import GlobalBatchSampler

    once, twice = GlobalBatchSampler(12, 4, 2, seed=3), GlobalBatchSampler(12, 4, 2, seed=3, repeat=2)
    for step in range(8):
        np.testing.assert_array_equal(twice.global_batch(4 * step), once.global_batch(4 * (step // 2)))
    seen = np.concatenate([twice.global_batch(4 * s) for s in range(0, 6, 2)])
    assert sorted(seen.tolist()) == list(range(12)) and twice.epochs(24) == 1.0


# ---- whole runs ----------------------------------------------------------------------------------------
RUN = ["train.global_batch_size=4", "train.max_steps=2", "train.log_every=1", "train.eval_every=0",
       "train.checkpoint_every=0", "dist.threads_per_worker=1", "dist.backend=gloo", "grpo.log_completions_every=1"]
ENV = {"PYTHONPATH": str(TESTS)}


def rollout_metrics(run: Path) -> list[tuple]:
    keys = ("rewards/total/mean", "completions/mean_length", "completions/min_length", "completions/max_length",
            "policy/entropy", "rewards/frac_zero_std")
    # entropy to 6 significant digits: after step 1 the weights differ in their last bits (another sum order)
    return [tuple(float(f"{m[k]:.6g}") for k in keys) for m in metrics(run) if keys[0] in m]


def test_one_process_equals_two_processes_with_accumulation(tiny, prompts, tmp_path, cache_dir):
    """The same completions (their lengths, rewards and entropies, summed over every rank), losses and final
    weights on 1 process (one micro-batch of 4 prompts) and on 2 processes with accumulation 2 (micro-batches
    of 1 prompt), under ddp and under fsdp (sharded weights: the ranks decode in lockstep, and the rank whose
    completions end first keeps making forwards), rewards scaled by the batch's std, with num_iterations 2: step 2
    trains step 1's completions again (off-policy, clipped), step 3 generates. Accumulation alone:
    test_global_normalisation_and_its_negative_control."""
    runs = {}  # scale_rewards=batch: the std of the whole global batch, all-reduced inside the rollout
    for name, extra, nproc in [("one", ["train.micro_batch_size=4"], 1), ("ddp2", ["train.micro_batch_size=1"], 2),
                               # eval: 3 prompts, 1 and 2 per rank, so one rank generates a throw-away in lockstep
                               ("fsdp2", ["train.micro_batch_size=2", "train.strategy=fsdp",
                                          "train.eval_max_samples=3"], 2)]:
        extra += ["grpo.scale_rewards=batch", "grpo.num_iterations=2", "train.max_steps=3"]
        runs[name] = tmp_path / name
        phalanx("train", *grpo_args(tiny, prompts, cache_dir, *RUN, *extra), "--run-dir", runs[name],
                "--nproc-per-node", nproc, env=ENV, check=True, timeout=240)
    base = runs["one"]
    assert len(train_losses(base)) == 3 and rollout_metrics(base)[0][0] == rollout_metrics(base)[0][0]
    assert rollout_metrics(base)[1] == rollout_metrics(base)[0] != rollout_metrics(base)[2]  # step 2 = step 1's batch
    assert [m["time/generation_s"] == 0 for m in metrics(base) if "time/generation_s" in m] == [False, True, False]
    assert [m["eval/samples"] for m in metrics(runs["fsdp2"]) if "eval/samples" in m] == [3]
    for other in ("ddp2", "fsdp2"):
        assert rollout_metrics(runs[other]) == rollout_metrics(base), other
        for step, loss in train_losses(base).items():
            assert abs(train_losses(runs[other])[step] - loss) < 1e-5, (other, step)
        p, q = final_params(runs[other]), final_params(base)
        for name in q:
            torch.testing.assert_close(p[name], q[name], rtol=1e-5, atol=1e-5, msg=name)  # Adam magnifies last bits
    logged = [json.loads(x) for x in (base / "completions.jsonl").read_text().splitlines()]
    assert {x["step"] for x in logged} == {1, 3} and "grpo_test_rewards:length_reward" in logged[0]["rewards"]


@pytest.mark.slow
def test_sigkill_mid_run_resumes_bitwise(tiny, prompts, tmp_path, cache_dir):
    """num_iterations 2, killed at step 4 (checkpoint at 3, inside the generation batch of step 3), the run
    resumes and ends with the uninterrupted run's losses, rollouts and weights, bit for bit: step 4 trains on
    the completions and old log-probs the checkpoint kept per rank, and later generation is a function of the
    weights and (seed, step, prompt, k). That checkpoint on another number of processes is exit 2 before any
    worker starts (each rank kept its own completions)."""
    extra = [*RUN, "train.max_steps=5", "train.checkpoint_every=3", "train.micro_batch_size=2", "grpo.num_iterations=2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    phalanx("train", *grpo_args(tiny, prompts, cache_dir, *extra), "--run-dir", ref, "--nproc-per-node", 2, env=ENV,
            check=True, timeout=240)
    first = phalanx("train", *grpo_args(tiny, prompts, cache_dir, *extra, "debug.fault=kill:rank=1:step=4"),
                    "--run-dir", run, "--nproc-per-node", 2, env=ENV, timeout=240)
    assert first.returncode == 1, first.stderr[-3000:]
    elsewhere = phalanx("train", *grpo_args(tiny, prompts, cache_dir, *extra), "--run-dir", run, "--nproc-per-node", 1,
                        env=ENV, timeout=240)
    assert elsewhere.returncode == 2 and "inside a generation batch" in elsewhere.stderr, elsewhere.stderr[-2000:]
    second = phalanx("train", *grpo_args(tiny, prompts, cache_dir, *extra), "--run-dir", run, "--nproc-per-node", 2,
                     env=ENV, check=True, timeout=240)
    assert "at step 3" in second.stdout
    assert train_losses(run) == train_losses(ref)
    assert rollout_metrics(run)[-2:] == rollout_metrics(ref)[-2:]
    p, q = final_params(run), final_params(ref)
    assert all(torch.equal(p[k], q[k]) for k in q)
    phalanx("chat", run, "--message", "What is 2 + 2?", "--max-new-tokens", 4, check=True)  # RUN/final is a chat model


def test_the_example_config_loads():
    cfg = load_config(str(REPO / "examples" / "grpo.yaml"), check_paths=False)
    assert cfg.task == "grpo" and cfg.grpo.max_completion_length <= 64
    assert sys.modules.get("trl") is None  # phalanx never imports TRL
