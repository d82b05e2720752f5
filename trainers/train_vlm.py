"""torchrun --standalone --nproc_per_node N trainers/train_vlm.py configs/vlm_tiny.yaml [--train.sp_size 2]"""

import sys

from veomni_lite.examples.vlm_trainer import VLMTrainer
from veomni_lite.trainer.launch import main

if __name__ == "__main__":
    sys.exit(main(VLMTrainer))
