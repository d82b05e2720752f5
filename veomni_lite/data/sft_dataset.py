"""The tokenized samples of one SFT split, checked row by row before training starts.

`SFTDataset` reads every row once at construction (on every rank alike, before any collective): the row is converted
(`to_conversation`), its images are opened and measured by the model's image processor, the conversation is
rendered and labelled (`ChatEncoder`), and the sample is cut to `max_seq_len` by `overlength` (`truncate`: cut, an
image never split; `drop`: left out; `error`: a DataError naming the row). Any bad row raises a `DataError` naming
the file and the row. Token ids are kept; images are decoded and processed again when a sample is fetched (in the
loader's prefetch thread), so `__getitem__` returns what the collator takes: `input_ids`, `labels` (unshifted), and
for images `pixel_values` and `image_grid_thw` from the model's own image processor. Rows are named as everywhere,
`row N (0-based)` within the file (`row_name`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import DEFAULT_COLUMNS, ChatEncoder, Source, load_image, row_name, to_conversation
from veomni_lite.loss_keys import IGNORE_INDEX

OVERLENGTH = ("truncate", "drop", "error")


@dataclass
class LengthStats:
    rows: int = 0
    truncated: int = 0
    dropped: int = 0

    def __str__(self) -> str:
        return f"{self.rows} rows, {self.truncated} truncated, {self.dropped} dropped"


@dataclass
class _Sample:
    source: int
    row: int
    input_ids: numpy.ndarray
    labels: numpy.ndarray
    num_images: int


class ImageProcessing:
    """The model's image processor (e.g. `Qwen2VLImageProcessor`) and how many placeholder tokens an image takes."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.merge = int(getattr(processor, "merge_size", 1))

    def __call__(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        out = self.processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def token_counts(self, grid: torch.Tensor) -> list[int]:
        return (grid.prod(-1) // (self.merge * self.merge)).tolist()


class SFTDataset:
    """Indexable samples of `sources` in order (see the module docstring); `stats` says what `overlength` did."""

    def __init__(
        self,
        sources: Sequence[Source],
        encoder: ChatEncoder,
        fmt: str,
        columns: Mapping[str, str],
        max_seq_len: int,
        overlength: str = "truncate",
        media_dir: str = "",
        images: ImageProcessing | None = None,
    ) -> None:
        if overlength not in OVERLENGTH:
            raise DataError(f"data.overlength: {overlength!r} is not one of {list(OVERLENGTH)}")
        self.sources = list(sources)
        self.images = images
        self.images_column = {**DEFAULT_COLUMNS, **columns}["images"]
        self.media_dirs = [Path(media_dir) if media_dir else source.path.parent for source in self.sources]
        self.stats = LengthStats()
        self.samples: list[_Sample] = []
        for index, source in enumerate(self.sources):
            for row_index, row in enumerate(source.rows):
                where = row_name(source.path, row_index)
                conversation = to_conversation(row, fmt, columns, where)
                lengths: list[int] = []
                if conversation.images:
                    if images is None:
                        raise DataError(f"{where}: the row has images but the model takes none")
                    decoded = [load_image(value, self.media_dirs[index], where) for value in conversation.images]
                    lengths = images.token_counts(images(decoded)["image_grid_thw"])
                encoded = encoder.encode(conversation, lengths, where)
                self.stats.rows += 1
                sample = self._fit(encoded.input_ids, encoded.labels, lengths, max_seq_len, overlength, where, encoder)
                if sample is None:
                    self.stats.dropped += 1
                    continue
                ids, labels, kept_images = sample
                self.samples.append(_Sample(index, row_index, numpy.array(ids), numpy.array(labels), kept_images))
        if not self.samples:
            raise DataError(f"{', '.join(str(s.path) for s in self.sources)}: no sample left ({self.stats})")

    def _fit(
        self,
        ids: list[int],
        labels: list[int],
        image_lengths: list[int],
        max_len: int,
        overlength: str,
        where: str,
        encoder: ChatEncoder,
    ) -> tuple[list[int], list[int], int] | None:
        """The sample within `max_len` tokens (None: dropped); an image whose tokens would be cut is cut whole."""
        if max_len <= 0 or len(ids) <= max_len:
            return ids, labels, len(image_lengths)
        if overlength == "error":
            raise DataError(f"{where}: {len(ids)} tokens, over data.max_seq_len={max_len} (data.overlength: error)")
        if overlength == "drop":
            return None
        cut, kept, position = max_len, 0, 0
        image_id = encoder.image_token_id
        while kept < len(image_lengths):  # find where each image's run of placeholder tokens starts
            position = ids.index(image_id, position)
            if position + image_lengths[kept] > cut:
                cut = position  # the image would be split: cut before it
                break
            position += image_lengths[kept]
            kept += 1
        self.stats.truncated += 1
        return ids[:cut], labels[:cut], kept

    def __len__(self) -> int:
        return len(self.samples)

    def length(self, index: int) -> int:
        """Tokens of sample `index` (image placeholders included), without loading its images."""
        return int(self.samples[index].input_ids.size)

    def where(self, index: int) -> str:
        sample = self.samples[index]
        return row_name(self.sources[sample.source].path, sample.row)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.samples[index]
        out = {"input_ids": torch.from_numpy(sample.input_ids), "labels": torch.from_numpy(sample.labels)}
        if sample.num_images:
            source = self.sources[sample.source]
            row = source.rows[sample.row]
            values = row[self.images_column]
            values = values if isinstance(values, list) else [values]
            decoded = [load_image(v, self.media_dirs[sample.source], self.where(index)) for v in values]
            assert self.images is not None
            out.update(self.images(decoded[: sample.num_images]))
        return out

    def trained_tokens(self, index: int) -> int:
        return int((self.samples[index].labels != IGNORE_INDEX).sum())
