"""torchrun --standalone --nproc_per_node N trainers/train_text.py configs/text_tiny.yaml [--train.max_steps 7]"""

import sys

from veomni_lite.trainer.launch import main
from veomni_lite.trainer.text import TextTrainer

if __name__ == "__main__":
    sys.exit(main(TextTrainer))
