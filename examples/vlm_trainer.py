"""VLM trainer: the tiny VLM (text + image-decoder loss heads) on synthetic shapes. Only model, data and collate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from examples.settings import check_example
from examples.synthetic_data import SyntheticVLMDataset
from examples.tiny_lm import TinyLMConfig
from examples.tiny_vlm import TinyVLM, TinyVLMConfig
from veomni_lite.config import Config
from veomni_lite.data.collator import collate
from veomni_lite.trainer.base import BaseTrainer


class VLMTrainer(BaseTrainer):
    def __init__(self, config: Config) -> None:
        check_example(config, tiny=True)  # before any process group
        super().__init__(config)

    def build_datasets(self) -> tuple[Any, Any | None]:
        example, seed = self.config.example, self.config.train.seed

        def make(num_samples: int, dataset_seed: int) -> SyntheticVLMDataset:
            return SyntheticVLMDataset(
                num_samples=num_samples,
                image_size=example.image_size,
                patch_size=example.patch_size,
                generation_ratio=example.generation_ratio,
                seed=dataset_seed,
            )

        train = make(example.num_samples, seed)
        return train, make(example.eval_samples, seed + 10_000) if example.eval_samples else None

    def build_model(self) -> nn.Module:
        example, dataset = self.config.example, self.train_dataset
        return TinyVLM(
            TinyVLMConfig(
                lm=TinyLMConfig(
                    vocab_size=dataset.vocab_size,
                    hidden_size=example.hidden_size,
                    num_layers=example.num_layers,
                    num_heads=example.num_heads,
                    intermediate_size=example.intermediate_size,
                    rope_theta=example.rope_theta,
                ),
                image_size=example.image_size,
                patch_size=example.patch_size,
                num_image_codes=dataset.num_image_codes,
                image_token_id=dataset.image_token_id,
            )
        )

    @property
    def label_limits(self) -> dict[str, int]:
        return {"image_decoder_labels": self.train_dataset.num_image_codes}

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate(samples, pad_to_multiple_of=self.config.data.pad_to_multiple_of)
