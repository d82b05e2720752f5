"""torchrun --standalone --nproc_per_node N trainers/train_text.py configs/text_tiny.yaml [--train.max_steps 7]"""

import sys

from veomni_lite.examples.text_trainer import TextTrainer
from veomni_lite.trainer.launch import main

if __name__ == "__main__":
    sys.exit(main(TextTrainer))
