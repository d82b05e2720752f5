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

Shared prefixes (`pack(..., share_prefixes=True)`; `data.shared_prefix`): consecutive samples whose first tokens are
the same and train nothing (a group's responses to one prompt, a preference pair's two sides) keep those tokens ONCE.
The row holds the lone samples, then per group the shared prefix and each sample's own rest (a branch), which starts
at its last untrained token, so the prediction of its first target is its own; the samples keep their ids, so their
order in the row is not their number's. `attention_sequence_ids` marks the prefix with an id <= -2 (unique in the
row; -1 stays the padding) and each branch with its sample's id: a branch attends to the prefix run before it and
causally to itself (`veomni_lite.models.hf_attention.packed_segments`). Positions continue from the prefix into each
branch, and `sequence_ids` is -2 on the prefix (no sample's own: like the padding's -1, nothing sums over it, but its
tokens are run). So every branch position computes exactly what the sample's own position computes unshared (the
same tokens attended at the same positions), with one forward over the prefix instead of one per sample, whose
gradient is the sum of the samples'.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, IGNORE_INDEX, SEQUENCE_IDS, is_labels_key

__all__ = ["collate", "pack", "packed_positions", "sequence_ids", "shared_prefixes", "shift_labels"]


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


def _untrained(sample: Mapping[str, Tensor], labels: Sequence[str]) -> int:
    """How many of `sample`'s first tokens may be shared: those before the position that predicts its first target."""
    first = len(sample["input_ids"])
    for key in labels:
        trained = torch.nonzero(sample[key] != IGNORE_INDEX)
        if len(trained):
            first = min(first, int(trained[0]))
    return max(first - 1, 0)


def _common(a: Tensor, b: Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def shared_prefixes(samples: Sequence[Mapping[str, Tensor]]) -> list[tuple[int, int]]:
    """Consecutive samples sharing untrained first tokens, as (number of samples, prefix length) in order; prefix
    length 0 (a lone sample) shares nothing. A sample joins the group before it when it shares the group's whole
    prefix (a lone sample's: any untrained first token), so a later sample that shares less (another prompt with the
    same system turn) starts a group of its own instead of shortening this one's."""
    labels = sorted(k for k in samples[0] if is_labels_key(k))
    groups: list[list[int]] = []  # [first sample, members, prefix length]
    for index, sample in enumerate(samples):
        if groups:
            first, members, prefix = groups[-1]
            head = samples[first]
            shared = min(_common(head["input_ids"], sample["input_ids"]), _untrained(sample, labels))
            if members == 1 and shared > 0:
                groups[-1] = [first, 2, min(shared, _untrained(head, labels))]
                continue
            if members > 1 and shared >= prefix:
                groups[-1][1] += 1
                continue
        groups.append([index, 1, 0])
    return [(members, prefix) for _, members, prefix in groups]


def pack(
    samples: Sequence[Mapping[str, Tensor]], pad_to_multiple_of: int = 1, pad_id: int = 0, share_prefixes: bool = False
) -> dict[str, Tensor]:
    """Text samples (1-D `input_ids`, unshifted label keys) -> one packed row (see the module docstring), their shared
    prefixes kept once with `share_prefixes`."""
    if not samples:
        raise ValueError("pack: no samples")
    if "pixel_values" in samples[0]:
        raise KeyError("pack: samples with pixel_values need their model's collate (e.g. collate_qwen2_vl)")
    keys = sorted(k for k in samples[0] if is_labels_key(k))
    groups = shared_prefixes(samples) if share_prefixes else [(1, 0)] * len(samples)
    starts = [0, *itertools.accumulate(n for n, _ in groups)][:-1]
    # lone samples first: a sample run after a prefix's branches would read as one more branch
    order = sorted(range(len(groups)), key=lambda g: groups[g][1] > 0)
    names = ("input_ids", "position_ids", SEQUENCE_IDS, "attention", *keys)
    parts: dict[str, list[Tensor]] = {key: [] for key in names}
    for group in order:
        (members, prefix), index = groups[group], starts[group]
        if prefix:
            head = samples[index]
            parts["input_ids"].append(head["input_ids"][:prefix])
            parts["position_ids"].append(torch.arange(prefix))
            parts[SEQUENCE_IDS].append(torch.full((prefix,), -2))
            parts["attention"].append(torch.full((prefix,), -2 - group))
            for key in keys:
                parts[key].append(torch.full((prefix,), IGNORE_INDEX))
        for sample in samples[index : index + members]:
            n = int(sample["input_ids"].numel())
            parts["input_ids"].append(sample["input_ids"][prefix:])
            parts["position_ids"].append(torch.arange(prefix, n))
            parts[SEQUENCE_IDS].append(torch.full((n - prefix,), index))
            parts["attention"].append(torch.full((n - prefix,), index))
            for key in keys:
                parts[key].append(shift_labels(sample[key])[prefix:])
            index += 1
    used = sum(t.numel() for t in parts["input_ids"])
    fill = -(-used // pad_to_multiple_of) * pad_to_multiple_of - used
    last = int(parts["position_ids"][-1][-1]) + 1 if used else 0
    tails = {"input_ids": pad_id, SEQUENCE_IDS: -1, "attention": -1, **dict.fromkeys(keys, IGNORE_INDEX)}
    batch = {key: torch.cat([*parts[key], torch.full((fill,), value)])[None] for key, value in tails.items()}
    batch["position_ids"] = torch.cat([*parts["position_ids"], torch.arange(fill) + last])[None]
    batch[ATTENTION_SEQUENCE_IDS] = batch.pop("attention")
    return batch


def _pad(rows: list[Tensor], length: int, value: int) -> Tensor:
    out = rows[0].new_full((len(rows), length), value)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def collate(
    samples: Sequence[Mapping[str, Tensor]],
    pad_to_multiple_of: int = 1,
    pad_id: int = 0,
    packing: bool = False,
    share_prefixes: bool = False,
) -> dict[str, Tensor]:
    """List of sample dicts (1-D `input_ids`, label keys, optional `pixel_values`) -> padded [B, S] micro-batch, or
    with `packing` one packed row (`pack`, `share_prefixes` passed on; padded rows share nothing)."""
    if packing:
        return pack(samples, pad_to_multiple_of, pad_id, share_prefixes)
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
