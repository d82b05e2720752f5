"""Reading checkpoint files without running code they carry.

Contract: loading a checkpoint never executes anything its files contain. A file that would need more than plain
data (or, for DCP metadata, more than DCP's own metadata types) raises `RefusedFileError` naming it; nothing outside
the allowlists is imported or called on the way.

- Our own files (`trainer_state.pt`, `rank_XXXXX.pt`) hold plain data only: dict, list, tuple, str, int, float, bool,
  None and plain CPU tensors (`check_plain` enforces it when saving). `load_plain` reads them with
  `torch.load(weights_only=True)`, which needs no extra allowlist for these types.
- DCP's `.metadata` is a plain pickle that DCP itself reads with `pickle.load`. `load_dcp_metadata` reads it with
  `MetadataUnpickler` first. A pickle reaches a callable only through `find_class` (GLOBAL, STACK_GLOBAL, INST,
  OBJ and the EXT opcodes all go through it; REDUCE, NEWOBJ and BUILD only call or build what is already on the
  stack), so `find_class` is the gate. It accepts the explicit (module, name) pairs in `DCP_METADATA_GLOBALS` plus
  torch dtypes by name (module `torch`, a name whose attribute is a `torch.dtype`); everything else is refused.
  Persistent ids are refused too (the base class has no `persistent_load`).
- `SafeFileSystemReader` makes DCP read `.metadata` through the same unpickler (no second, unchecked read) and
  never falls back to per-rank `__N.metadata` files, which we do not write.
- `SafeLoadPlanner` reads DCP's non-tensor items (e.g. optimizer param_groups, stored as small `torch.save` blobs in
  the `.distcp` shards) with `weights_only=True`; DCP's default planner uses `weights_only=False`. DCP already
  reads the shards' tensors with `weights_only=True`.

The metadata allowlist was recorded from the `find_class` calls made while loading `.metadata` files that the
trainer wrote (FSDP2 model + AdamW state: text and VLM on one process, VLM on 2 gloo ranks, text with SP 2), torch
2.13. Every allowed global is a dataclass, an enum, `torch.Size`, a dtype, a pathlib path or
`torch.serialization._get_layout` (a lookup of a layout by name): building them runs no code from the file.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_PATH_CLASSES = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")

DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        # StorageMeta.checkpoint_id; Python 3.13 pickles paths as pathlib._local.<class>.
        *(("pathlib", name) for name in _PATH_CLASSES),
        *(("pathlib._local", name) for name in _PATH_CLASSES),
    }
)
# vars(), not dir() + getattr(): no lazy torch submodule gets imported.
TORCH_DTYPE_NAMES: frozenset[str] = frozenset(
    name for name, value in vars(torch).items() if isinstance(value, torch.dtype)
)
_PLAIN_LEAVES = (type(None), bool, int, float, str)
_HOW_TO_PROCEED = (
    "nothing in it ran. Resume from another checkpoint or start fresh (checkpoint.resume false); if you wrote this "
    "file yourself and trust it, load it once with torch.load(weights_only=False) and save its contents as plain data"
)
_HOW_TO_PROCEED_METADATA = (
    "nothing in it ran. Resume from another checkpoint or start fresh (checkpoint.resume false); a trusted checkpoint "
    "written by another torch version may use DCP metadata types this check does not know yet: add them to "
    "DCP_METADATA_GLOBALS in veomni_lite/trainer/safe_load.py"
)


class RefusedFileError(RuntimeError):
    """A checkpoint file that needs more than plain data to load; the message names it. Nothing in it ran."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP `.metadata`: only the globals DCP writes there (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and name in TORCH_DTYPE_NAMES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not a DCP metadata type")


def load_dcp_metadata(path: str | Path) -> Metadata:
    """Unpickle the DCP metadata at `path` with `MetadataUnpickler`; also refuse shard paths outside its directory."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise RefusedFileError(f"refused {path}: {exc}; {_HOW_TO_PROCEED_METADATA}") from None
    if not isinstance(metadata, Metadata):
        raise RefusedFileError(f"refused {path}: it holds a {type(metadata).__name__}, not DCP Metadata")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or Path(relative).name != relative or relative in ("", ".", ".."):
            raise RefusedFileError(f"refused {path}: shard path {relative!r} is not a file in the checkpoint")
    return metadata


def load_plain(path: str | Path) -> Any:
    """`torch.load(path, weights_only=True)`; a refusal becomes `RefusedFileError` naming the file."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise RefusedFileError(f"refused {path}: {_reason(exc)}; {_HOW_TO_PROCEED}") from None


def check_plain(value: Any, where: str) -> None:
    """Raise TypeError naming the first part of `value` that `load_plain` would refuse or that is not plain data."""
    kind = type(value)
    if kind in _PLAIN_LEAVES or kind is torch.Tensor:
        return
    if kind in (list, tuple):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
        return
    if kind is dict:
        for key, item in value.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}; checkpoint state must be plain data (dict, list, "
        "tuple, str, int, float, bool, None, torch.Tensor) so that it loads with weights_only=True"
    )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` through `MetadataUnpickler` and never per-rank metadata."""

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then does not try `__N.metadata`
        path = Path(self.path) / ".metadata"
        metadata = load_dcp_metadata(path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with `weights_only=True`."""

    def __init__(self, checkpoint_dir: str | Path | None = None) -> None:
        super().__init__()
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Same placement as DefaultLoadPlanner.load_bytes; only the load differs (it uses weights_only=False).
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise RefusedFileError(
                f"refused {self._shard(read_item)} (the saved value {read_item.dest_index.fqn!r}): {_reason(exc)}; "
                f"{_HOW_TO_PROCEED}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    def _shard(self, read_item: ReadItem) -> str:
        """The shard file holding `read_item`, as far as the metadata says."""
        metadata = getattr(self, "metadata", None)
        info = (metadata.storage_data or {}).get(read_item.storage_index) if metadata is not None else None
        name = getattr(info, "relative_path", None)
        if name is None:
            return "a .distcp shard"
        return str(self.checkpoint_dir / name) if self.checkpoint_dir is not None else name


def _reason(exc: BaseException) -> str:
    """The refused global from torch's long weights_only message (without its advice to allowlist it)."""
    if match := re.search(r"Unsupported global: GLOBAL (\S+)", str(exc)):
        return f"it needs {match.group(1)}, which is not plain data"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
