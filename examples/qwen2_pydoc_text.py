"""A transformers causal LM (built from `model.hf`, or a local `model.pretrained_dir` with its own tokenizer) on the
Python help pages; without a directory, a BPE tokenizer trained on them is saved with the run. Only model, data and
collate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from examples.pydoc_text import PydocTextDataset, load_or_train_tokenizer
from veomni_lite.data.collator import collate
from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict
from veomni_lite.models.pretrained import check_vocabulary, load_config, load_tokenizer
from veomni_lite.trainer.base import BaseTrainer

TOKENIZER_FILE = "tokenizer.json"


class PydocLMTrainer(BaseTrainer):
    def build_datasets(self) -> tuple[Any, Any | None]:
        data, special = self.config.data, None
        if self.config.model.pretrained_dir:  # the model's own tokenizer, never one trained here
            directory = self.config.model.pretrained_dir
            pretrained = load_tokenizer(directory)
            check_vocabulary(pretrained, load_config(directory), directory)
            eos = pretrained.eos_token_id
            bos = pretrained.bos_token_id if pretrained.bos_token_id is not None else eos
            special = (pretrained.pad_token_id if pretrained.pad_token_id is not None else eos, bos, eos)
            self.tokenizer = pretrained.backend_tokenizer
        else:
            self.tokenizer = load_or_train_tokenizer(
                self.output_dir / TOKENIZER_FILE, self.config.example.tokenizer_vocab_size, save=self.is_main
            )
        seq_len = self.config.example.seq_len
        train = PydocTextDataset(self.tokenizer, seq_len, "train", data.eval_fraction, special)
        evaluation = PydocTextDataset(self.tokenizer, seq_len, "eval", data.eval_fraction, special)
        return train, evaluation if self.config.example.eval_samples else None

    def build_model(self) -> HFCausalLM:
        model = self.config.model
        data = self.train_dataset
        if model.pretrained_dir:
            return self.pretrained_model(model.pretrained_dir)
        settings = {
            **model.hf,
            "vocab_size": data.vocab_size,
            "bos_token_id": data.bos_id,
            "eos_token_id": data.eos_id,
            "pad_token_id": data.pad_id,
        }
        return HFCausalLM.from_config(hf_config_from_dict(settings))

    @property
    def pad_id(self) -> int:
        return self.train_dataset.pad_id

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        data = self.config.data
        return collate(samples, pad_to_multiple_of=data.pad_to_multiple_of, pad_id=self.pad_id, packing=data.packing)
