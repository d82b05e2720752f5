"""python -m veomni_lite.torchrun --standalone --nproc_per_node N trainers/train_sft.py
    CONFIG.yaml [--section.key VALUE ...]

Supervised fine-tuning of the local model directory `model.pretrained_dir` (any causal LM transformers ships, or a
vision-language family of veomni_lite/models/registry.py: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) on the user's files
`data.train_path` (see veomni_lite/trainer/sft.py and configs/sft_*.yaml). Unless the YAML says otherwise it trains
with `SFT_DEFAULTS`: 3 epochs, lr 1e-5, 3% warmup, cosine decay, no weight decay.
"""

import sys

from veomni_lite.models.registry import FAMILIES
from veomni_lite.trainer.launch import main
from veomni_lite.trainer.sft import SFT_DEFAULTS, SFTTrainer

if __name__ == "__main__":
    families = {model_type: SFTTrainer for family in FAMILIES for model_type in family.model_types}
    sys.exit(main({"auto": SFTTrainer, "*": SFTTrainer, **families}, defaults=SFT_DEFAULTS))
