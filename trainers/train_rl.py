"""python -m veomni_lite.torchrun --standalone --nproc_per_node N trainers/train_rl.py
    CONFIG.yaml [--section.key VALUE ...]

Online RL (GRPO family) of the local model directory `model.pretrained_dir` (any causal LM transformers ships, or a
vision-language family of veomni_lite/models/registry.py) on the prompts of `data.train_path`, or on the rollouts of
`rl.rollouts_path`: the `rl` section is `veomni_lite.rl.config.RLConfig` (see docs/rl.md and configs/rl_*.yaml).
"""

import sys

from veomni_lite.models.registry import FAMILIES
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.trainer import RLTrainer
from veomni_lite.trainer.launch import main

if __name__ == "__main__":
    families = {model_type: RLTrainer for family in FAMILIES for model_type in family.model_types}
    sys.exit(main({"auto": RLTrainer, "*": RLTrainer, **families}, sections={"rl": RLConfig}))
