"""python -m veomni_lite.torchrun --standalone --nproc_per_node N trainers/train_vlm.py
    configs/qwen2_vl_digits.yaml [--parallel.sp_size 2]

`model.arch` picks the model: `qwen2_vl` (Qwen2-VL on the handwritten digits) or `tiny` (configs/vlm_tiny.yaml).
"""

import sys
from pathlib import Path

# The example jobs live in the repository's top-level examples/ (the installed library does not ship them);
# torchrun puts this script's folder, trainers/, first on sys.path, so put the repository root there too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.qwen2_vl_digits import DigitsVLTrainer
from examples.vlm_trainer import VLMTrainer
from veomni_lite.trainer.launch import main

if __name__ == "__main__":
    sys.exit(main({"qwen2_vl": DigitsVLTrainer, "tiny": VLMTrainer}))
