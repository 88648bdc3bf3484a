"""Hugging Face hub names in a config, checked before any worker starts.

`data.train` / `data.validation` = 'hf:NAME[:CONFIG]' (a dataset), `data.tokenizer` = 'hf:NAME' (a tokenizer),
`model.pretrained` = 'hf:NAME' (a model, and its tokenizer unless `data.tokenizer` names one), or
'hf:OWNER/REPO/FILE.gguf' (one GGUF file of a model repo, fetched alone by `gguf_file`). A name is
usable when it is in the local Hugging Face cache or the hub answers one quick request for it; otherwise
`check_hub_names` raises a one-line ConfigError (exit 2) saying how to work offline, instead of the loaders'
retries with back-off and a worker traceback. 'hf:/a/local/folder' (a dataset or model folder on disk) needs
no network. torch-free; huggingface_hub and datasets are imported only when a hub name is checked.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from phalanx.core.config import Config
from phalanx.core.errors import ConfigError

PROBE_TIMEOUT_S = 5.0
# Files that make a cached repo usable offline: a model needs its config; a tokenizer one of these.
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hub_specs(cfg: Config, data: bool = True) -> list[tuple[str, str, str, str]]:
    """(config key, name, dataset config, kind) for every 'hf:' value; kind = dataset, tokenizer or model.
    data=False leaves out the datasets (already prepared into phalanx's own store)."""
    d, out = cfg.data, []
    for key, spec in (("data.train", d.train), ("data.validation", d.validation)) if data else ():
        if spec.startswith("hf:"):
            name, _, subset = spec[3:].partition(":")  # as readers.hub_rows reads it
            out.append((key, name, subset, "dataset"))
    if d.tokenizer.startswith("hf:"):
        out.append(("data.tokenizer", d.tokenizer[3:], "", "tokenizer"))
    if cfg.model.pretrained.startswith("hf:") and not is_gguf_name(cfg.model.pretrained):  # a file: gguf_file
        out.append(("model.pretrained", cfg.model.pretrained[3:], "", "model"))
    return out


def check_hub_names(cfg: Config, data: bool = True) -> None:
    """Every hub name of `cfg` is a local folder, in the local cache, or reachable on the hub; else a
    one-line ConfigError naming the key (the first one that is not usable). Offline, at most one
    request is waited for, so this returns within a few seconds."""
    for key, name, subset, kind in hub_specs(cfg, data):
        if _is_local(key, name):
            continue
        _check_valid(key, name)
        if _dataset_cached(name, subset) if kind == "dataset" else _repo_cached(name, _needs(kind, cfg)):
            continue
        status = _probe(name, kind)
        if status == "ok":
            continue
        what = f"hub {kind} '{name}'" + (f" (config '{subset}')" if subset else "")
        if status == "missing":
            raise ConfigError(f"config key '{key}': {what} not found on the Hugging Face hub (a private or "
                              f"misspelled name?) and not in the local cache")
        raise ConfigError(f"config key '{key}': {what} is not in the local Hugging Face cache "
                          f"({_cache_of(kind)}) and the hub is unreachable ({status}); "
                          f"{offline_how(name, subset, kind)}")


def is_gguf_name(spec: str) -> bool:
    """'hf:OWNER/REPO/FILE.gguf': one GGUF file of a hub model repo (model.pretrained)."""
    return spec.startswith("hf:") and spec.lower().endswith(".gguf")


def gguf_file(spec: str, key: str = "model.pretrained") -> Path:
    """The local path of 'hf:OWNER/REPO/FILE.gguf' ('hf:/a/local/file.gguf' is that file): from the local
    Hugging Face cache, else downloaded alone after one quick probe (offline: one line, not retries)."""
    name = spec[3:]
    if _is_local(key, name):
        return Path(name).expanduser()
    parts = name.split("/")
    repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    if not filename:
        raise ConfigError(f"config key '{key}': expected 'hf:OWNER/REPO/FILE.gguf' (a GGUF file of a hub model "
                          f"repo), got '{spec}'")
    _check_valid(key, repo)
    from huggingface_hub import hf_hub_download, try_to_load_from_cache  # lazy: only a hub name needs it
    from huggingface_hub.errors import EntryNotFoundError

    cached = try_to_load_from_cache(repo, filename, cache_dir=hub_cache(), repo_type="model")
    if isinstance(cached, str):
        return Path(cached)
    status, what = _probe(repo, "model"), f"hub file '{filename}' of model '{repo}'"
    if status == "missing":
        raise ConfigError(f"config key '{key}': hub model '{repo}' not found on the Hugging Face hub (a private or "
                          f"misspelled name?) and not in the local cache")
    if status != "ok":
        raise ConfigError(f"config key '{key}': {what} is not in the local Hugging Face cache ({hub_cache()}) and "
                          f"the hub is unreachable ({status}); {offline_how(f'{repo} {filename}', '', 'model')}")
    try:
        return Path(hf_hub_download(repo, filename, cache_dir=hub_cache()))
    except EntryNotFoundError:
        raise ConfigError(f"config key '{key}': {what} not found on the Hugging Face hub") from None


def offline_how(name: str, subset: str, kind: str) -> str:
    """How to work offline. phalanx streams hub datasets, and streaming fills no cache: a dataset is
    downloaded once with `datasets` itself, a model or tokenizer with `hf download`."""
    args = ", ".join(repr(a) for a in (name, subset) if a)
    fill = f'python -c "import datasets; datasets.load_dataset({args})"' if kind == "dataset" else f"hf download {name}"
    return (f"to work offline, use a local file or folder instead, or fill the cache once where the hub is "
            f"reachable ({fill}) and then set HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1")


def _needs(kind: str, cfg: Config) -> list[tuple[str, ...]]:
    """Files a cached repo must have, one of each group: model.pretrained also supplies the tokenizer
    unless data.tokenizer names one."""
    if kind == "tokenizer":
        return [TOKENIZER_FILES]
    return [MODEL_FILES] if cfg.data.tokenizer else [MODEL_FILES, TOKENIZER_FILES]


def _is_local(key: str, name: str) -> bool:
    """'hf:/path' or 'hf:./path': a folder on disk (datasets and from_pretrained take folders too)."""
    if Path(name).expanduser().exists():
        return True
    if name.startswith(("/", ".", "~")):  # a path, never a hub name
        raise ConfigError(f"config key '{key}': local folder '{name}' not found")
    return False


def _check_valid(key: str, name: str) -> None:
    from huggingface_hub.utils import (
        validate_repo_id,  # lazy: only when a hub name is checked
    )

    try:
        validate_repo_id(name)
    except ValueError as e:
        raise ConfigError(f"config key '{key}': '{name}' is not a valid hub name ({_one_line(e)})") from None


# ---- the local cache -------------------------------------------------------------------------------
# The caches' folders are read from the environment at each call, as huggingface_hub and datasets
# compute them at their import: a variable set after they were imported (tests, notebooks) still counts.
def _hf_home() -> Path:
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser()


def hub_cache() -> Path:
    """The hub's download cache (models, tokenizers): HF_HUB_CACHE, or HF_HOME/hub."""
    path = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(os.path.expandvars(path)).expanduser() if path else _hf_home() / "hub"


def datasets_cache() -> Path:
    """The `datasets` cache of prepared datasets: HF_DATASETS_CACHE, or HF_HOME/datasets."""
    path = os.environ.get("HF_DATASETS_CACHE")
    return Path(os.path.expandvars(path)).expanduser() if path else _hf_home() / "datasets"


def _cache_of(kind: str) -> Path:
    return datasets_cache() if kind == "dataset" else hub_cache()


def _repo_cached(name: str, needs: list[tuple[str, ...]]) -> bool:
    """A model/tokenizer repo is cached at 'main' with one file of every group in `needs`."""
    from huggingface_hub import (
        try_to_load_from_cache,  # lazy: only when a hub name is checked
    )

    def has(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(name, filename, cache_dir=hub_cache(), repo_type="model"), str)

    return all(any(has(f) for f in group) for group in needs)


def _dataset_cached(name: str, subset: str) -> bool:
    """A dataset prepared into the `datasets` cache, where its offline loading looks for it: the folder
    <namespace>___<snake_case name>/<config>/<version>/<hash> (datasets.load.CachedDatasetModuleFactory).
    The hub cache alone does not count: streaming leaves the dataset card there, but no data."""
    from datasets.naming import (
        camelcase_to_snakecase,  # lazy: ~0.6 s, only for hub datasets
    )

    parts = name.split("/")
    root = datasets_cache() / "___".join([*parts[:-1], camelcase_to_snakecase(parts[-1])])
    return any(p.is_dir() for p in root.glob(f"{subset or '*'}/*/*"))


# ---- the hub -------------------------------------------------------------------------------------
def _probe(name: str, kind: str) -> str:
    """One request for the repo's info with a short timeout and no retries: 'ok' (reachable; HTTP
    errors other than not-found are left to the loader), 'missing', or why the hub is unreachable.
    Run in a thread joined with a deadline, since a hanging DNS lookup ignores the request timeout."""
    from huggingface_hub import HfApi  # lazy: only when a hub name is checked
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
    )

    api, result = HfApi(), ["timed out"]

    def ask() -> None:
        info = api.dataset_info if kind == "dataset" else api.model_info
        try:
            info(name, timeout=PROBE_TIMEOUT_S)  # a plain get_session() call: no back-off
            result[0] = "ok"
        except GatedRepoError:
            result[0] = "ok"  # exists; access is the loader's to report
        except RepositoryNotFoundError:
            result[0] = "missing"
        except HfHubHTTPError:
            result[0] = "ok"
        except Exception as e:  # network errors, OfflineModeIsEnabled (HF_HUB_OFFLINE=1)
            result[0] = f"{type(e).__name__}: {_one_line(e)}"

    thread = threading.Thread(target=ask, name="phalanx-hub-probe", daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 1)
    return result[0]


def _one_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
