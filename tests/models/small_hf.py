"""Shrunk transformers runs for single-process tests: the shipped qwen2 / qwen2_vl configs at width 32, two steps."""

from __future__ import annotations

from pathlib import Path

from examples.qwen2_pydoc_text import PydocLMTrainer
from examples.qwen2_vl_digits import DigitsVLTrainer
from veomni_lite.config import Config, load_config
from veomni_lite.trainer.base import BaseTrainer

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"text": REPO / "configs" / "qwen2_text.yaml", "vl": REPO / "configs" / "qwen2_vl_digits.yaml"}
TRAINERS: dict[str, type[BaseTrainer]] = {"text": PydocLMTrainer, "vl": DigitsVLTrainer}

RUN = [
    "--train.max_steps", "2",
    "--train.micro_batch_size", "2",
    "--train.global_batch_size", "4",
    "--train.eval_interval", "0",
    "--optim.warmup_steps", "1",
    "--checkpoint.save_interval", "0",
    "--logging.log_interval", "1",
    "--logging.progress_bar", "false",
    "--logging.tensorboard", "false",
    "--logging.plot", "false",
]  # fmt: skip
SMALL = {
    "text": [
        "--data.seq_len", "32",
        "--data.tokenizer_vocab_size", "300",
        "--model.hf.hidden_size", "32",
        "--model.hf.intermediate_size", "64",
    ],
    "vl": [
        "--model.hf.text_config.hidden_size", "32",
        "--model.hf.text_config.intermediate_size", "64",
        "--model.hf.text_config.rope_parameters.mrope_section", "[2, 1, 1]",  # sums to head_dim / 2 = 4
    ],
}  # fmt: skip


def small_config(kind: str, output_dir: str | Path, *overrides: str) -> Config:
    """The shipped config of `kind` ("text" or "vl") shrunk to width 32 and a two-step run into `output_dir`."""
    args = [*RUN, *SMALL[kind], "--train.output_dir", str(output_dir), *overrides]
    return load_config(CONFIGS[kind], args, world_size=1)


def train_small(kind: str, output_dir: str | Path, *overrides: str) -> BaseTrainer:
    """Train in this process (single rank) and return the trainer (its model stays usable; metrics are closed)."""
    trainer = TRAINERS[kind](small_config(kind, output_dir, *overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer
