"""Hub names are checked in the launcher before any worker starts: a name that is neither cached nor
reachable is one line and exit 2 within seconds; local folders and cached names need no network."""
from __future__ import annotations

import json
import socket
import time

import pytest
from conftest import phalanx, tiny_llama

from phalanx.core.config import ConfigError, load_config
from phalanx.data import hub


def hub_reachable() -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("key,value,name", [
    ("data.train", "hf:wikitext:wikitext-2-raw-v1", "wikitext"),
    ("model.pretrained", "hf:gpt2", "gpt2"),
    ("data.tokenizer", "hf:bert-base-uncased", "bert-base-uncased"),
], ids=["dataset", "model", "tokenizer"])
def test_unreachable_hub_name_is_one_line_and_exit_2(tmp_path, key, value, name):
    # An empty Hugging Face cache; where the hub IS reachable, a closed local port stands in for it
    # (otherwise the command would download and train).
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
           "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    if hub_reachable():
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    t0 = time.monotonic()
    proc = phalanx("train", f"{key}={value}", "--run-dir", tmp_path / "run", env=env, timeout=60, fresh_process=True)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert elapsed < 90  # not the hub client's retries (minutes); a busy 2-core machine starts it in ~55 s
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert key in lines[0] and f"'{name}'" in lines[0] and "unreachable" in lines[0]
    assert "offline" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
    assert "phalanx: task" not in proc.stdout and not (tmp_path / "run" / "config.yaml").exists()


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """An empty cache under tmp_path (restored afterwards), and any hub request is a test failure."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    def probe(name, kind):
        raise AssertionError(f"the hub was asked for {kind} {name!r}")

    monkeypatch.setattr(hub, "_probe", probe)


def test_a_local_dataset_folder_passes_without_network(tmp_path, no_network):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"text": "hello"}) + "\n", encoding="utf-8")
    hub.check_hub_names(load_config(None, [f"data.train=hf:{folder}"]))
    with pytest.raises(ConfigError, match="data.validation.*local folder .* not found"):
        hub.check_hub_names(load_config(None, [f"data.train=hf:{folder}", f"data.validation=hf:{folder}-x"]))


def fake_hub_repo(cache, repo: str, files: list[str], rev: str = "0123456789abcdef0123456789abcdef01234567"):
    """A repo in huggingface_hub's cache layout: models--ORG--NAME/refs/main + snapshots/<rev>/FILES."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(rev)
    (folder / "snapshots" / rev).mkdir(parents=True)
    for name in files:
        (folder / "snapshots" / rev / name).write_text("{}")


@pytest.mark.parametrize("via", ["HF_HOME", "HF_HUB_CACHE"])
def test_a_model_in_the_local_hub_cache_passes_without_network(tmp_path, monkeypatch, no_network, via):
    cache = tmp_path / "hf" / "hub" if via == "HF_HOME" else tmp_path / "elsewhere"
    if via == "HF_HUB_CACHE":
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    fake_hub_repo(cache, "phalanx-test/tiny", ["config.json", "tokenizer.json"])
    fake_hub_repo(cache, "phalanx-test/no-tokenizer", ["config.json"])
    hub.check_hub_names(load_config(None, ["model.pretrained=hf:phalanx-test/tiny"]))
    hub.check_hub_names(load_config(None, ["data.tokenizer=hf:phalanx-test/tiny"]))
    hub.check_hub_names(load_config(None, ["model.pretrained=hf:phalanx-test/no-tokenizer",
                                           "data.tokenizer=hf:phalanx-test/tiny"]))


def test_a_partly_cached_name_still_asks_the_hub(tmp_path, monkeypatch, no_network):
    """A model whose tokenizer is not cached (model.pretrained supplies it too) is not usable offline."""
    fake_hub_repo(tmp_path / "hf" / "hub", "phalanx-test/no-tokenizer", ["config.json"])
    monkeypatch.setattr(hub, "_probe", lambda name, kind: "ConnectError: no network")
    with pytest.raises(ConfigError, match="model.pretrained.*'phalanx-test/no-tokenizer'.*unreachable.*offline"):
        hub.check_hub_names(load_config(None, ["model.pretrained=hf:phalanx-test/no-tokenizer"]))


def test_a_dataset_in_the_datasets_cache_passes_without_network(tmp_path, monkeypatch, no_network):
    # datasets' own offline layout: <namespace>___<snake_case name>/<config>/<version>/<hash>
    (tmp_path / "hf" / "datasets" / "org___my_corpus" / "small" / "0.0.0" / "abc123").mkdir(parents=True)
    hub.check_hub_names(load_config(None, ["data.train=hf:org/MyCorpus:small"]))
    hub.check_hub_names(load_config(None, ["data.train=hf:org/MyCorpus"]))
    monkeypatch.setattr(hub, "_probe", lambda name, kind: "ConnectError: no network")
    with pytest.raises(ConfigError, match="data.train.*'org/MyCorpus' \\(config 'large'\\).*unreachable"):
        hub.check_hub_names(load_config(None, ["data.train=hf:org/MyCorpus:large"]))


class FakeHub:
    """`snapshot_download` over a local "remote" repo folder, as the real one behaves: the files matching
    `allow_patterns` land in the one snapshot folder it returns; each request's patterns are recorded."""

    def __init__(self, remote, snapshot):
        self.remote, self.snapshot, self.asked = remote, snapshot, []
        snapshot.mkdir(parents=True)

    def __call__(self, name, allow_patterns=None, **kwargs):
        import fnmatch
        import shutil

        self.asked.append(sorted(allow_patterns))
        for f in self.remote.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, self.snapshot / f.name)
        return str(self.snapshot)


@pytest.fixture
def llama_repo(tmp_path):
    """A tiny Llama as hub repos ship one: sharded safetensors + index, and Mistral's extra
    consolidated.safetensors (another key layout, several GB on the real ones) beside them."""
    remote = tmp_path / "remote"
    model = tiny_llama(remote)
    (remote / "consolidated.safetensors").write_bytes(b"not for transformers")
    return remote, model


def build_from_hub(monkeypatch, fake, config_folder):
    """phalanx's pretrained build of 'hf:someone/llama' with `fake` as the hub (the architecture from a
    local copy of the configs, so that only the weights go through the fake)."""
    from functools import partial

    import huggingface_hub

    from phalanx.core.config import ModelConfig
    from phalanx.model.build import causal_lm
    from phalanx.model.shard import Builder

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return Builder(seed=1).build(partial(causal_lm, ModelConfig(pretrained=str(config_folder)), 0, 0),
                                 "hf:someone/llama")


def test_the_hub_is_asked_only_for_the_weight_files_the_index_names(tmp_path, monkeypatch, llama_repo):
    import torch

    remote, model = llama_repo
    shards = sorted(p.name for p in remote.glob("model-*.safetensors"))
    assert len(shards) >= 2
    fake = FakeHub(remote, tmp_path / "snapshot")
    got = build_from_hub(monkeypatch, fake, remote)
    assert fake.asked == [["*.json"], shards]  # before: every *.safetensors, consolidated.safetensors too
    assert not (tmp_path / "snapshot" / "consolidated.safetensors").exists()
    for name, p in got.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name


def test_without_an_index_the_hub_is_asked_for_model_safetensors_alone(tmp_path, monkeypatch, llama_repo):
    remote, model = llama_repo
    for f in [*remote.glob("model-*.safetensors"), remote / "model.safetensors.index.json"]:
        f.unlink()
    model.save_pretrained(tmp_path / "one")
    (tmp_path / "one" / "model.safetensors").rename(remote / "model.safetensors")
    fake = FakeHub(remote, tmp_path / "snapshot")
    build_from_hub(monkeypatch, fake, remote)
    assert fake.asked == [["*.json"], ["model.safetensors"]]


def test_a_bin_only_repo_is_fetched_by_its_bin_index(tmp_path, monkeypatch, llama_repo):
    """Older repos: pytorch_model-0000k-of-0000n.bin + pytorch_model.bin.index.json (likewise index-driven)."""

    import torch
    from safetensors.torch import load_file

    remote, model = llama_repo
    index = json.loads((remote / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    bins = {}
    for k, shard in enumerate(shards):
        bins[f"pytorch_model-{k + 1:05d}-of-{len(shards):05d}.bin"] = load_file(str(remote / shard))
        (remote / shard).unlink()
    (remote / "model.safetensors.index.json").unlink()
    (remote / "pytorch_model-00009-of-00009.bin").write_bytes(b"stale, not in the index")
    for name, tensors in bins.items():
        torch.save(tensors, remote / name)
    weight_map = {key: name for name, tensors in bins.items() for key in tensors}
    (remote / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    fake = FakeHub(remote, tmp_path / "snapshot")
    got = build_from_hub(monkeypatch, fake, remote)
    assert fake.asked == [["*.json"], ["model.safetensors"], sorted(bins)]
    for name, p in got.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name
