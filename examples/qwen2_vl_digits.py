"""Qwen2-VL (transformers, built from `model.hf`) on the handwritten digits: caption and image-code heads, and
`eval/caption_accuracy` on the held-out images. Only model, data, collate and the task metric."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from examples.digits import NUM_CODES, DigitsDataset, load_or_train_tokenizer
from veomni_lite.distributed.collectives import all_reduce
from veomni_lite.loss_keys import is_labels_key
from veomni_lite.models.qwen2_vl import QwenVLWithImageHead, collate_qwen2_vl
from veomni_lite.trainer.base import BaseTrainer

TOKENIZER_FILE = "tokenizer.json"


def caption_hits(
    logits: torch.Tensor, positions: torch.Tensor, gold: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """[correct, counted] of a shard: row b counts when `valid[b]` (its query position lies in this shard and it is a
    real sample); it is correct when the greedy token at `positions[b]` (shard-local) is `gold[b]`."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    predicted = logits[rows, positions.clamp(0, logits.shape[1] - 1)].argmax(-1)
    return torch.stack([((predicted == gold) & valid).sum(), valid.sum()])


class DigitsVLTrainer(BaseTrainer):
    def build_datasets(self) -> tuple[Any, Any | None]:
        self.tokenizer = load_or_train_tokenizer(self.output_dir / TOKENIZER_FILE, save=self.is_main)
        vision = self.config.model.hf.get("vision_config", {})
        geometry = {
            "patch": vision.get("patch_size", 2),
            "temporal_patch": vision.get("temporal_patch_size", 1),
            "merge": vision.get("spatial_merge_size", 2),
            "eval_fraction": self.config.data.eval_fraction,
        }
        train = DigitsDataset(self.tokenizer, "train", **geometry)
        evaluation = DigitsDataset(self.tokenizer, "eval", **geometry)
        return train, evaluation if self.config.example.eval_samples else None

    def build_model(self) -> QwenVLWithImageHead:
        from transformers import Qwen2VLConfig

        data = self.train_dataset
        hf = self.config.model.hf
        tokens = data.token
        text = {
            **hf.get("text_config", {}),
            "vocab_size": data.vocab_size,
            "bos_token_id": tokens["<bos>"],
            "eos_token_id": tokens["<eos>"],
            "pad_token_id": data.pad_id,
        }
        vision = {"in_channels": 1, **hf.get("vision_config", {}), "hidden_size": text.get("hidden_size", 64)}
        config = Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=data.image_token_id,
            vision_start_token_id=tokens["<|vision_start|>"],
            vision_end_token_id=tokens["<|vision_end|>"],
            image_decoder_classes=NUM_CODES,
            **{k: v for k, v in hf.items() if k not in ("text_config", "vision_config")},
        )
        return QwenVLWithImageHead.from_config(config)

    @property
    def pad_id(self) -> int:
        return self.train_dataset.pad_id

    @property
    def label_limits(self) -> dict[str, int]:
        return {"image_decoder_labels": NUM_CODES}

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        data = self.train_dataset
        settings = self.config.data
        return collate_qwen2_vl(
            samples, data.image_token_id, data.merge, data.pad_id, settings.pad_to_multiple_of, settings.packing
        )

    @torch.no_grad()
    def extra_eval_metrics(self) -> dict[str, float]:
        """`caption_accuracy`: the share of held-out images whose digit word the model predicts greedily after
        "a handwritten". Each dp rank takes every dp-th image; under SP the rank whose shard holds the query position
        counts it; one all-reduce sums (correct, counted) over all ranks."""
        data, state = self.eval_dataset, self.parallel
        if data is None:
            return {}
        mine = list(range(state.dp_rank, len(data.digits), state.dp_size))
        per_batch = self.config.train.micro_batch_size
        batches = math.ceil(math.ceil(len(data.digits) / state.dp_size) / per_batch)  # the same on every rank
        hits = torch.zeros(2, dtype=torch.long, device=self.device)
        for index in range(batches):
            chosen = mine[index * per_batch : (index + 1) * per_batch]
            real = len(chosen)
            queries: list[tuple[Any, ...]] = []

            def read(chosen: list[int] = chosen, queries: list[tuple[Any, ...]] = queries) -> list[dict[str, Any]]:
                queries += zip(*(data.caption_query(i) for i in chosen or [0]))  # samples, positions, gold
                # one row per query (never packed): the query positions index the rows
                return [self.shard(collate_qwen2_vl(queries[0], data.image_token_id, data.merge, data.pad_id))]

            (batch,) = self.agreed_micro_batches(read, f"caption accuracy at step {self.step}, batch {index + 1}: ")
            samples, positions, gold = queries
            local_len = batch["input_ids"].shape[1]
            start = state.sp_rank * local_len
            inputs = {key: value for key, value in batch.items() if not is_labels_key(key)}
            logits = self.model(**self.preforward(inputs))["logits"]
            local = torch.tensor(positions, device=self.device) - start
            valid = (local >= 0) & (local < local_len) & (torch.arange(len(samples), device=self.device) < real)
            hits += caption_hits(logits, local, torch.tensor(gold, device=self.device), valid)
        correct, counted = all_reduce(hits.cpu().tolist(), op="sum", group=state.world_group)
        return {"caption_accuracy": correct / max(counted, 1)}
