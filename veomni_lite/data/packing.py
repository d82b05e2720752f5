"""Packed rows and token-budget micro-batches.

Packing (`data.packing`): a micro-batch's samples are concatenated into one row ([1, S]). Each sample's labels are
shifted on their own (so no target crosses into the next sample), `position_ids` restart at 0 per sample, and
`sequence_ids` numbers the samples (-1 on the padding after them). `attention_sequence_ids` is the same row kept
WHOLE under sequence parallelism (`slice_micro_batch` pads it but never cuts it): the models build their
block-diagonal causal mask from it on the device, so attention never crosses a sample, on one rank or after the
Ulysses all-to-all, and no attention path reads the positions back to the host.

Token budget (`data.max_tokens_per_micro_batch`): `plan_micro_batches` splits a rank's samples of the step into as few
micro-batches as fit the budget (first fit by decreasing length; a packed micro-batch costs the sum of its lengths, a
padded one rows x longest). The samples of the step stay those of the layout-independent global batch; ranks whose
plans differ in count run `padding_micro_batch`es (no target, so an exact 0 loss and gradient) up to the count the
control all-reduce agrees on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from veomni_lite.data.checks import DataError
from veomni_lite.data.collator import shift_labels
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, IGNORE_INDEX, SEQUENCE_IDS, is_labels_key

__all__ = ["pack", "packed_positions", "padding_micro_batch", "plan_micro_batches"]


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


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, packing: bool, where: str = "") -> list[list[int]]:
    """Indices into `lengths`, one list per micro-batch, each within `max_tokens` (see the module docstring)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if order and lengths[order[0]] > max_tokens:
        longest = order[0]
        raise DataError(
            f"{where}sample {longest} has {lengths[longest]} tokens, over data.max_tokens_per_micro_batch={max_tokens}"
        )
    bins: list[list[int]] = []
    used: list[int] = []  # packed: tokens in the bin; padded: its row count (its longest is its first sample)
    for i in order:
        for b, members in enumerate(bins):
            cost = used[b] + lengths[i] if packing else (used[b] + 1) * lengths[members[0]]
            if cost <= max_tokens:
                members.append(i)
                used[b] = used[b] + lengths[i] if packing else used[b] + 1
                break
        else:
            bins.append([i])
            used.append(lengths[i] if packing else 1)
    return [sorted(members) for members in bins]


def padding_micro_batch(micro_batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`micro_batch` with no target left (labels IGNORE_INDEX, sequence starts and weights 0) and `padding_flag`
    set: it runs the same forward and collectives and adds an exact 0 to the step's loss and gradient."""
    out = dict(micro_batch)
    for key, value in micro_batch.items():
        if is_labels_key(key):
            out[key] = torch.full_like(value, IGNORE_INDEX)
        elif key.endswith(("_seq_starts", "_loss_weights")):
            out[key] = torch.zeros_like(value)
    out["padding_flag"] = torch.ones((), dtype=torch.bool)
    return out
