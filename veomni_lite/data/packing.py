"""Token-budget micro-batches (packed rows themselves come from `veomni_lite.data.collator.pack`).

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
from veomni_lite.loss_keys import IGNORE_INDEX, is_labels_key

__all__ = ["padding_micro_batch", "plan_micro_batches"]


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
