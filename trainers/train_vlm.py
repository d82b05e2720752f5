"""torchrun --standalone --nproc_per_node N trainers/train_vlm.py configs/qwen2_vl_digits.yaml [--parallel.sp_size 2]

`model.arch` picks the model: `qwen2_vl` (Qwen2-VL on the handwritten digits) or `tiny` (configs/vlm_tiny.yaml).
"""

import sys

from veomni_lite.examples.qwen2_vl_digits import DigitsVLTrainer
from veomni_lite.examples.vlm_trainer import VLMTrainer
from veomni_lite.trainer.launch import main

if __name__ == "__main__":
    sys.exit(main({"qwen2_vl": DigitsVLTrainer, "tiny": VLMTrainer}))
