"""Collate samples into a micro-batch: shift every label key ONCE, then right-pad.

Contract: for every key `labels` or `*_labels`, label t becomes the sample's label t + 1 (the target of the prediction
at t) and the last position gets IGNORE_INDEX; this happens here, before any sequence-parallel slicing, and never
again. Then `input_ids` are right-padded with `pad_id`, label keys with IGNORE_INDEX, to the longest sample rounded
up to `pad_to_multiple_of`. `position_ids` is arange(length) for every row (padding keeps counting); `sequence_ids`
marks each sample's positions with its row (-1 on padding), the key the per-sequence loss modes read. `pixel_values`
are stacked when the samples have them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS, is_labels_key

__all__ = ["collate", "sequence_ids", "shift_labels"]


def shift_labels(labels: Tensor) -> Tensor:
    """[S] unshifted targets -> [S] next-token targets (last = IGNORE_INDEX)."""
    return torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])


def sequence_ids(lengths: Sequence[int], length: int) -> Tensor:
    """[B, length] int64: row b on its first `lengths[b]` positions, -1 on the padding after them."""
    positions = torch.arange(length).expand(len(lengths), length)
    rows = torch.arange(len(lengths)).unsqueeze(1).expand(len(lengths), length)
    return torch.where(positions < torch.tensor(lengths).unsqueeze(1), rows, -1)


def _pad(rows: list[Tensor], length: int, value: int) -> Tensor:
    out = rows[0].new_full((len(rows), length), value)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def collate(samples: Sequence[Mapping[str, Tensor]], pad_to_multiple_of: int = 1, pad_id: int = 0) -> dict[str, Tensor]:
    """List of sample dicts (1-D `input_ids`, label keys, optional `pixel_values`) -> padded [B, S] micro-batch."""
    if not samples:
        raise ValueError("collate: no samples")
    if pad_to_multiple_of < 1:
        raise ValueError(f"collate: pad_to_multiple_of ({pad_to_multiple_of}) must be >= 1")
    keys = set(samples[0])
    for i, sample in enumerate(samples):
        if set(sample) != keys:
            raise KeyError(f"collate: sample {i} has keys {sorted(sample)}, sample 0 has {sorted(keys)}")
    unknown = sorted(k for k in keys if k not in ("input_ids", "pixel_values") and not is_labels_key(k))
    if "input_ids" not in keys or unknown:
        raise KeyError(f"collate: expected input_ids, label keys and optional pixel_values; got {sorted(keys)}")

    longest = max(sample["input_ids"].numel() for sample in samples)
    length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    batch: dict[str, Tensor] = {"input_ids": _pad([s["input_ids"] for s in samples], length, pad_id)}
    for key in sorted(k for k in keys if is_labels_key(k)):
        batch[key] = _pad([shift_labels(s[key]) for s in samples], length, IGNORE_INDEX)
    batch["position_ids"] = torch.arange(length).expand(len(samples), length).clone()
    batch[SEQUENCE_IDS] = sequence_ids([s["input_ids"].numel() for s in samples], length)
    if "pixel_values" in keys:
        batch["pixel_values"] = torch.stack([s["pixel_values"] for s in samples])
    return batch
