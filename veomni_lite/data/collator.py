"""Collate samples into a micro-batch: shift every label key ONCE, then right-pad.

Contract: for every key `labels` or `*_labels`, label t becomes the sample's label t + 1 (the target of the prediction
at t) and the last position gets IGNORE_INDEX; this happens here, before any sequence-parallel slicing, and never
again. Then `input_ids` are right-padded with `pad_id`, label keys with IGNORE_INDEX, to the longest sample rounded
up to `pad_to_multiple_of`. `position_ids` is arange(length) for every row (padding keeps counting); `sequence_ids`
marks each sample's positions with its row (-1 on padding), the key the per-sequence loss modes read. `pixel_values`
are stacked when the samples have them.

Packing (`pack`, `collate(..., packing=True)`; `data.packing`): the samples are concatenated into one row ([1, S]).
Each sample's labels are shifted on their own (so no target crosses into the next sample), `position_ids` restart at
0 per sample, and `sequence_ids` numbers the samples (-1 on the padding after them). `attention_sequence_ids` is the
same row kept WHOLE under sequence parallelism (`slice_micro_batch` pads it but never cuts it): the models build
their block-diagonal causal mask from it on the device, so attention never crosses a sample, on one rank or after
the Ulysses all-to-all, and no attention path reads the positions back to the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, IGNORE_INDEX, SEQUENCE_IDS, is_labels_key

__all__ = ["collate", "pack", "packed_positions", "sequence_ids", "shift_labels"]


def shift_labels(labels: Tensor) -> Tensor:
    """[S] unshifted targets -> [S] next-token targets (last = IGNORE_INDEX)."""
    return torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])


def sequence_ids(lengths: Sequence[int], length: int) -> Tensor:
    """[B, length] int64: row b on its first `lengths[b]` positions, -1 on the padding after them."""
    positions = torch.arange(length).expand(len(lengths), length)
    rows = torch.arange(len(lengths)).unsqueeze(1).expand(len(lengths), length)
    return torch.where(positions < torch.tensor(lengths).unsqueeze(1), rows, -1)


def packed_positions(lengths: Sequence[int], total: int) -> tuple[Tensor, Tensor]:
    """([total] positions restarting at 0 per sample, continuing over the padding; [total] sample ids, -1 on it)."""
    positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    used = positions.numel()
    tail = torch.arange(total - used) + (int(positions[-1]) + 1 if used else 0)
    return torch.cat([positions, tail]), torch.cat([ids, torch.full((total - used,), -1, dtype=torch.long)])


def pack(samples: Sequence[Mapping[str, Tensor]], pad_to_multiple_of: int = 1, pad_id: int = 0) -> dict[str, Tensor]:
    """Text samples (1-D `input_ids`, unshifted label keys) -> one packed row (see the module docstring)."""
    if not samples:
        raise ValueError("pack: no samples")
    if "pixel_values" in samples[0]:
        raise KeyError("pack: samples with pixel_values need their model's collate (e.g. collate_qwen2_vl)")
    lengths = [int(s["input_ids"].numel()) for s in samples]
    total = -(-sum(lengths) // pad_to_multiple_of) * pad_to_multiple_of
    fill = total - sum(lengths)
    batch = {"input_ids": torch.cat([*(s["input_ids"] for s in samples), torch.full((fill,), pad_id)])[None]}
    for key in sorted(k for k in samples[0] if is_labels_key(k)):
        shifted = [shift_labels(s[key]) for s in samples]
        batch[key] = torch.cat([*shifted, torch.full((fill,), IGNORE_INDEX)])[None]
    positions, ids = packed_positions(lengths, total)
    batch["position_ids"], batch[SEQUENCE_IDS], batch[ATTENTION_SEQUENCE_IDS] = positions[None], ids[None], ids[None]
    return batch


def _pad(rows: list[Tensor], length: int, value: int) -> Tensor:
    out = rows[0].new_full((len(rows), length), value)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def collate(
    samples: Sequence[Mapping[str, Tensor]], pad_to_multiple_of: int = 1, pad_id: int = 0, packing: bool = False
) -> dict[str, Tensor]:
    """List of sample dicts (1-D `input_ids`, label keys, optional `pixel_values`) -> padded [B, S] micro-batch, or
    with `packing` one packed row (`pack`)."""
    if packing:
        return pack(samples, pad_to_multiple_of, pad_id)
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
