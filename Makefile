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

.PHONY: install test test-quick test-gpu quality train train-text train-sft train-dpo bench clean

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

# Preference training (docs/preference.md): the arithmetic problems of examples/rl_math, an SFT warm start
# (configs/rl_math_sft.yaml, exported once to outputs/rl_math_sft_hf), DPO on the worked solution against the same
# solution off by one (configs/dpo_math.yaml), a Bradley-Terry reward model on the same pairs (configs/rm_math.yaml),
# then the held-out greedy accuracy of the warm start and of the DPO policy, and outputs/preference_accuracy.png.
DPO_CONFIG ?= configs/dpo_math.yaml
RM_CONFIG ?= configs/rm_math.yaml
train-dpo: install
	$(PY) -m examples.rl_math outputs/rl_math
	test -f outputs/rl_math_sft_hf/model.safetensors || ( \
	  $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) trainers/train_sft.py configs/rl_math_sft.yaml && \
	  $(PY) -m veomni_lite.export outputs/rl_math_sft outputs/rl_math_sft_hf )
	$(PY) -m examples.dpo_math pairs outputs/rl_math
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) trainers/train_preference.py $(DPO_CONFIG) $(ARGS)
	$(PY) -m veomni_lite.export outputs/dpo_math_run outputs/dpo_math_hf
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) trainers/train_preference.py $(RM_CONFIG) $(ARGS)
	$(PY) -m examples.dpo_math accuracy outputs/rl_math outputs/rl_math_sft_hf outputs/dpo_math_hf
	$(PY) -m examples.dpo_math figure outputs/preference_accuracy.png outputs/dpo_math_run outputs/rm_math_run

bench: install
	$(PY) benchmarks/run_all.py $(if $(QUICK),--quick,)

clean:
	rm -rf $(VENV) outputs .pytest_cache .ruff_cache *.egg-info
