"""python -m veomni_lite.torchrun --standalone --nproc_per_node N trainers/train_text.py
    configs/qwen2_text.yaml [--parallel.sp_size 2]

`model.arch` picks the model: a transformers causal LM such as `qwen2` on Python's help pages, or `tiny`
(configs/text_tiny.yaml).
"""

import sys
from pathlib import Path

# The example jobs live in the repository's top-level examples/ (the installed library does not ship them);
# torchrun puts this script's folder, trainers/, first on sys.path, so put the repository root there too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.qwen2_pydoc_text import PydocLMTrainer
from examples.text_trainer import TextTrainer
from veomni_lite.trainer.launch import main

if __name__ == "__main__":
    sys.exit(main({"tiny": TextTrainer, "*": PydocLMTrainer}))
