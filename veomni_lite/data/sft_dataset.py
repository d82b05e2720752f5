"""The tokenized samples of one SFT split: preprocessed once into the Arrow cache (`sft_cache`), read memory-mapped.

Preprocessing (every rank a share of the rows, before any step): each row is converted (`to_conversation`), its
images are referenced and measured from their header only (`ImageProcessing.token_count`: the image processor's
own resize rule, nothing decoded), the conversation is rendered and labelled (`ChatEncoder`) and cut to
`max_seq_len` by `overlength` (`truncate`: cut, an image never split; `drop`: left out; `error`: a DataError naming
the row). Any bad row raises a `DataError` naming the file and the row, on every rank alike. The cache holds per
sample: `source` (the file's index) and `row`, `input_ids` and `labels` (int32, unshifted), `length`, and the kept
images (`images`: `{"path", "bytes"}` references) with their `image_tokens`.

Reading: `__getitem__` returns what the collator takes: `input_ids` and `labels` (int64), and for images
`pixel_values` and `image_grid_thw` from the model's own image processor; the pixels are decoded there, in the input
pipeline (the prefetch thread or `data.num_workers` worker processes). An image that does not decode then is a
`DataError` naming the row, which the trainer turns into the same stop on every rank at that step (`_agree`). No
rank holds the samples in its heap: `length(i)` and every sample are read from the memory-mapped columns. Rows are
named as everywhere, `row N (0-based)` within the file (`row_name`). `CachedSamples` is the part the preference pairs
(`veomni_lite.preference.pairs`) share: the build through the cache, the memory-mapped rows, their names and images.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

from veomni_lite.data import sft_cache
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import (
    DEFAULT_COLUMNS,
    ChatEncoder,
    Source,
    image_reference,
    open_image,
    row_name,
    to_conversation,
)
from veomni_lite.loss_keys import IGNORE_INDEX

OVERLENGTH = ("truncate", "drop", "error")
BATCH_ROWS = 1024  # samples per Arrow record batch


@dataclass
class LengthStats:
    rows: int = 0
    truncated: int = 0
    dropped: int = 0

    def __str__(self) -> str:
        return f"{self.rows} rows, {self.truncated} truncated, {self.dropped} dropped"


class ImageProcessing:
    """The model's image processor (e.g. `Qwen2VLImageProcessor`) and how many placeholder tokens an image takes:
    `tokens(patches, processor)`, the family's rule (`veomni_lite.models.registry.Vision.image_tokens`; default
    `merged_patches`)."""

    def __init__(self, processor: Any, tokens: Callable[[int, Any], int] | None = None) -> None:
        self.processor = processor
        self.merge = int(getattr(processor, "merge_size", 1))
        self.tokens = tokens or merged_patches

    def __call__(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        out = self.processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def token_counts(self, grid: torch.Tensor) -> list[int]:
        """Placeholder tokens of each image of `grid` ([images, 3]: its patches along t, h, w)."""
        return [self.tokens(int(patches), self.processor) for patches in grid.prod(-1).tolist()]

    def token_count(self, image: Any) -> int:
        """Placeholder tokens of `image` (a PIL image, maybe only its header read): from its size by the processor's
        own rule (`get_number_of_image_patches`, Qwen2-VL's `smart_resize` grid) without decoding, else processed."""
        patches = getattr(self.processor, "get_number_of_image_patches", None)
        if patches is not None:
            width, height = image.size
            return self.tokens(int(patches(height, width, {})), self.processor)
        return self.token_counts(self([image.convert("RGB")])["image_grid_thw"])[0]

    def settings(self) -> dict[str, Any]:
        return {"class": type(self.processor).__name__, **self.processor.to_dict()}


def merged_patches(patches: int, processor: Any) -> int:
    """Placeholder tokens of an image of `patches` patches where the vision merger joins each merge_size x merge_size
    block into one token (the processor's `merge_size`; Qwen-VL's), 1 per patch without it."""
    merge = int(getattr(processor, "merge_size", 1))
    return patches // (merge * merge)


def tokenizer_hash(tokenizer: Any) -> str:
    """A hash of everything of the tokenizer that changes a token: its serialization and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    extra = repr(
        (type(tokenizer).__name__, tokenizer.special_tokens_map, tokenizer.eos_token_id, tokenizer.unk_token_id)
    )
    return hashlib.sha256((text + extra).encode()).hexdigest()


def _schema() -> Any:
    import pyarrow as pa

    image = pa.struct([("path", pa.string()), ("bytes", pa.large_binary())])
    return pa.schema(
        [
            ("source", pa.int32()),
            ("row", pa.int64()),
            ("length", pa.int32()),
            ("input_ids", pa.large_list(pa.int32())),
            ("labels", pa.large_list(pa.int32())),
            ("images", pa.list_(image)),
            ("image_tokens", pa.list_(pa.int32())),
        ]
    )


class RowEncoder:
    """The rows of `sources` to their samples (see the module docstring): converted, images measured from their
    headers, templated, labelled and cut to `max_seq_len` by `overlength`. The cached dataset (`SFTDataset`) and the
    stream (`veomni_lite.data.streaming.SampleStream`) each take one."""

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
        self.sources, self.encoder, self.fmt, self.columns = list(sources), encoder, fmt, dict(columns)
        self.max_seq_len, self.overlength, self.images = max_seq_len, overlength, images
        self.files = [source.path for source in self.sources]
        # image paths resolve against `media_dir`, else each file's own directory
        self.media_dirs = [Path(media_dir) if media_dir else path.parent for path in self.files]

    def key(self) -> dict[str, Any]:
        """Everything that changes a sample, the cache's key (`sft_cache.fingerprint`): the files' identity, the
        format and columns, the tokenizer, template and image processor, the length rule, and this code."""
        encoder = self.encoder
        return {
            "version": sft_cache.CACHE_VERSION,
            "code": sft_cache.code_hash(),
            "files": [source.identity() for source in self.sources],
            "format": self.fmt,
            "columns": {**DEFAULT_COLUMNS, **self.columns},
            "media_dirs": [str(d.resolve()) for d in self.media_dirs],
            "tokenizer": tokenizer_hash(encoder.tokenizer),
            "chat_template": encoder.template,
            "image_token": encoder.image_token,
            "end_of_turn": sorted(encoder.end_of_turn),
            "train_on_prompt": encoder.train_on_prompt,
            "image_processor": self.images.settings() if self.images is not None else None,
            "max_seq_len": self.max_seq_len,
            "overlength": self.overlength,
        }

    def schema(self) -> Any:
        """The cache's columns, in the order `__call__` returns them."""
        return _schema()

    def measure_images(self, index: int, values: Sequence[Any], where: str) -> tuple[list[dict[str, Any]], list[int]]:
        """(references, placeholder tokens) of a row's images (of file `index`): from their headers, none decoded."""
        references: list[dict[str, Any]] = []
        lengths: list[int] = []
        if values and self.images is None:
            raise DataError(f"{where}: the row has images but the model takes none (not a vision-language model)")
        for value in values:
            reference = image_reference(value, self.media_dirs[index], where)
            references.append(reference)
            lengths.append(self.images.token_count(open_image(reference, where, decode=False)))
        return references, lengths

    def __call__(self, index: int, row_index: int, row: Mapping[str, Any], counts: dict[str, int]) -> tuple | None:
        """The sample of row `row_index` of file `index` as the cache's columns (`_schema`: source, row, length,
        input_ids, labels, images, image_tokens), or None where `overlength: drop` leaves it out; `counts` (rows,
        truncated, dropped, samples) are updated."""
        where = row_name(self.files[index], row_index)
        conversation = to_conversation(row, self.fmt, self.columns, where)
        references, lengths = self.measure_images(index, conversation.images, where)
        encoded = self.encoder.encode(conversation, lengths, where)
        counts["rows"] += 1
        fitted = self._fit(encoded.input_ids, encoded.labels, lengths, where)
        if fitted is None:
            counts["dropped"] += 1
            return None
        ids, labels, kept = fitted
        counts["truncated"] += len(ids) < len(encoded.input_ids)
        counts["samples"] += 1
        return index, row_index, len(ids), ids, labels, references[:kept], lengths[:kept]

    def _fit(
        self, ids: list[int], labels: list[int], image_lengths: list[int], where: str
    ) -> tuple[list[int], list[int], int] | None:
        """The sample within `max_seq_len` tokens (None: dropped); an image whose tokens would be cut is cut whole."""
        max_len = self.max_seq_len
        if max_len <= 0 or len(ids) <= max_len:
            return ids, labels, len(image_lengths)
        if self.overlength == "error":
            raise DataError(f"{where}: {len(ids)} tokens, over data.max_seq_len={max_len} (data.overlength: error)")
        if self.overlength == "drop":
            return None
        cut, kept, position = max_len, 0, 0
        image_id = self.encoder.image_token_id
        while kept < len(image_lengths):  # find where each image's run of placeholder tokens starts
            position = ids.index(image_id, position)
            if position + image_lengths[kept] > cut:
                cut = position  # the image would be split: cut before it
                break
            position += image_lengths[kept]
            kept += 1
        return ids[:cut], labels[:cut], kept


class CachedSamples:
    """The samples an encoder writes (`rows`: a `RowEncoder`, or one with its `key()`, `schema()` and call), in order,
    preprocessed once into the Arrow cache and read memory-mapped (`samples`: `sft_cache.MappedRows` of the columns
    `LISTS` and `SCALARS`); `stats` says what `overlength` did. `SFTDataset` and the preference pairs
    (`veomni_lite.preference.pairs.PairDataset`) are its two kinds.

    `cache_dir`: where the cache lives (`data.cache_dir`); None: a private temporary one, removed once mapped (one
    process only). `group`: the process group whose ranks share the preprocessing (None: the default group, if any).
    `found` says whether the cache was there already."""

    LISTS: tuple[str, ...] = ()
    SCALARS: tuple[str, ...] = ("source", "row")

    def __init__(self, rows: Any, cache_dir: str | Path | None = None, group: Any = None, what: str = "") -> None:
        self.rows, self.sources, self.images = rows, rows.sources, rows.images
        self.files, self.media_dirs = rows.files, rows.media_dirs
        private = cache_dir is None
        if private and sft_cache.group_size(group) > 1:
            raise DataError(f"{what}: several ranks share the preprocessing through a cache_dir they all see; give one")
        root = Path(tempfile.mkdtemp(prefix="veomni_lite_sft_")) if private else Path(cache_dir)
        try:
            built = sft_cache.build(root, rows.key(), self._num_rows, self._write_shard, group, what)
            self.directory, self.found = built
            meta, tables = sft_cache.open_shards(self.directory)
        finally:
            for source in self.sources:
                source.close()
            if private:
                shutil.rmtree(root, ignore_errors=True)  # the mapped files stay readable until unmapped
        counts = meta["counts"]
        self.stats = LengthStats(counts["rows"], counts["truncated"], counts["dropped"])
        self.samples = sft_cache.MappedRows(tables, self.LISTS, self.SCALARS)
        if len(self) == 0:
            raise DataError(f"{', '.join(str(s.path) for s in self.sources)}: no sample left ({self.stats})")

    # ------------------------------------------------------------------ preprocessing (a cache miss)

    def _num_rows(self) -> int:
        return sum(source.num_rows for source in self.sources)

    def _rows(self, start: int, stop: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """(source index, row, row) of the split's rows [start, stop), in file order."""
        first = 0
        for index, source in enumerate(self.sources):
            count = source.num_rows
            low, high = max(start - first, 0), min(stop - first, count)
            if low < high:
                for row_index, row in source.read(low, high):
                    yield index, row_index, row
            first += count

    def _write_shard(self, start: int, stop: int, path: Path) -> dict[str, int]:
        counts = {"rows": 0, "truncated": 0, "dropped": 0, "samples": 0}
        sft_cache.write_batches(path, self.rows.schema(), self._encoded_batches(start, stop, counts))
        return counts

    def _encoded_batches(self, start: int, stop: int, counts: dict[str, int]) -> Iterator[dict[str, Any]]:
        names = self.rows.schema().names
        columns: dict[str, list[Any]] = {name: [] for name in names}
        for index, row_index, row in self._rows(start, stop):
            sample = self.rows(index, row_index, row, counts)
            if sample is not None:
                for name, value in zip(names, sample):
                    columns[name].append(value)
            if len(columns["row"]) == BATCH_ROWS:
                yield columns
                columns = {name: [] for name in columns}
        if columns["row"] or not counts["samples"]:  # an empty shard still has its schema
            yield columns

    # ------------------------------------------------------------------ reading (memory-mapped)

    def __len__(self) -> int:
        return len(self.samples)

    def where(self, index: int) -> str:
        return row_name(self.files[int(self.samples.scalar(index, "source"))], int(self.samples.scalar(index, "row")))

    def image_references(self, index: int) -> tuple[list[dict[str, Any]], list[int]]:
        return self.samples.value(index, "images"), self.samples.value(index, "image_tokens")

    def decoded_images(self, index: int) -> dict[str, torch.Tensor]:
        """Sample `index`'s images decoded and processed (`image_tensors`), {} without any."""
        references, tokens = self.image_references(index)
        where = self.where(index) if references else ""
        return image_tensors(references, tokens, self.images, where, f"the cache {self.directory}", REMEDY)


class SFTDataset(CachedSamples):
    """Indexable samples of `rows`' sources in order (see the module docstring and `CachedSamples`)."""

    LISTS = ("input_ids", "labels")
    SCALARS = ("source", "row", "length")

    def __init__(
        self, rows: RowEncoder, cache_dir: str | Path | None = None, group: Any = None, what: str = "data.train_path"
    ) -> None:
        super().__init__(rows, cache_dir, group, what)

    def length(self, index: int) -> int:
        """Tokens of sample `index` (image placeholders included), without loading its images."""
        return int(self.samples.scalar(index, "length"))

    def tokens(self, index: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        """(input_ids, labels) of sample `index`: int32 views of the memory-mapped cache."""
        return self.samples.list(index, "input_ids"), self.samples.list(index, "labels")

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.tokens(index)
        return {**token_tensors(ids, labels), **self.decoded_images(index)}

    def trained_tokens(self, index: int) -> int:
        return int((self.tokens(index)[1] != IGNORE_INDEX).sum())


REMEDY = "; delete that directory"


def token_tensors(ids: numpy.ndarray, labels: numpy.ndarray, labels_key: str = "labels") -> dict[str, torch.Tensor]:
    """`input_ids` and `labels_key` as int64 tensors (copies: the cache's pages stay read-only)."""
    return {
        "input_ids": torch.from_numpy(ids.astype(numpy.int64)),
        labels_key: torch.from_numpy(labels.astype(numpy.int64)),
    }


def image_tensors(
    references: list[dict[str, Any]],
    tokens: list[int],
    images: ImageProcessing | None,
    where: str,
    origin: str,
    remedy: str = "",
) -> dict[str, torch.Tensor]:
    """The image processor's `pixel_values` and `image_grid_thw` of `references`, decoded here ({} without any);
    images whose token counts are no longer the `tokens` that `origin` holds (a file changed since) are a DataError
    naming the row (and `remedy`)."""
    if not references:
        return {}
    assert images is not None
    out = images([open_image(reference, where) for reference in references])
    if images.token_counts(out["image_grid_thw"]) != tokens:
        raise DataError(
            f"{where}: its images now take {images.token_counts(out['image_grid_thw'])} tokens, {origin} has "
            f"{tokens}: an image file changed since{remedy}"
        )
    return out
