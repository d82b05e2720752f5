"""Fixtures of the loss-mode tests, importable by spawned processes: a float64 TinyVLM and its samples."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from examples.synthetic_data import SyntheticVLMDataset
from examples.tiny_lm import TinyLMConfig
from examples.tiny_vlm import TinyVLM, TinyVLMConfig
from veomni_lite.data.collator import collate
from veomni_lite.loss_keys import IGNORE_INDEX

NUM_SAMPLES = 8
# Two heads with different modes in every plan; each mode appears on both heads across the plans.
MODE_PLANS = [
    ("token-mean", "seq-mean-token-mean"),
    ("seq-mean-token-mean", "token-sum"),
    ("seq-mean-token-sum", "token-mean"),
    ("seq-mean-token-sum-norm", "seq-mean-token-sum"),
    ("token-sum", "seq-mean-token-sum-norm"),
]
SCALE_FACTOR = 3.0


def dataset() -> SyntheticVLMDataset:
    return SyntheticVLMDataset(num_samples=NUM_SAMPLES, image_size=16, patch_size=4, generation_ratio=0.5, seed=3)


def samples() -> list[dict[str, torch.Tensor]]:
    """Varied lengths; caption samples have no image-decoder targets; sample 0 has no targets at all."""
    out = [dataset()[i] for i in range(NUM_SAMPLES)]
    out[0] = {**out[0], "labels": torch.full_like(out[0]["labels"], IGNORE_INDEX)}
    out[0]["image_decoder_labels"] = torch.full_like(out[0]["image_decoder_labels"], IGNORE_INDEX)
    return out


def build_model() -> TinyVLM:
    torch.manual_seed(7)
    data = dataset()
    lm = TinyLMConfig(vocab_size=data.vocab_size, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
    config = TinyVLMConfig(
        lm=lm, image_size=16, patch_size=4, num_image_codes=data.num_image_codes, image_token_id=data.image_token_id
    )
    return TinyVLM(config).double()


def collate_samples(batch: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate(batch)


def hand_reference(plan: tuple[str, str]) -> tuple[list[torch.Tensor], float]:
    """One process, each sample alone, per-token losses in float64, each head's mode applied by hand."""
    model = build_model()
    per_head: dict[str, list[torch.Tensor]] = {"foundation": [], "image_decoder": []}
    for sample in samples():
        batch = collate([sample])
        out = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], pixel_values=batch["pixel_values"]
        )
        for name, logits, labels in (
            ("foundation", out["logits"], batch["labels"]),
            ("image_decoder", out["image_logits"], batch["image_decoder_labels"]),
        ):
            valid = labels[0] != IGNORE_INDEX
            if valid.any():
                per_head[name].append(F.cross_entropy(logits[0][valid], labels[0][valid], reduction="none"))
    total = torch.zeros((), dtype=torch.float64)
    for seqs, mode in zip(per_head.values(), plan):
        tokens = sum(s.numel() for s in seqs)
        if mode == "token-mean":
            total = total + sum(s.sum() for s in seqs) / tokens
        elif mode == "seq-mean-token-mean":
            total = total + sum(s.mean() for s in seqs) / len(seqs)
        elif mode == "seq-mean-token-sum":
            total = total + sum(s.sum() for s in seqs) / len(seqs)
        elif mode == "seq-mean-token-sum-norm":
            total = total + sum(s.sum() for s in seqs) / (len(seqs) * SCALE_FACTOR)
        else:
            total = total + sum(s.sum() for s in seqs)
    total.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()], float(
        total.detach()
    )
