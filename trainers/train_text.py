"""torchrun --standalone --nproc_per_node N trainers/train_text.py configs/qwen2_text.yaml [--parallel.sp_size 2]

`model.arch` picks the model: a transformers causal LM such as `qwen2` on Python's help pages, or `tiny`
(configs/text_tiny.yaml).
"""

import sys

from veomni_lite.examples.qwen2_pydoc_text import PydocLMTrainer
from veomni_lite.examples.text_trainer import TextTrainer
from veomni_lite.trainer.launch import main

if __name__ == "__main__":
    sys.exit(main({"tiny": TextTrainer, "*": PydocLMTrainer}))
