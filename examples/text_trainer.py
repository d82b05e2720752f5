"""Text trainer: the tiny causal LM on the synthetic text language. Only model, data and collate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from examples.synthetic_data import SyntheticTextDataset
from examples.tiny_lm import TinyCausalLM, TinyLMConfig
from veomni_lite.data.collator import collate
from veomni_lite.trainer.base import BaseTrainer


class TextTrainer(BaseTrainer):
    def build_datasets(self) -> tuple[Any, Any | None]:
        data, seed = self.config.data, self.config.train.seed
        train = SyntheticTextDataset(num_samples=data.num_samples, seed=seed)
        evaluation = SyntheticTextDataset(num_samples=max(data.eval_samples, 1), seed=seed + 10_000)
        return train, evaluation if data.eval_samples else None

    def build_model(self) -> nn.Module:
        model = self.config.model
        return TinyCausalLM(
            TinyLMConfig(
                vocab_size=self.train_dataset.vocab_size,
                hidden_size=model.hidden_size,
                num_layers=model.num_layers,
                num_heads=model.num_heads,
                intermediate_size=model.intermediate_size,
                rope_theta=model.rope_theta,
            )
        )

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate(samples, pad_to_multiple_of=self.config.data.pad_to_multiple_of)
