"""Weighted sources (`data.sources`): the samples of several datasets, drawn by weight, epoch by epoch.

An epoch of the mixture has `samples_per_epoch` = sum over sources of round(weight_i x len_i) (half up) samples, the
same every epoch, so `train.epochs` counts over it (`MicroBatchLoader.steps_per_epoch` = samples_per_epoch // global
batch). Source i gives its round(w_i x len_i) samples of epoch e as: floor(w_i) copies of every one of its samples,
then the first rest of a permutation of them (weight <= 1: a subset drawn without replacement, another one each
epoch; weight > 1: every sample repeated, plus a subset). The epoch's samples are then shuffled together
(`epoch_order`). Every draw comes from a generator seeded by (seed, epoch, source) alone, so the order is the same
on every rank, whatever the DP x SP layout or the number of input workers, and a resumed loader continues it from
its step alone; `state()` (the weights and source sizes) goes into the checkpoint so that a resume on changed
sources is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy
import torch
from torch import Tensor
from torch.utils.data import Subset

from veomni_lite.data.checks import DataError
from veomni_lite.data.loader import sample_length


def seeded_generator(*parts: int) -> torch.Generator:
    """A generator seeded by a hash of `parts` (e.g. seed, epoch, source): independent draws, alike on every rank."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class WeightedMixture:
    """Indexable as the concatenation of `datasets` (`__getitem__`, `length`, `where`); the loader draws each epoch's
    samples from it by `epoch_order` (see the module docstring)."""

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], names: Sequence[str]) -> None:
        self.datasets, self.weights, self.names = list(datasets), [float(w) for w in weights], list(names)
        self.sizes = [len(d) for d in self.datasets]
        self.offsets = numpy.cumsum([0, *self.sizes])
        self.counts = [int(w * n + 0.5) for w, n in zip(self.weights, self.sizes)]  # rounded half up
        for name, weight, size, count in zip(self.names, self.weights, self.sizes, self.counts):
            if weight <= 0 or count < 1:
                raise DataError(f"{name}: weight {weight} x {size} samples gives no sample per epoch")
        self.samples_per_epoch = sum(self.counts)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, index: int) -> tuple[int, int]:
        part = int(numpy.searchsorted(self.offsets, index, side="right")) - 1
        return part, index - int(self.offsets[part])

    def __getitem__(self, index: int) -> Any:
        part, local = self._locate(index)
        return self.datasets[part][local]

    def length(self, index: int) -> int:
        part, local = self._locate(index)
        return sample_length(self.datasets[part], local)

    def _inner(self, index: int) -> tuple[Any, int]:
        part, local = self._locate(index)
        dataset = self.datasets[part]
        if isinstance(dataset, Subset):
            return dataset.dataset, int(dataset.indices[local])
        return dataset, local

    def where(self, index: int) -> str:
        dataset, local = self._inner(index)
        return dataset.where(local)

    def tokens(self, index: int) -> Any:
        dataset, local = self._inner(index)
        return dataset.tokens(local)

    def image_references(self, index: int) -> Any:
        dataset, local = self._inner(index)
        return dataset.image_references(local)

    @property
    def stats(self) -> str:
        return "; ".join(
            f"{name}: {_stats(d)}, weight {w:g}" for name, d, w in zip(self.names, self.datasets, self.weights)
        )

    def epoch_order(self, epoch: int, seed: int) -> Tensor:
        """The `samples_per_epoch` indices of epoch `epoch`, in training order."""
        parts = []
        for part, (size, count) in enumerate(zip(self.sizes, self.counts)):
            full, rest = divmod(count, size)
            drawn = torch.randperm(size, generator=seeded_generator(seed, epoch, part))[:rest]
            parts.append(torch.cat([torch.arange(size).repeat(full), drawn]) + int(self.offsets[part]))
        chosen = torch.cat(parts)
        return chosen[torch.randperm(len(chosen), generator=seeded_generator(seed, epoch, -1))]

    def state(self) -> dict[str, Any]:
        return {"names": self.names, "weights": self.weights, "sizes": self.sizes}


def _stats(dataset: Any) -> Any:
    return getattr(dataset.dataset if isinstance(dataset, Subset) else dataset, "stats", f"{len(dataset)} samples")


def hold_out(dataset: Any, fraction: float, seed: int) -> tuple[Any, Any]:
    """(train, eval): `fraction` of the samples held out by a seeded permutation; of a mixture, of every source
    (the eval set is then their concatenation, each weight 1)."""

    def split(part: Any) -> tuple[Subset, Subset]:
        order = torch.randperm(len(part), generator=torch.Generator().manual_seed(seed)).tolist()
        held = int(len(order) * fraction)
        return Subset(part, sorted(order[held:])), Subset(part, sorted(order[:held]))

    if not isinstance(dataset, WeightedMixture):
        return split(dataset)
    pairs = [split(part) for part in dataset.datasets]
    train = WeightedMixture([t for t, _ in pairs], dataset.weights, dataset.names)
    kept = [(e, name) for (_, e), name in zip(pairs, dataset.names) if len(e)]
    return train, WeightedMixture([e for e, _ in kept], [1.0] * len(kept), [name for _, name in kept])
