"""Streaming (`data.streaming: true`): the SFT training rows read in file order while training, without the cache, for a
set that does not fit on disk twice.

The stream (`SampleStream`): the files of `data.train_path` in order, row by row, each row converted, templated,
labelled and cut exactly as the cache does it (`RowEncoder`), read in windows of `data.shuffle_window` rows; each
window's samples are permuted by a generator seeded by (seed, epoch, the window's first file and row), so the order
mixes within a window and never across windows (1: file order). A pass over the files is an epoch; the next one
reads them again with other permutations.

The batches (`StreamingLoader`, `MicroBatchLoader`'s contract): step s trains on the next `train.global_batch_size`
samples of the stream, every one from the same pass (the samples left at the end of a pass, fewer than a global
batch, are dropped, as the map-style loader drops a partial batch). Every rank reads and encodes every row and
takes its dp block of the global batch, which token budgets and packing plan as `MicroBatchLoader` does (the step's
samples are the bounded buffer), so the global batches are the same whatever the DP x SP layout, and a bad row is the
same DataError, naming the file and the row, on every rank at the step that reaches it. Images are measured from
their headers by every rank and decoded only by the rank that trains them.

Resume by position: the loader's state holds, for the steps not yet trained, the stream's position before each
(epoch, the file and row its window starts at, the samples of that window already taken); a resumed run reads that
window again, skips what was taken and continues with exactly the samples the uninterrupted run trains, on any
layout. A resume on other files (paths or sizes), another window, seed or global batch size is refused.

What streaming gives up against the cache: a global shuffle (only within a window; the file order stays); an epoch
of known length (`train.epochs` and `data.eval_fraction` need one: set `train.max_steps` and `data.eval_path`);
weighted `data.sources`; worker processes (`data.num_workers`); reading a share: every rank reads and tokenizes every
row (the cache splits that work once, and later runs reuse it); and bad rows show at the step that reads them, not
before step 1.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch import Tensor

from veomni_lite.data.checks import DataError
from veomni_lite.data.loader import MicroBatch, StepLoader
from veomni_lite.data.mixture import seeded_generator
from veomni_lite.data.sft import row_name
from veomni_lite.data.sft_dataset import RowEncoder, image_tensors, token_tensors

__all__ = ["SampleStream", "StreamingLoader"]


@dataclass(frozen=True)
class Sample:
    """One encoded row, held only while its window is read."""

    where: str
    input_ids: numpy.ndarray  # int32
    labels: numpy.ndarray
    images: list[dict[str, Any]]
    image_tokens: list[int]


class SampleStream:
    """The samples of `rows`' sources, pass after pass, shuffled within windows of `window` rows (see the module
    docstring). `take(n)` gives the next n; `position()` and `seek()` say and set where the stream stands."""

    def __init__(self, rows: RowEncoder, window: int = 1000, seed: int = 0, what: str = "data.train_path") -> None:
        if window < 1:
            raise DataError(f"data.shuffle_window: must be >= 1, got {window}")
        self.rows, self.sources, self.window, self.seed, self.what = rows, rows.sources, window, seed, what
        self.counts = {"rows": 0, "truncated": 0, "dropped": 0, "samples": 0}  # what this process has read
        self._epoch, self._start, self._taken = 0, (0, 0), 0
        self._after = (0, 0)  # where the window after the current one starts
        self._samples: list[Sample] = []
        self._reader: Iterator[tuple[int, int, dict[str, Any]]] | None = None  # the rows after the window

    @property
    def stats(self) -> str:
        return f"streamed from {len(self.sources)} file(s) in order, shuffled within windows of {self.window} rows"

    def identity(self) -> dict[str, Any]:
        """What a resume must find unchanged: the files (paths and sizes), the window and the seed."""
        files = [[path, size] for source in self.sources for path, size, _ in source.identity()]
        return {"files": files, "window": self.window, "seed": self.seed}

    def position(self) -> dict[str, int]:
        """Where the stream stands: the epoch, the file and row its current window starts at, and how many of that
        window's samples were taken."""
        return {"epoch": self._epoch, "file": self._start[0], "row": self._start[1], "taken": self._taken}

    def seek(self, position: Mapping[str, int]) -> None:
        """Continue from `position` (one `position()` gave): its window is read again and its taken samples skipped."""
        self._epoch = int(position["epoch"])
        self._open_window((int(position["file"]), int(position["row"])))
        self._taken = int(position["taken"])
        if self._taken > len(self._samples):
            raise DataError(
                f"{self.what}: the window at {row_name(self.sources[self._start[0]].path, self._start[1])} now gives "
                f"{len(self._samples)} samples, fewer than the {self._taken} the checkpoint took: the files changed"
            )

    def take(self, count: int) -> tuple[int, list[Sample]]:
        """(epoch, the next `count` samples), all of one pass: where a pass ends first, its last samples are dropped
        and the next pass gives them all."""
        if self._reader is None:
            self._open_window(self._start)
        out: list[Sample] = []
        restarted = False
        while len(out) < count:
            if self._taken < len(self._samples):
                more = self._samples[self._taken : self._taken + count - len(out)]
                out += more
                self._taken += len(more)
            elif not self._read_window():
                if restarted:
                    raise DataError(
                        f"{self.what}: a whole pass over the files gives fewer than {count} samples (one global batch, "
                        f"train.global_batch_size); {self.counts['dropped']} row(s) dropped by data.overlength so far"
                    )
                restarted, out = True, []
                self._epoch += 1
                self._open_window((0, 0))
        return self._epoch, out

    def tensors(self, sample: Sample) -> dict[str, torch.Tensor]:
        """What the collator takes of `sample` (its images decoded and processed here)."""
        images = image_tensors(sample.images, sample.image_tokens, self.rows.images, sample.where, "the header read")
        return {**token_tensors(sample.input_ids, sample.labels), **images}

    # ------------------------------------------------------------------ reading

    def _rows_from(self, start: tuple[int, int]) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """(file index, row, row) from row start[1] of file start[0] on, to the end of the last file."""
        file, row = start
        for index in range(file, len(self.sources)):
            source = self.sources[index]
            for row_index, value in source.read(row if index == file else 0, source.num_rows):
                yield index, row_index, value
            source.close()

    def _open_window(self, start: tuple[int, int]) -> None:
        """Read the window that starts at `start` (a file and row), from a reader opened there."""
        self._reader = self._rows_from(start)
        self._after = start
        self._read_window()

    def _read_window(self) -> bool:
        """The next `window` rows of the reader as the current window, encoded and permuted; False where no row is
        left. A window starts where the one before it ends (`_after`: after its last row), so a seek to its start
        reads the same rows, which the same generator permutes."""
        assert self._reader is not None
        self._start = self._after
        samples: list[Sample] = []
        last = None
        for index, row_index, row in itertools.islice(self._reader, self.window):
            last = (index, row_index)
            encoded = self.rows(index, row_index, row, self.counts)
            if encoded is not None:
                _, _, _, ids, labels, references, tokens = encoded
                where = row_name(self.sources[index].path, row_index)
                ids, labels = numpy.asarray(ids, numpy.int32), numpy.asarray(labels, numpy.int32)
                samples.append(Sample(where, ids, labels, references, tokens))
        if last is not None:
            self._after = (last[0], last[1] + 1)
        if self.window > 1 and samples:
            generator = seeded_generator(self.seed, self._epoch, *self._start)
            samples = [samples[i] for i in torch.randperm(len(samples), generator=generator).tolist()]
        self._samples, self._taken = samples, 0
        return last is not None


class StreamingLoader(StepLoader):
    """Per optimizer step, this rank's list of collated micro-batches of the stream's next global batch (an endless
    iterator; see the module docstring). The interface of `MicroBatchLoader` (`next_step`, `step`, `epoch`,
    `state_dict`, `load_state_dict`, `close`); `steps_per_epoch` is None: a stream has no known length. With
    `prefetch_steps` k > 0 the next k steps are read and collated ahead on a background thread (the stream is read
    by that thread alone, step after step, so the batches are the same)."""

    def __init__(
        self,
        stream: SampleStream,
        collate_fn: Callable[[Sequence[Mapping[str, Tensor]]], MicroBatch],
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        prefetch_steps: int = 0,
        max_tokens: int = 0,
        packing: bool = False,
    ) -> None:
        super().__init__(
            collate_fn, global_batch_size, micro_batch_size, dp_size, dp_rank, prefetch_steps, max_tokens, packing
        )
        self.stream = stream
        self.steps_per_epoch: int | None = None
        self._lock = threading.Lock()  # the marks are written by the prefetch thread, read by `state_dict`
        # step -> the stream's position before it, and the epoch of the step before it (what a resume needs)
        self._marks: dict[int, dict[str, int]] = {0: {**stream.position(), "last_epoch": 0}}
        self._epochs: dict[int, int] = {}  # step -> its epoch

    @property
    def epoch(self) -> int:
        """Epoch (pass) of the most recently handed-out step (0 before the first)."""
        with self._lock:
            return self._epochs.get(self.step - 1, 0)

    def _produce(self, step: int) -> list[MicroBatch]:
        """Step `step`'s micro-batches for this rank; steps are produced in order (the stream is sequential)."""
        with self._lock:
            assert step in self._marks and step + 1 not in self._marks, "the stream is read step after step"
        epoch, samples = self.stream.take(self.global_batch_size)
        with self._lock:
            self._epochs[step] = epoch
            self._marks[step + 1] = {**self.stream.position(), "last_epoch": epoch}
            oldest = step + 1 - (self.prefetch_steps + 3)  # a trained step lags the produced ones by this at most
            for old in [k for k in self._marks if k < oldest]:
                del self._marks[old]
                self._epochs.pop(old, None)
        plan = self.share(step, samples, lambda sample: len(sample.input_ids))
        return [self.collate_fn([self.stream.tensors(sample) for sample in chunk]) for chunk in plan]

    def state_dict(self) -> dict[str, Any]:
        """The step, the stream's identity, and its position before each step not yet trained (`marks`: [step,
        position] pairs; the trainer replaces `step` by the steps it trained, which may lag the steps read)."""
        with self._lock:
            marks = [[step, dict(mark)] for step, mark in sorted(self._marks.items())]
        return {
            "step": self.step,
            "global_batch_size": self.global_batch_size,
            "streaming": self.stream.identity(),
            "marks": marks,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume before step `state["step"]`, at the stream position the state holds for it; the files, window,
        seed and global batch size must match (the dp layout may differ)."""
        mine = self.state_dict()
        for key in ("global_batch_size", "streaming"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"StreamingLoader.load_state_dict: checkpoint {key}={state.get(key)} but this loader has "
                    f"{key}={mine[key]}; resuming would replay different global batches"
                )
        step = int(state["step"])
        marks = {int(k): mark for k, mark in state["marks"]}
        if step not in marks:
            raise ValueError(
                f"StreamingLoader.load_state_dict: no stream position for step {step} (has {sorted(marks)})"
            )
        self._drain()
        self.stream.seek(marks[step])
        with self._lock:
            self.step = step
            self._marks = {step: dict(marks[step])}
            self._epochs = {step - 1: int(marks[step]["last_epoch"])}
