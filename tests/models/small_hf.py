"""Shrunk transformers runs for single-process tests (the shipped qwen2 / qwen2_vl configs at width 32, two steps), and
`assert_vl_logits_match`: a trained VL model against transformers models on its samples."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

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


def assert_vl_logits_match(trained: Any, models: Mapping[str, Any], rows: int = 3) -> None:
    """The trained VL model's logits on its first `rows` training samples (collated, padded) equal each transformers
    model's in `models` (name -> model, fed one sample at a time) to 1e-5."""
    from veomni_lite.models.qwen2_vl import collate_qwen2_vl

    samples = [trained.train_dataset[i] for i in range(rows)]
    image_token = trained.model_config.image_token_id
    batch = collate_qwen2_vl(samples, image_token, 2, trained.pad_id)
    trained.model.eval()
    with torch.no_grad():
        ours = trained.model(**{k: v for k, v in batch.items() if "labels" not in k})["logits"]
        for row, sample in enumerate(samples):
            ids = sample["input_ids"][None]
            inputs = {"input_ids": ids, "mm_token_type_ids": (ids == image_token).long()}
            inputs |= {"pixel_values": sample["pixel_values"], "image_grid_thw": sample["image_grid_thw"]}
            for name, model in models.items():
                theirs = model(**inputs).logits[0]
                assert torch.allclose(ours[row, : ids.shape[1]], theirs, rtol=1e-5, atol=1e-5), (name, row)
