"""Step-wise micro-batching that gives the same global batches whatever the data-parallel layout.

Contract: step s (counted over all epochs from 0) trains on the global batch of samples [j*G, (j+1)*G) of a seeded
permutation of the dataset, where j = s mod steps_per_epoch and the permutation is drawn with seed + epoch
(epoch = s // steps_per_epoch; a trailing partial global batch is dropped). This rank takes the dp_rank-th
contiguous block of G / dp_size samples and cuts it into grad_accum = G / (micro_batch_size * dp_size) micro-batches
of micro_batch_size samples, each passed through `collate_fn`. Only `step` is state, so a loader restored with
`load_state_dict` continues exactly, under any dp layout.

With `max_tokens` > 0 (`data.max_tokens_per_micro_batch`), the rank's block is instead planned into as few
micro-batches as fit that many tokens (`veomni_lite.data.packing.plan_micro_batches`; `packing` says how a
micro-batch is costed), so the count may differ across ranks and steps; the samples of each step are unchanged.

With `prefetch_steps` k > 0, the next k steps' micro-batches are fetched and collated on a background thread while
the current step trains (the indices are fixed by the step number, so the batches are the same as without it); an
error there surfaces from the `next_step` that needs that step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.data import Subset

from veomni_lite.data.packing import plan_micro_batches

__all__ = ["MicroBatchLoader"]


class IndexableDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Mapping[str, Tensor]: ...


MicroBatch = dict[str, Tensor]


def sample_length(dataset: Any, index: int) -> int:
    """Tokens of sample `index`: the dataset's `length(index)` where it has one (through a `Subset` too), else the
    size of its `input_ids`."""
    if isinstance(dataset, Subset):
        return sample_length(dataset.dataset, dataset.indices[index])
    length = getattr(dataset, "length", None)
    return int(length(index)) if callable(length) else int(dataset[index]["input_ids"].numel())


class MicroBatchLoader:
    """Yields, per optimizer step, this rank's list of `grad_accum` collated micro-batches (an endless iterator)."""

    def __init__(
        self,
        dataset: IndexableDataset,
        collate_fn: Callable[[Sequence[Mapping[str, Tensor]]], MicroBatch],
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        seed: int = 0,
        prefetch_steps: int = 0,
        max_tokens: int = 0,
        packing: bool = False,
    ) -> None:
        if min(global_batch_size, micro_batch_size, dp_size) < 1:
            raise ValueError(
                f"global_batch_size ({global_batch_size}), micro_batch_size ({micro_batch_size}) and dp_size "
                f"({dp_size}) must be >= 1"
            )
        if max_tokens and global_batch_size % dp_size:
            raise ValueError(f"global_batch_size ({global_batch_size}) must be divisible by dp_size ({dp_size})")
        if not max_tokens and global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by micro_batch_size ({micro_batch_size}) "
                f"x dp_size ({dp_size}) = {micro_batch_size * dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must be in [0, dp_size ({dp_size}))")
        if len(dataset) < global_batch_size:
            raise ValueError(f"dataset has {len(dataset)} samples, fewer than global_batch_size ({global_batch_size})")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.grad_accum = global_batch_size // (micro_batch_size * dp_size)  # without a token budget
        self.max_tokens = max_tokens
        self.packing = packing
        self.steps_per_epoch = len(dataset) // global_batch_size
        self.step = 0  # steps produced so far
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)
        self.prefetch_steps = prefetch_steps
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch_steps > 0 else None
        self._ahead: dict[int, Future[list[MicroBatch]]] = {}

    @property
    def epoch(self) -> int:
        """Epoch of the most recently produced step (0 before the first)."""
        return max(self.step - 1, 0) // self.steps_per_epoch

    def _permutation(self, epoch: int) -> Tensor:
        if epoch != self._perm_epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(len(self.dataset), generator=generator)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, step: int) -> list[int]:
        """Dataset indices of the whole global batch of `step` (identical on every rank and layout)."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        start = in_epoch * self.global_batch_size
        return self._permutation(epoch)[start : start + self.global_batch_size].tolist()

    def rank_indices(self, step: int) -> list[list[int]]:
        """This rank's dataset indices of `step`, one list per micro-batch."""
        per_rank = self.global_batch_size // self.dp_size
        mine = self.global_indices(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        if self.max_tokens:
            lengths = [sample_length(self.dataset, i) for i in mine]
            where = f"step {step + 1}, dp rank {self.dp_rank}: "
            plan = plan_micro_batches(lengths, self.max_tokens, self.packing, where)
            return [[mine[j] for j in micro_batch] for micro_batch in plan]
        mbs = self.micro_batch_size
        return [mine[i * mbs : (i + 1) * mbs] for i in range(self.grad_accum)]

    def _collate(self, indices: list[list[int]]) -> list[MicroBatch]:
        return [self.collate_fn([self.dataset[i] for i in chunk]) for chunk in indices]

    def next_step(self) -> list[MicroBatch]:
        """The rank's `grad_accum` micro-batches for the next optimizer step."""
        if self._pool is None:
            micro_batches = self._collate(self.rank_indices(self.step))
        else:
            for step in range(self.step, self.step + self.prefetch_steps + 1):
                if step not in self._ahead:  # indices on this thread: the permutation cache is not shared
                    self._ahead[step] = self._pool.submit(self._collate, self.rank_indices(step))
            micro_batches = self._ahead.pop(self.step).result()
        self.step += 1
        return micro_batches

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        return self

    def __next__(self) -> list[MicroBatch]:
        return self.next_step()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at `state["step"]`; seed and global batch size must match (the dp layout may differ)."""
        for key in ("seed", "global_batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"MicroBatchLoader.load_state_dict: checkpoint {key}={state[key]} but this loader has "
                    f"{key}={getattr(self, key)}; resuming would replay different global batches"
                )
        self.step = int(state["step"])
        self._ahead.clear()  # fetched for other steps

    def close(self) -> None:
        """Stop the prefetch thread (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            self._ahead.clear()
