"""`count_loss_token`: valid-token counts per loss key, and the step's counts kept for the loss scaling.

Contract (VeOmni's): `count_loss_token(batches)` returns `{<name>_tokens: int64 0-d tensor}`, the valid entries
(!= IGNORE_INDEX) of each `<name>_labels` key (`labels` -> `foundation_tokens`) summed over every micro-batch given;
a micro-batch with a true `padding_flag` counts 0. Nothing is read from a device.

Labels in host memory (the usual case: the trainer counts the CPU micro-batches before moving them), a list of
micro-batches is counted in one pass over all its labels and the per-micro-batch counts are read once from host
memory (`numpy`, no device involved). That `CountedStep` is kept until the next list is counted:
- `count_loss_token(micro_batch)` of one of its micro-batches, unchanged (same labels tensors at the same versions,
  same padding flag), returns the kept counts instead of counting again;
- `mean_global_loss` knows each count it handed out as a Python int (`host_count`), so on a host-memory reduce it
  scales each loss by one multiply with a host number.
Labels on an accelerator, or a tensor `padding_flag`, are counted on their device with no read (`count_on_device`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from veomni_lite.loss_keys import IGNORE_INDEX, name_of_labels, tokens_key

__all__ = [
    "CountedStep",
    "count_loss_token",
    "count_on_device",
    "count_on_host",
    "counted_step",
    "forget_counted_step",
]

_TOKEN_KEYS: dict[str, str | None] = {}  # batch key -> its `<name>_tokens` key, or None for a non-labels key


def _token_key_of(batch_key: str) -> str | None:
    if batch_key not in _TOKEN_KEYS:
        name = name_of_labels(batch_key) if isinstance(batch_key, str) else None
        _TOKEN_KEYS[batch_key] = None if name is None else tokens_key(name)
    return _TOKEN_KEYS[batch_key]


def _iter_micro_batches(batches: Any, where: str = "batches") -> Iterator[Mapping[str, Any]]:
    if isinstance(batches, Mapping):
        yield batches
    elif isinstance(batches, (list, tuple)):
        for index, item in enumerate(batches):
            yield from _iter_micro_batches(item, f"{where}[{index}]")
    else:
        raise TypeError(
            f"count_loss_token: {where} is a {type(batches).__name__}; expected a dict micro-batch "
            "or a (nested) list/tuple of them"
        )


def _labels_of(batch: Mapping[str, Any]) -> list[tuple[str, str, torch.Tensor]]:
    """(batch key, token key, labels) of every labels key of `batch`, in its order."""
    found = []
    for batch_key, labels in batch.items():
        token_key = _token_key_of(batch_key)
        if token_key is None:
            continue
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"count_loss_token: {batch_key!r} is a {type(labels).__name__}; expected a tensor")
        found.append((batch_key, token_key, labels))
    return found


def _valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    return torch.count_nonzero(labels != IGNORE_INDEX)  # int64, 0-d


def count_on_device(micro_batches: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Counts as device tensors, no read: each key's labels counted in one pass over their concatenation.

    A count lands on the device of the key's first labels.
    """
    first: dict[str, torch.Tensor] = {}  # token key -> its first labels, in order of appearance
    unpadded: dict[str, list[torch.Tensor]] = {}
    flagged: dict[str, list[torch.Tensor]] = {}  # counts of micro-batches whose padding_flag is a tensor
    for batch in micro_batches:
        padding_flag = batch.get("padding_flag", False)
        for _, token_key, labels in _labels_of(batch):
            first.setdefault(token_key, labels)
            if isinstance(padding_flag, torch.Tensor):
                count = _valid_tokens(labels)
                padded = padding_flag.to(count.device).bool().any()
                flagged.setdefault(token_key, []).append(torch.where(padded, 0, count))
            elif not padding_flag:
                unpadded.setdefault(token_key, []).append(labels)
    counts: dict[str, torch.Tensor] = {}
    for token_key, first_labels in first.items():
        device = first_labels.device
        parts = unpadded.get(token_key, [])
        if not parts:
            count = torch.zeros((), dtype=torch.int64, device=device)
        elif len(parts) == 1:
            count = _valid_tokens(parts[0]).to(device)
        elif all(part.device == device for part in parts):
            count = _valid_tokens(torch.cat([part.reshape(-1) for part in parts]))
        else:
            count = torch.stack([_valid_tokens(part).to(device) for part in parts]).sum()
        for extra in flagged.get(token_key, []):
            count = count + extra.to(device)
        counts[token_key] = count
    return counts


def _int64(value: int) -> torch.Tensor:
    return torch.scalar_tensor(value, dtype=torch.int64)


@dataclass(slots=True, eq=False)
class _CountedMicroBatch:
    """One micro-batch's counts; its labels are held (not the batch), so the record is valid while they are."""

    keys: tuple[str, ...]  # the batch's keys when counted
    labels: tuple[tuple[str, torch.Tensor, int], ...]  # (batch key, labels, version when counted)
    padding_flag: Any
    counts: dict[str, int]  # token key -> valid tokens (0 when padded)
    handed_out: dict[str, torch.Tensor] | None = None  # what count_loss_token(batch) returned

    def describes(self, batch: Mapping[str, Any]) -> bool:
        """`batch` holds exactly these labels, unedited, under the same padding flag."""
        if batch.get("padding_flag", False) is not self.padding_flag:
            return False
        if tuple(batch) != self.keys:  # keys changed: exact only if no labels key came or went
            labels_keys = sum(1 for batch_key in batch if _token_key_of(batch_key) is not None)
            if labels_keys != len(self.labels):
                return False
        for batch_key, labels, version in self.labels:
            if batch.get(batch_key) is not labels or labels._version != version:
                return False
        return True


@dataclass
class CountedStep:
    """A list of micro-batches counted from host memory: the step dict it returned and every count as an int."""

    token_len: dict[str, torch.Tensor]  # the dict count_loss_token returned (its identity keys the loss memo)
    totals: dict[str, int]
    micro_batches: dict[int, _CountedMicroBatch]  # by id(batch); records hold labels, not batches
    _issued: dict[int, tuple[torch.Tensor, int, int]] = field(default_factory=dict)  # id -> (tensor, version, n)

    def __post_init__(self) -> None:
        for key, tensor in self.token_len.items():
            self._issued[id(tensor)] = (tensor, tensor._version, self.totals[key])

    def describes(self, token_len: Mapping[str, Any]) -> bool:
        """`token_len` is the step dict this count returned, with the same values at the same versions."""
        if token_len is not self.token_len or len(token_len) != len(self.totals):
            return False
        return all(self.host_count(value) == self.totals[key] for key, value in token_len.items())

    def host_count(self, value: Any) -> int | None:
        """`value`'s count as an int, if it is a count this step handed out, unedited (or an int); else None."""
        if isinstance(value, torch.Tensor):
            entry = self._issued.get(id(value))
            if entry is not None and entry[0] is value and value._version == entry[1]:
                return entry[2]
            return None
        return value if type(value) is int else None

    def micro_batch_counts(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
        """The kept counts of `batch` if this step counted it and it is unchanged; else None."""
        record = self.micro_batches.get(id(batch))
        if record is None or not record.describes(batch):
            return None
        handed_out = record.handed_out
        if handed_out is None or any(self.host_count(t) is None for t in handed_out.values()):
            handed_out = {}
            for key, count in record.counts.items():
                tensor = handed_out[key] = _int64(count)
                self._issued[id(tensor)] = (tensor, 0, count)  # a new tensor is at version 0
            record.handed_out = handed_out
        return dict(handed_out)


def _count_runs(parts: list[torch.Tensor]) -> list[int]:
    """The valid tokens of each (non-empty, host-memory) labels tensor, from ONE concatenation and one read of host
    memory: along the last dimension where the parts allow it (no flattening copy), else flattened."""
    try:
        joined = torch.cat(parts, dim=-1)
        sizes = [part.shape[-1] for part in parts]
    except RuntimeError:  # other leading dimensions, or 0-d labels
        joined = torch.cat([part.reshape(-1) for part in parts])
        sizes = [part.numel() for part in parts]
    valid = joined.numpy() != IGNORE_INDEX  # the one read
    running = numpy.cumsum(valid.reshape(-1, valid.shape[-1]).sum(0))[numpy.cumsum(sizes) - 1].tolist()
    return [after - before for before, after in zip([0, *running[:-1]], running)]


def count_on_host(micro_batches: list[Mapping[str, Any]]) -> CountedStep | None:
    """Count every labels tensor of the step in one pass and read the per-micro-batch counts once from host memory.

    None (count on the device instead) when a labels tensor is not in host memory or a padding flag is a tensor.
    """
    records: list[_CountedMicroBatch] = []
    parts: list[torch.Tensor] = []  # every labels tensor with tokens to count
    owners: list[tuple[dict[str, int], str]] = []  # each part's (micro-batch counts, token key)
    for batch in micro_batches:
        padding_flag = batch.get("padding_flag", False)
        if isinstance(padding_flag, torch.Tensor):
            return None
        counts: dict[str, int] = {}
        found = []
        for batch_key, token_key, labels in _labels_of(batch):
            if not labels.is_cpu:
                return None
            counts[token_key] = 0
            found.append((batch_key, labels, labels._version))
            if not padding_flag and labels.numel():
                parts.append(labels)
                owners.append((counts, token_key))
        records.append(_CountedMicroBatch(tuple(batch), tuple(found), padding_flag, counts))
    if parts:
        for (counts, token_key), count in zip(owners, _count_runs(parts)):
            counts[token_key] += count  # `+=`: `labels` and `foundation_labels` share a key
    totals: dict[str, int] = {}  # token key -> step total, in order of first appearance
    for record in records:
        for token_key, count in record.counts.items():
            totals[token_key] = totals.get(token_key, 0) + count
    return CountedStep(
        token_len={key: _int64(total) for key, total in totals.items()},
        totals=totals,
        micro_batches={id(batch): record for batch, record in zip(micro_batches, records)},
    )


_COUNTED: CountedStep | None = None


def counted_step() -> CountedStep | None:
    """The last list counted from host memory (one step's counts are kept)."""
    return _COUNTED


def forget_counted_step() -> None:
    global _COUNTED
    _COUNTED = None


def count_loss_token(batches: Any) -> dict[str, torch.Tensor]:
    """Valid-token counts per loss key, summed over all micro-batches given (int64 tensors, no device read).

    A list of GA micro-batches costs the ops of one pass; each of its micro-batches then costs no op.
    """
    global _COUNTED
    if isinstance(batches, Mapping):
        counted = _COUNTED
        kept = counted.micro_batch_counts(batches) if counted is not None else None
        return kept if kept is not None else count_on_device([batches])
    if type(batches) is list and all(type(batch) is dict for batch in batches):
        micro_batches = batches  # the usual flat list: nothing to unnest
    else:
        micro_batches = list(_iter_micro_batches(batches))
    counted = count_on_host(micro_batches)
    if counted is None:
        return count_on_device(micro_batches)
    _COUNTED = counted
    return counted.token_len
