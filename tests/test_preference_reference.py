"""task: preference, the three references in one process (a real one-process Gloo group, the trainer's own
build): adapters_off == model == precomputed log-probs on the same pairs; the adapters really are off (with
them on the policy differs); the precomputed ones are reused for the same key, recomputed (never read) for a
changed base or changed data, and a killed pass resumes where it stopped."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHAKESPEARE, small_gpt2_base

from phalanx.core.config import load_config
from phalanx.data import prepare
from phalanx.data.pref.store import PREFERENCE
from phalanx.run.trainee import build_trainee
from phalanx.tasks import pref_reference
from phalanx.tasks.preference import PreferenceTask


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small pretrained GPT-2 whose tokenizer has no chat template (the template's two tokens are grown)."""
    return small_gpt2_base(tmp_path_factory.mktemp("base"), 100_000, 400, positions=64, width=32)


def write_pairs(path: Path, n: int, offset: int = 0) -> Path:
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if len(line.split()) > 2]
    path.write_text("".join(json.dumps({"prompt": lines[2 * i + offset], "chosen": lines[2 * i + 1],
                                        "rejected": " ".join(lines[2 * i + 1].split()[::-1])}) + "\n"
                            for i in range(n)))
    return path


def config(base: Path, data: Path, cache: Path, *extra):
    return load_config(None, ["task=preference", f"model.pretrained={base}", f"data.train={data}",
                              f"data.cache_dir={cache}", "model.block_size=64", "train.micro_batch_size=4",
                              "train.global_batch_size=8", "data.val_fraction=0.1", *extra])


def attached(cfg, info) -> PreferenceTask:
    prepare.prepare(cfg, PREFERENCE, workers=1, progress=False, say=lambda s: None)
    task = PreferenceTask(cfg, info)
    task.open_data()
    task.trainee = build_trainee(cfg, info, task)
    task.attach(task.trainee)
    return task


def reference_of(task, dataset, k: int = 6) -> torch.Tensor:
    """The reference log-probs of the first k samples of `dataset`, through the task's Reference."""
    out = []
    for i in range(min(k, len(dataset))):
        batch = task.collate(dataset, [i])
        with task.trainee.autocast():
            out.append(task.reference.logps(batch).double())
    return torch.cat(out)


def test_adapters_off_equals_the_model_copy_equals_precomputed(pg, base, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", 40)
    full = attached(config(base, data, tmp_path / "c", "preference.reference=precomputed"), pg)
    assert full.reference.name == "precomputed" and full.train_set.reference is not None
    lora = attached(config(base, data, tmp_path / "c", "model.lora.r=4"), pg)
    assert lora.reference.name == "adapters_off" and lora.reference.model is lora.trainee.model
    copy = attached(config(base, data, tmp_path / "c", "model.lora.r=4", "preference.reference=model",
                           "preference.reference_dtype=fp32"), pg)
    assert copy.reference.name == "model" and copy.reference.model is not copy.trainee.model
    assert not any(p.requires_grad for p in copy.reference.model.parameters())
    for dataset in ("train_set", "val_set"):
        want = reference_of(full, getattr(full, dataset))
        torch.testing.assert_close(reference_of(lora, getattr(lora, dataset)), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reference_of(copy, getattr(copy, dataset)), want, rtol=1e-5, atol=1e-5)
    # the adapters are really off: moved away from their initial values, the policy differs, the reference not
    with torch.no_grad():
        for p in lora.trainee.model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    batch = lora.collate(lora.train_set, [0])
    with torch.no_grad():
        policy = lora.sequence_logps(lora.trainee.model, batch).double()
    off = lora.reference.logps(batch).double()
    assert (policy - off).abs().max() > 1e-2
    torch.testing.assert_close(off, reference_of(full, full.train_set, 1), rtol=1e-5, atol=1e-5)
    assert lora.trainee.model.training  # the reference pass leaves the policy in training mode


def _folders(cache: Path) -> set[Path]:
    return {p for p in cache.glob("pref-*/reference-*") if (p / "key.json").is_file()}


def test_precomputed_is_reused_and_recomputed_for_another_base_or_data(pg, base, tmp_path, monkeypatch):
    data, cache = write_pairs(tmp_path / "pairs.jsonl", 40), tmp_path / "c"
    first = attached(config(base, data, cache), pg)
    assert first.reference.name == "precomputed"  # auto without LoRA
    (made,) = _folders(cache)
    calls = []
    real = pref_reference.compute
    monkeypatch.setattr(pref_reference, "compute", lambda *a: calls.append(a) or real(*a))
    again = attached(config(base, data, cache), pg)
    assert calls == [] and np.array_equal(again.train_set.reference, first.train_set.reference)

    other = tmp_path / "other-base"  # the same files but one weight changed: another base by content
    shutil.copytree(base, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    weights["transformer.h.0.mlp.c_fc.weight"][0, 0] += 0.5
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    changed = attached(config(other, data, cache, f"data.tokenizer={base}"), pg)
    assert len(calls) == 1 and len(_folders(cache)) == 2
    assert not np.allclose(changed.train_set.reference, first.train_set.reference)

    write_pairs(data, 40, offset=1)  # the same file, other pairs: the store is prepared again
    moved = attached(config(base, data, cache), pg)
    assert len(calls) == 2 and len(_folders(cache)) == 3
    fresh = reference_of(first, first.train_set, 2)  # the old values, for the old data ...
    assert not torch.allclose(reference_of(moved, moved.train_set, 2), fresh)  # ... are not the new data's


def test_a_killed_precompute_pass_resumes_where_it_stopped(pg, base, tmp_path, monkeypatch):
    """Chunks are written as they are done: a pass stopped after its first chunk leaves it, the next run
    computes only the others, and the result equals an uninterrupted pass."""
    monkeypatch.setattr(pref_reference, "CHUNK", 8)
    data, cache = write_pairs(tmp_path / "pairs.jsonl", 30), tmp_path / "c"
    cfg = config(base, data, cache)
    forwards = []
    real = pref_reference.reference_logps

    def counted(task, model, batch):
        forwards.append(batch["pairs"])
        if len(forwards) == 3:  # the first chunk (8 pairs, 2 micro-batches of 4) is done: die in the second
            raise KeyboardInterrupt("killed")
        return real(task, model, batch)

    monkeypatch.setattr(pref_reference, "reference_logps", counted)
    with pytest.raises(KeyboardInterrupt):
        attached(cfg, pg)
    (folder,) = cache.glob("pref-*/reference-*")
    assert [p.name for p in folder.glob("chunk-*.npy")] == ["chunk-000000.npy"] and not (folder / "key.json").exists()
    forwards.clear()
    monkeypatch.setattr(pref_reference, "reference_logps", lambda *a: forwards.append(a[2]["pairs"]) or real(*a))
    resumed = attached(cfg, pg)
    n = resumed.train_set.units.n
    batches = [-(-(min(n, c + 8) - c) // 4) for c in range(0, n, 8)]  # micro-batches of 4 per chunk of 8
    assert len(forwards) == sum(batches[1:])  # every chunk but the first
    shutil.rmtree(folder)
    forwards.clear()
    whole = attached(cfg, pg)
    assert len(forwards) == sum(batches)
    assert np.array_equal(resumed.train_set.reference, whole.train_set.reference)
