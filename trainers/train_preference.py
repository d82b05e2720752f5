"""python -m veomni_lite.torchrun --standalone --nproc_per_node N trainers/train_preference.py
    CONFIG.yaml [--section.key VALUE ...]

Preference training of the local model directory `model.pretrained_dir` (any causal LM transformers ships, or a
vision-language family of veomni_lite/models/registry.py) on the pairs of `data.train_path` (`data.format:
preference`): DPO and its variants, or a Bradley-Terry reward model (`pref.loss: bradley_terry`). The `pref` section
is `veomni_lite.preference.config.PrefConfig` (see docs/preference.md and configs/dpo_demo.yaml).
"""

import sys

from veomni_lite.models.registry import FAMILIES
from veomni_lite.preference.config import PrefConfig
from veomni_lite.preference.trainer import PreferenceTrainer
from veomni_lite.trainer.launch import main

if __name__ == "__main__":
    families = {model_type: PreferenceTrainer for family in FAMILIES for model_type in family.model_types}
    sys.exit(main({"auto": PreferenceTrainer, "*": PreferenceTrainer, **families}, sections={"pref": PrefConfig}))
