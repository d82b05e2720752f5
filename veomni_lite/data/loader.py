"""Step-wise micro-batching that gives the same global batches whatever the data-parallel layout.

Contract: step s (counted over all epochs from 0) trains on the global batch of samples [j*G, (j+1)*G) of the
epoch's order, where j = s mod steps_per_epoch and epoch = s // steps_per_epoch (a trailing partial global batch is
dropped). The order is a permutation of the dataset drawn with seed + epoch, or, for a dataset that draws its own
epochs (`epoch_order(epoch, seed)` and `samples_per_epoch`, e.g. `veomni_lite.data.mixture.WeightedMixture`),
that. This rank takes the dp_rank-th contiguous block of G / dp_size samples and cuts it into
grad_accum = G / (micro_batch_size * dp_size) micro-batches of micro_batch_size samples, each passed through
`collate_fn`. Only `step` is state, so a loader restored with
`load_state_dict` continues exactly, under any dp layout; the state also records the epoch size (and a mixture's
weights and sizes), and a resume on other data is refused.

With `max_tokens` > 0 (`data.max_tokens_per_micro_batch`), the rank's block is instead planned into as few
micro-batches as fit that many tokens (`veomni_lite.data.packing.plan_micro_batches`; `packing` says how a
micro-batch is costed), so the count may differ across ranks and steps; the samples of each step are unchanged.

With `prefetch_steps` k > 0, the next k steps' micro-batches are fetched and collated on a background thread while
the current step trains (the indices are fixed by the step number, so the batches are the same as without it); an
error there surfaces from the `next_step` that needs that step. With `num_workers` > 0 the micro-batches are read
and collated by that many DataLoader worker processes (forked; pinned memory with `pin_memory`), in step order, so
the batches are again the same; the prefetch thread, if any, then takes them from the workers ahead of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from veomni_lite.data.checks import DataError
from veomni_lite.data.packing import plan_micro_batches

__all__ = ["MicroBatchLoader", "StepLoader", "epoch_size"]


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


class StepLoader:
    """What both loaders share (`MicroBatchLoader`, `veomni_lite.data.streaming.StreamingLoader`): the sizes checked,
    a step's global batch cut into this rank's micro-batches (`share`), the steps produced in order by `_produce`,
    `prefetch_steps` of them ahead on a background thread, `close`."""

    def __init__(
        self,
        collate_fn: Callable[[Sequence[Mapping[str, Tensor]]], MicroBatch],
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int,
        dp_rank: int,
        prefetch_steps: int,
        max_tokens: int,
        packing: bool,
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
        self.collate_fn = collate_fn
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.max_tokens, self.packing = max_tokens, packing
        self.grad_accum = global_batch_size // (micro_batch_size * dp_size)  # without a token budget
        self.step = 0  # steps produced so far
        self.prefetch_steps = prefetch_steps
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch_steps > 0 else None
        self._ahead: dict[int, Future[list[MicroBatch]]] = {}

    def share(self, step: int, batch: Sequence[Any], length: Callable[[Any], int]) -> list[list[Any]]:
        """This rank's dp block of step `step`'s global `batch`, one list per micro-batch: `micro_batch_size` items
        each, or planned by the token budget (`length(item)`: its tokens)."""
        per_rank = self.global_batch_size // self.dp_size
        mine = list(batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank])
        if self.max_tokens:
            where = f"step {step + 1}, dp rank {self.dp_rank}: "
            plan = plan_micro_batches([length(item) for item in mine], self.max_tokens, self.packing, where)
            return [[mine[j] for j in micro_batch] for micro_batch in plan]
        mbs = self.micro_batch_size
        return [mine[i * mbs : (i + 1) * mbs] for i in range(self.grad_accum)]

    def _produce(self, step: int) -> list[MicroBatch]:
        """Step `step`'s collated micro-batches for this rank (steps are asked for in order)."""
        raise NotImplementedError

    def next_step(self) -> list[MicroBatch]:
        """The rank's micro-batches for the next optimizer step."""
        if self._pool is None:
            micro_batches = self._produce(self.step)
        else:
            for step in range(self.step, self.step + self.prefetch_steps + 1):
                if step not in self._ahead:
                    self._ahead[step] = self._pool.submit(self._produce, step)
            micro_batches = self._ahead.pop(self.step).result()
        self.step += 1
        return micro_batches

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        return self

    def __next__(self) -> list[MicroBatch]:
        return self.next_step()

    def _drain(self) -> None:
        """Forget the steps fetched ahead (letting a running fetch finish first: it may be reading the source)."""
        for future in self._ahead.values():
            if not future.cancel():
                future.exception()
        self._ahead.clear()

    def close(self) -> None:
        """Stop the prefetch thread (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            self._ahead.clear()


class MicroBatchLoader(StepLoader):
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
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(
            collate_fn, global_batch_size, micro_batch_size, dp_size, dp_rank, prefetch_steps, max_tokens, packing
        )
        self.samples_per_epoch = epoch_size(dataset)
        if self.samples_per_epoch < global_batch_size:
            raise ValueError(
                f"dataset has {self.samples_per_epoch} samples per epoch, fewer than global_batch_size "
                f"({global_batch_size})"
            )
        self.dataset, self.seed = dataset, seed
        self.steps_per_epoch = self.samples_per_epoch // global_batch_size
        self._order: tuple[int, Tensor] = (-1, torch.empty(0, dtype=torch.long))  # one tuple: swapped atomically
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._feed: Iterator[MicroBatch] | None = None  # the workers' micro-batches, from step `_feed_step` on
        self._feed_step = -1

    @property
    def epoch(self) -> int:
        """Epoch of the most recently produced step (0 before the first)."""
        return max(self.step - 1, 0) // self.steps_per_epoch

    def _permutation(self, epoch: int) -> Tensor:
        cached = self._order  # read once: the prefetch thread may swap it meanwhile
        if cached[0] != epoch:
            order = getattr(self.dataset, "epoch_order", None)
            if callable(order):
                perm = order(epoch, self.seed)
            else:
                perm = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))
            cached = self._order = (epoch, perm)
        return cached[1]

    def global_indices(self, step: int) -> list[int]:
        """Dataset indices of the whole global batch of `step` (identical on every rank and layout)."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        start = in_epoch * self.global_batch_size
        return self._permutation(epoch)[start : start + self.global_batch_size].tolist()

    def rank_indices(self, step: int) -> list[list[int]]:
        """This rank's dataset indices of `step`, one list per micro-batch."""
        return self.share(step, self.global_indices(step), lambda index: sample_length(self.dataset, index))

    def _plans(self, first: int) -> Iterator[list[int]]:
        """Every micro-batch's indices from step `first` on, in order (what the workers read)."""
        step = first
        while True:
            yield from self.rank_indices(step)
            step += 1

    def _produce(self, step: int) -> list[MicroBatch]:
        indices = self.rank_indices(step)
        if not self.num_workers:
            return [self.collate_fn([self.dataset[i] for i in chunk]) for chunk in indices]
        assert self._feed is not None and self._feed_step == step, "the workers read the steps in order"
        self._feed_step = step + 1
        try:
            return [next(self._feed) for _ in indices]
        except DataError as exc:  # raised again by the DataLoader with the worker's traceback around the message
            raise DataError(_worker_message(str(exc))) from None

    def _start_workers(self) -> None:
        """The worker processes, reading from step `self.step` on (forked here, on the caller's thread)."""
        loader = DataLoader(
            self.dataset,
            batch_sampler=self._plans(self.step),
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            multiprocessing_context="fork",  # the dataset and collate_fn are inherited, never pickled
        )
        self._feed, self._feed_step = iter(loader), self.step

    def next_step(self) -> list[MicroBatch]:
        """The rank's micro-batches for the next optimizer step (the workers start at the first)."""
        if self.num_workers and self._feed is None:
            self._start_workers()
        return super().next_step()

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "seed": self.seed, "global_batch_size": self.global_batch_size}
        state["samples_per_epoch"] = self.samples_per_epoch
        mixture = getattr(self.dataset, "state", None)
        if callable(mixture):
            state["mixture"] = mixture()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at `state["step"]`; seed, global batch size, epoch size and a mixture's weights and sizes must
        match (the dp layout and the number of workers may differ)."""
        mine = self.state_dict()
        for key in ("seed", "global_batch_size", "samples_per_epoch", "mixture"):
            if key in state and state[key] != mine.get(key):
                raise ValueError(
                    f"MicroBatchLoader.load_state_dict: checkpoint {key}={state[key]} but this loader has "
                    f"{key}={mine.get(key)}; resuming would replay different global batches"
                )
        self._drain()
        self._stop_workers()  # they read ahead from the old step
        self.step = int(state["step"])

    def close(self) -> None:
        """Stop the prefetch thread and the workers (idempotent)."""
        super().close()
        self._stop_workers()

    def _stop_workers(self) -> None:
        shutdown = getattr(self._feed, "_shutdown_workers", None)  # else when the iterator is collected
        if callable(shutdown):
            shutdown()
        self._feed, self._feed_step = None, -1


def epoch_size(dataset: Any) -> int:
    """Samples per epoch: a dataset's own `samples_per_epoch` (a mixture's), else its length."""
    return int(getattr(dataset, "samples_per_epoch", len(dataset)))


def _worker_message(text: str) -> str:
    """The DataError's own message out of the DataLoader's \"Caught DataError in DataLoader worker process\" text."""
    marker = "DataError: "
    return text[text.rindex(marker) + len(marker) :].strip() if marker in text else text
