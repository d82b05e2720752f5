"""Preprocess once: the SFT samples of a split in memory-mapped Arrow files, shared by every rank and every later run.

Layout: `<data.cache_dir>/<fingerprint>/` holds `meta.json` (JSON: the key, the counts, the shard files) and one
`shard-<rank>.arrow` per rank that built it (Arrow IPC stream format, which `datasets.Dataset.from_file` opens too).
The fingerprint is a hash of the key, everything that changes a sample (see `SFTDataset`): the files' paths, sizes
and modification times, the format, columns, media_dir, the tokenizer's own serialization, the chat template, the
image processor's settings, max_seq_len, overlength, train_on_prompt, and this code (`CACHE_VERSION` and a hash of
the data modules' source). A changed input is another directory, so a stale cache is never found.

Build (a miss; `build`): every rank takes a contiguous share of the rows (rank r of W: rows [r N / W, (r+1) N / W)
of the split's rows in file order) and writes its shard into `.tmp-<fingerprint>-<id>/`; the first bad row a rank
meets stops its share, and after one exchange every rank raises the first bad row's `DataError` (in row order),
whichever rank met it. Rank 0 then writes `meta.json` last and renames the directory into place (one atomic
`rename`), so a directory under its fingerprint is complete, and a run killed half-way leaves only a `.tmp-`
directory that is never read (delete leftovers at will). Every rank then checks it sees the result, which needs
`data.cache_dir` on a file system every rank shares (the default, beside `train.output_dir`, is).

Read (`open_shards`): pyarrow memory-maps the shards (zero copy: the pages are the kernel's, shared by the ranks of a
machine and not in any rank's heap); `MappedRows` finds a row by its index over all shards and gives numpy views of
its columns. Nothing read runs code: Arrow and JSON only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy
import torch.distributed as dist

from veomni_lite.data.checks import DataError
from veomni_lite.distributed.collectives import agree, all_gather_objects, group_size

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
_CODE = ("sft.py", "sft_dataset.py", "sft_cache.py")  # their source is part of the key


def code_hash() -> str:
    """A hash of the data modules' source: a changed conversion, template or label rule is a new cache."""
    digest = hashlib.sha256()
    for name in _CODE:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()


def fingerprint(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def is_complete(directory: Path, fingerprint_: str) -> bool:
    """Whether `directory` holds a whole cache of this fingerprint and version."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    if meta.get("fingerprint") != fingerprint_ or meta.get("version") != CACHE_VERSION:
        return False
    return all((directory / shard["file"]).is_file() for shard in meta.get("shards", []))


def _rank(group: Any) -> int:
    return dist.get_rank(group) if group_size(group) > 1 else 0


def _attempt(work: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return work(), None
    except DataError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"data.cache_dir: {exc}"


WriteShard = Callable[[int, int, Path], dict[str, int]]


def build(
    root: Path,
    key: Mapping[str, Any],
    num_rows: Callable[[], int],
    write_shard: WriteShard,
    group: Any = None,
    what: str = "",
) -> tuple[Path, bool]:
    """(the cache directory of `key` under `root`, whether it was found). On a miss every rank runs
    `write_shard(start, stop, path)` on its share of the `num_rows()` rows, which returns its counts (summed into
    `meta["counts"]`); see the module docstring. Collective over `group` (every rank calls it alike). Every rank calls
    `write_shard` (a failure to make the directory is agreed before), so it may run collectives, each rank the same
    ones, as long as it returns or raises a DataError or OSError only after them."""
    fp = fingerprint(key)
    final = root / fp
    rank, size = _rank(group), group_size(group)
    seen = all_gather_objects((fp, is_complete(final, fp), f".tmp-{fp}-{uuid.uuid4().hex[:8]}"), group)
    if len({view[0] for view in seen}) > 1:
        others = [r for r, view in enumerate(seen) if view[0] != seen[0][0]]
        raise DataError(
            f"{what}: rank(s) {others} see other data than rank 0 (another file size or time, tokenizer or setting): "
            "every rank must read the same files"
        )
    if seen[0][1]:
        agree(None if is_complete(final, fp) else f"cannot see the cache {final}", DataError, group)
        return final, True
    tmp = root / seen[0][2]
    if rank == 0:
        logger.info("%s: preprocessing into %s (%d rank(s) share the rows)", what, final, size)

    # write_shard may run collectives (the preference reference's forwards): a rank that cannot make the directory
    # must not skip them alone, so that failure is agreed before
    _, problem = _attempt(lambda: tmp.mkdir(parents=True, exist_ok=True))
    try:
        agree(problem, DataError, group)
    except DataError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def write() -> dict[str, int]:
        rows = num_rows()
        counts = write_shard(rows * rank // size, rows * (rank + 1) // size, tmp / f"shard-{rank:05d}.arrow")
        return {**counts, "rows_total": rows}

    counts, problem = _attempt(write)
    outcomes = all_gather_objects((problem, counts), group)
    first = next((p for p, _ in outcomes if p), None)
    if first is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(first)
    shards = [{"file": f"shard-{r:05d}.arrow", **c} for r, (_, c) in enumerate(outcomes)]
    problem = None
    if rank == 0:
        _, problem = _attempt(lambda: _publish(tmp, final, fp, key, shards))
    agree(problem, DataError, group)
    unseen = f"cannot see the cache {final} that rank 0 wrote: data.cache_dir must be a directory every rank shares"
    agree(None if is_complete(final, fp) else unseen, DataError, group)
    return final, False


def _publish(tmp: Path, final: Path, fp: str, key: Mapping[str, Any], shards: list[dict[str, Any]]) -> None:
    missing = [s["file"] for s in shards if not (tmp / s["file"]).is_file()]
    if missing:
        raise DataError(
            f"data.cache_dir: rank 0 cannot see {missing} in {tmp} that the other ranks wrote: data.cache_dir must "
            "be a directory every rank shares"
        )
    counts = {name: sum(s[name] for s in shards) for name in shards[0] if name not in ("file", "rows_total")}
    meta = {"version": CACHE_VERSION, "fingerprint": fp, "key": key, "counts": counts, "shards": shards}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    if final.exists():
        if is_complete(final, fp):  # another job built the same cache meanwhile: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(final)  # not complete under its own name: only by hand, since the rename is atomic
    os.rename(tmp, final)


def open_shards(directory: Path) -> tuple[dict[str, Any], list[Any]]:
    """(meta, the shards as memory-mapped pyarrow Tables, in row order)."""
    import pyarrow as pa

    meta = json.loads((directory / "meta.json").read_text())
    tables = []
    for shard in meta["shards"]:
        with pa.memory_map(str(directory / shard["file"])) as source:
            table = pa.ipc.open_stream(source).read_all()
        if table.num_rows != shard["samples"]:
            raise DataError(f"{directory / shard['file']}: {table.num_rows} samples, meta.json says {shard['samples']}")
        tables.append(table)
    return meta, tables


def write_batches(path: Path, schema: Any, batches: Iterable[dict[str, Any]]) -> None:
    """Arrow IPC stream file of `batches` (column name -> pyarrow array), written as they come."""
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(pa.record_batch(batch, schema=schema))


class MappedRows:
    """The rows of memory-mapped shards (`open_shards`' tables) by their index over all shards. `view(batch)`: zero-copy
    numpy views of a record batch's columns, `scalars` as they are and each of `lists` as its `values` and its
    `<name>.offsets` (kept per batch: a few small objects); `list(i, name)`: row i's list, a view of the file."""

    def __init__(self, tables: Sequence[Any], lists: Sequence[str] = (), scalars: Sequence[str] = ()) -> None:
        self.batches = [batch for table in tables for batch in table.to_batches()]
        self.starts = numpy.cumsum([0] + [batch.num_rows for batch in self.batches])
        self.lists, self.scalars = tuple(lists), tuple(scalars)
        self._views: dict[int, dict[str, numpy.ndarray]] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(record batch, row within it) of row `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        batch = int(numpy.searchsorted(self.starts, index, side="right")) - 1
        return batch, index - int(self.starts[batch])

    def view(self, batch: int) -> dict[str, numpy.ndarray]:
        view = self._views.get(batch)
        if view is None:
            record = self.batches[batch]
            view = {name: record.column(name).to_numpy() for name in self.scalars}
            for name in self.lists:
                column = record.column(name)
                view[name], view[f"{name}.offsets"] = column.values.to_numpy(), column.offsets.to_numpy()
            self._views[batch] = view
        return view

    def scalar(self, index: int, name: str) -> Any:
        batch, local = self.locate(index)
        return self.view(batch)[name][local]

    def list(self, index: int, name: str) -> numpy.ndarray:
        batch, local = self.locate(index)
        view = self.view(batch)
        offsets = view[f"{name}.offsets"]
        return view[name][int(offsets[local]) : int(offsets[local + 1])]

    def value(self, index: int, name: str) -> Any:
        """Row `index`'s `name` as Python (`as_py`: nested or nullable columns)."""
        batch, local = self.locate(index)
        return self.batches[batch].column(name)[local].as_py()

    def list_lengths(self, name: str) -> numpy.ndarray:
        """Every row's length of the list column `name`, from the offsets alone."""
        parts = [numpy.diff(batch.column(name).offsets.to_numpy()) for batch in self.batches]
        return numpy.concatenate(parts) if parts else numpy.zeros(0, dtype=numpy.int64)
