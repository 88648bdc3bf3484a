# Set-up is idempotent: each target creates .venv when missing or when pyproject.toml changed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU build of torch where no GPU is present (the wheel on this machine's disk; elsewhere add
# TORCH_INDEX=https://download.pytorch.org/whl/cpu). GPU users: make setup TORCH_SPEC=... TORCH_INDEX=...
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
# `make image`: the container of examples/k8s and examples/slurm (Dockerfile). Its torch comes from
# TORCH_INDEX when given (e.g. .../whl/cu128 for CUDA), else the CPU index; IMAGE names it.
VERSION     ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE       ?= phalanx:$(VERSION)
IMAGE_TORCH_INDEX ?= $(or $(TORCH_INDEX),https://download.pytorch.org/whl/cpu)

.PHONY: setup demo test test-all bench docs image clean

setup: $(VENV)/.stamp

# Packages go in through uv, installed into .venv first (pip where uv cannot be had): a fresh set-up took 5-8
# minutes with pip here, under a minute with uv. uv reads no pip.conf, so pip's local wheel folders are passed on.
UV_ARGS := --python $(BIN)/python $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))

$(VENV)/.stamp: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/pip install -q uv || true
	install="$(BIN)/pip install -q"; \
	if [ -x $(BIN)/uv ]; then install="$(BIN)/uv pip install -q $(UV_ARGS)"; fi; \
	{ $(BIN)/python -c "import torch" 2>/dev/null || $$install $(TORCH_INDEX_ARG) "$(TORCH_SPEC)"; } && \
	$$install -e ".[test]"
	touch $@

demo: setup          ## the main job on its built-in default (small GPT on stdlib docstrings, 2 processes)
	$(BIN)/phalanx train --nproc-per-node 2

# Two pytest workers, a test module each at a time (module fixtures are built once): a test spends much of its
# time starting processes and waiting on them, so two at a time fill the 2 cores (1.5x on this machine).
test: setup          ## the test suite CI runs (slow-marked tests excluded)
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadscope --durations=25

test-all: setup      ## every test, slow ones included
	$(BIN)/python -m pytest -q -n 2 --dist loadscope

bench: setup         ## foundation benchmark: phalanx vs a plain DDP loop
	$(BIN)/python bench/vs_plain_ddp.py

docs: setup         ## regenerate docs/config.md's config table from the schema
	$(BIN)/python -c "import re,pathlib; from phalanx.core.config import describe_markdown as d; p=pathlib.Path('docs/config.md'); s=p.read_text(); p.write_text(re.sub(r'(<!-- CONFIG-KEYS -->\n).*?(<!-- /CONFIG-KEYS -->)', lambda m: m.group(1)+chr(10).join(d())+chr(10)+m.group(2), s, flags=re.S))"

image:               ## container image phalanx:<version> (CPU torch; CUDA: make image TORCH_INDEX=.../whl/cu128)
	docker build -t $(IMAGE) --build-arg TORCH_INDEX=$(IMAGE_TORCH_INDEX) --build-arg TORCH_SPEC="$(TORCH_SPEC)" .

clean:
	rm -rf $(VENV) runs .pytest_cache
