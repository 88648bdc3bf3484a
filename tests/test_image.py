"""The container image: Dockerfile, `make image` and the Kubernetes/Slurm examples agree.

No Docker daemon is needed: the Makefile's command is read with `make -n image`, the Dockerfile is parsed
into its instructions, and the examples' phalanx command is checked against the README's flag table and
the config schema.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import yaml
from conftest import REPO

K8S = REPO / "examples" / "k8s" / "pytorchjob.yaml"
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"


def make_image(*overrides: str) -> dict:
    """`make -n image` (nothing runs) parsed: the tag, the build args and the context."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_SPEC", "TORCH_INDEX", "IMAGE", "IMAGE_TORCH_INDEX", "VERSION", "MAKEFLAGS")}
    out = subprocess.run(["make", "-s", "-n", "image", *overrides], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout
    lines = [shlex.split(line) for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0][:2] == ["docker", "build"], out
    argv, parsed = lines[0][2:], {"build_args": {}}
    while argv:
        arg = argv.pop(0)
        if arg == "-t":
            parsed["tag"] = argv.pop(0)
        elif arg == "--build-arg":
            key, _, value = argv.pop(0).partition("=")
            parsed["build_args"][key] = value
        else:
            parsed.setdefault("rest", []).append(arg)
    return parsed


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip() if " " in line.strip() else "")
            for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith("#")]


def arg_defaults() -> dict[str, str]:
    args = {}
    for op, rest in dockerfile():
        if op == "ARG":
            key, _, value = rest.partition("=")
            args[key] = value.strip('"')
    return args


def pod() -> dict:
    job = yaml.safe_load(K8S.read_text())
    specs = job["spec"]["pytorchReplicaSpecs"]
    (container,) = specs["Master"]["template"]["spec"]["containers"]
    assert specs["Worker"]["template"] == specs["Master"]["template"]  # one pod template (YAML anchor)
    return {"container": container, "pods": sum(s["replicas"] for s in specs.values())}


def documented_train_flags() -> set[str]:
    """The flags of the README's `phalanx train` table."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("### `phalanx train", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {flag for row in rows for flag in re.findall(r"`(--[a-z-]+)", row)}


def phalanx_command(words: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """`phalanx train CONFIG key=value ... --flag value ...` -> (config, overrides, flags)."""
    assert words[:2] == ["phalanx", "train"], words
    config, overrides, flags, rest = words[2], [], {}, words[3:]
    while rest:
        word = rest.pop(0)
        if word.startswith("--"):
            flags[word] = rest.pop(0)
        else:
            overrides.append(word)
    return config, overrides, flags


# ---- make image ---------------------------------------------------------------------------------
def test_make_image_tags_the_project_version_with_cpu_torch_by_default():
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    build = make_image()
    assert build["tag"] == f"phalanx:{version}"
    assert build["rest"] == ["."]  # the repository is the build context
    assert build["build_args"]["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    makefile = (REPO / "Makefile").read_text()
    setup_spec = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)", makefile, re.M).group(1)
    assert build["build_args"]["TORCH_SPEC"] == setup_spec  # the image's torch is the set-up's torch
    assert re.search(r"^\.PHONY:.*\bimage\b", makefile, re.M)
    assert re.search(r"^image:.*##\s*\S", makefile, re.M)  # described like the other targets


def test_make_image_passes_overrides_through():
    cuda = "https://download.pytorch.org/whl/cu128"
    build = make_image(f"TORCH_INDEX={cuda}", "TORCH_SPEC=torch==2.13.0", "IMAGE=registry.example/phalanx:dev")
    assert build["tag"] == "registry.example/phalanx:dev"
    assert build["build_args"] == {"TORCH_INDEX": cuda, "TORCH_SPEC": "torch==2.13.0"}


# ---- Dockerfile ---------------------------------------------------------------------------------
def test_dockerfile_installs_pinned_torch_from_the_build_arg_then_phalanx():
    steps = dockerfile()
    args = arg_defaults()
    base = next(rest for op, rest in steps if op == "FROM")
    assert re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base) == "python:3.11-slim"
    # Every build arg `make image` passes is declared, with defaults equal to what make passes.
    assert make_image()["build_args"] == {k: args[k] for k in ("TORCH_INDEX", "TORCH_SPEC")}

    runs = [rest for op, rest in steps if op == "RUN"]
    pip_words = [shlex.split(cmd) for cmd in runs]
    torch_installs = [i for i, words in enumerate(pip_words) if "${TORCH_SPEC}" in words]
    assert len(torch_installs) == 1, runs
    words = pip_words[torch_installs[0]]
    assert words[:2] == ["pip", "install"] and words[words.index("--index-url") + 1] == "${TORCH_INDEX}"
    for cmd in runs:  # no unpinned torch anywhere (it would be PyPI's CUDA build, of whatever version)
        assert not re.search(r"(^|\s)[\"']?torch([\"']|\s|$)", cmd), cmd
    phalanx_install = next(i for i, cmd in enumerate(runs) if re.match(r"pip install \"?\.", cmd))
    assert torch_installs[0] < phalanx_install  # torch present first: `pip install .` keeps that build
    copy = next(i for i, (op, rest) in enumerate(steps) if op == "COPY" and rest.split() == [".", "."])
    assert steps.index(("RUN", runs[phalanx_install])) > copy


def test_dockerfile_installs_the_compilers_train_compile_needs():
    """train.compile builds code at run time (C++ on CPU, Triton's C launcher on CUDA); the slim base has no
    compiler, so without this step compile would crash at the first step in the project's own image."""
    installs = [shlex.split(cmd) for op, cmd in dockerfile() if op == "RUN" and "apt-get" in cmd]
    words = {w for cmd in installs for w in cmd}
    assert {"gcc", "g++"} <= words, installs


def test_dockerfile_runs_phalanx_in_the_examples_working_directory():
    steps = dict(dockerfile())  # last one of each instruction wins, as in Docker
    assert json.loads(steps["ENTRYPOINT"]) == ["phalanx"]  # exec form
    assert steps["WORKDIR"] == pod()["container"]["workingDir"] == "/workspace"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignored)


# ---- the examples -------------------------------------------------------------------------------
def test_k8s_example_uses_the_image_make_builds():
    assert pod()["container"]["image"] == make_image()["tag"]


def test_k8s_example_runs_phalanx_train_with_documented_flags():
    from phalanx.core.config import load_config

    spec = pod()
    container = spec["container"]
    assert container["command"] == ["bash", "-c"]  # replaces the image's ENTRYPOINT
    (script,) = container["args"]
    words = shlex.split(script)
    assert words[0] == "exec"
    config, overrides, flags = phalanx_command(words[1:])
    assert set(flags) <= documented_train_flags(), set(flags) - documented_train_flags()
    assert {"--run-dir", "--nnodes", "--nproc-per-node", "--rdzv-endpoint", "--rdzv-id"} <= set(flags)
    assert flags["--rdzv-endpoint"] == "$MASTER_ADDR:$MASTER_PORT"
    assert int(flags["--nnodes"]) == spec["pods"]  # "Keep --nnodes equal to the pod count"
    assert int(flags["--nproc-per-node"]) == int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert (REPO / config).is_file()  # relative to /workspace, where the image has the repository
    cfg = load_config(str(REPO / config), overrides, check_paths=False)  # every key=value is a real key
    world = int(flags["--nnodes"]) * int(flags["--nproc-per-node"])
    assert cfg.train.global_batch_size % (cfg.train.micro_batch_size * world) == 0


def test_slurm_example_flags_are_documented_and_it_names_the_image():
    text = SBATCH.read_text()
    command = re.search(r"^srun .*?(phalanx train .*?)(?:\n(?!\s)|\Z)", text, re.M | re.S).group(1)
    _, _, flags = phalanx_command(shlex.split(command.replace("\\\n", " ")))
    assert set(flags) <= documented_train_flags(), set(flags) - documented_train_flags()
    assert make_image()["tag"] in text  # the container note names the image `make image` builds
