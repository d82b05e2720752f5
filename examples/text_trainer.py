"""Text trainer: the tiny causal LM on the synthetic text language. Only model, data and collate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from examples.settings import check_example
from examples.synthetic_data import SyntheticTextDataset
from examples.tiny_lm import TinyCausalLM, TinyLMConfig
from veomni_lite.config import Config
from veomni_lite.data.collator import collate
from veomni_lite.trainer.base import BaseTrainer


class TextTrainer(BaseTrainer):
    def __init__(self, config: Config) -> None:
        check_example(config, tiny=True)  # before any process group
        super().__init__(config)

    def build_datasets(self) -> tuple[Any, Any | None]:
        example, seed = self.config.example, self.config.train.seed
        train = SyntheticTextDataset(num_samples=example.num_samples, seed=seed)
        evaluation = SyntheticTextDataset(num_samples=max(example.eval_samples, 1), seed=seed + 10_000)
        return train, evaluation if example.eval_samples else None

    def build_model(self) -> nn.Module:
        example = self.config.example
        return TinyCausalLM(
            TinyLMConfig(
                vocab_size=self.train_dataset.vocab_size,
                hidden_size=example.hidden_size,
                num_layers=example.num_layers,
                num_heads=example.num_heads,
                intermediate_size=example.intermediate_size,
                rope_theta=example.rope_theta,
            )
        )

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate(samples, pad_to_multiple_of=self.config.data.pad_to_multiple_of)
