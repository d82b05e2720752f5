"""DCP checkpoints that are complete or invisible.

Layout: `<root>/step_00000010/` holds the sharded model + optimizer (`torch.distributed.checkpoint`, `.metadata`),
`trainer_state.pt` (what every rank shares: step, scheduler, data position, metric series) and `rank_00003.pt`
(what each rank owns: its RNG states; a checkpoint never holds an open metric window). Everything is written under
`step_XXXXXXXX.tmp/` and renamed by rank 0 after every rank has finished, so a crash mid-save leaves no directory
that looks complete. `load_latest` tries complete checkpoints newest first; one that fails to load is reported by
name (a warning) and the previous one is used.

Loading runs no code from the checkpoint (see `safe_load`): the two `.pt` files hold plain data read with
`weights_only=True`, and `.metadata` is checked by a restricted unpickler before DCP reads it (through the same
unpickler). A refused file is named in the warning and its checkpoint is skipped on every rank, like a corrupt one.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from veomni_lite.distributed.collectives import all_reduce, group_size
from veomni_lite.trainer.safe_load import (
    RefusedFileError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_plain,
    load_dcp_metadata,
    load_plain,
)

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
TRAINER_STATE = "trainer_state.pt"
METADATA = ".metadata"
# Per-rank problem codes for one all-reduce: 1 + kind * len(_FILES) + file, so rank 0 can name another rank's file.
_KINDS = ("missing", "refused", "could not read")
_FILES = (METADATA, TRAINER_STATE, "rank file")
# DCP warns on every single-process save/load; single process is a supported layout here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used; the message names it."""


def _code(kind: str, file_index: int) -> int:
    return 1 + _KINDS.index(kind) * len(_FILES) + file_index


def _describe(exc: BaseException) -> str:
    """One line for a failed load; a refusal inside DCP is reported without DCP's per-rank tracebacks."""
    if isinstance(exc, CheckpointException):
        for failure, *_ in exc.failures.values():
            if isinstance(failure, RefusedFileError):
                exc = failure
                break
    return f"{type(exc).__name__}: {exc}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """Save, list and load checkpoints under `root`, keeping the newest `keep` complete ones."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep
        self.rank = dist.get_rank() if _distributed() else 0

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        rank_state: dict[str, Any],
    ) -> Path:
        """Collective: every rank calls it with its own `rank_state` (plain data, like `trainer_state`)."""
        check_plain(trainer_state, "trainer_state")
        check_plain(rank_state, "rank_state")
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(rank_state, self.rank_file(tmp))
        if self.rank == 0:
            torch.save(trainer_state, tmp / TRAINER_STATE)
        _barrier()
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for _, old in self.complete_checkpoints()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def rank_file(self, path: Path, rank: int | None = None) -> Path:
        return path / f"rank_{self.rank if rank is None else rank:05d}.pt"

    def _read_small_files(self, path: Path) -> tuple[int, str | None, dict[str, Any] | None, dict[str, Any] | None]:
        """(problem code, problem, trainer_state, rank_state): this rank's small files, read safely, before DCP."""
        for index, name in enumerate((METADATA, TRAINER_STATE)):
            if not (path / name).is_file():
                return _code("missing", index), f"missing {name}", None, None
        readers = ((path / METADATA, load_dcp_metadata), (path / TRAINER_STATE, load_plain))
        rank_file = self.rank_file(path)
        if rank_file.is_file():  # absent when resuming on more ranks than saved
            readers += ((rank_file, load_plain),)
        loaded: list[Any] = [None, None, None]
        for index, (file, read) in enumerate(readers):
            try:
                loaded[index] = read(file)
            except Exception as exc:  # noqa: BLE001 - refused or unreadable: fall back to the previous checkpoint
                kind = "refused" if isinstance(exc, RefusedFileError) else "could not read"
                return _code(kind, index), _describe(exc), None, None
        return 0, None, loaded[1], loaded[2]

    def _agree(self, path: Path, code: int, problem: str | None) -> str | None:
        """All-reduce every rank's problem code; this rank's problem, else the other ranks' named, else None."""
        codes = [0] * group_size()
        codes[self.rank] = code
        codes = all_reduce(codes, op="max")
        if problem is not None:
            return problem
        others = []
        for rank, other in enumerate(codes):
            if other:
                kind, index = divmod(other - 1, len(_FILES))
                name = self.rank_file(path, rank).name if index == 2 else _FILES[index]
                others.append(f"rank {rank}: {_KINDS[kind]} {path / name}")
        return "; ".join(others) or None

    def load_latest(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, on_skip: Callable[[str], None] | None = None
    ) -> tuple[int, dict[str, Any], dict[str, Any] | None] | None:
        """Restore the newest loadable checkpoint; (step, trainer_state, this rank's state or None) or None.

        Collective. A checkpoint that fails on any rank is skipped on every rank, with a warning naming it (and the
        file, when a file is missing, refused or unreadable).
        """
        for step, path in reversed(self.complete_checkpoints()):
            code, problem, trainer_state, rank_state = self._read_small_files(path)
            if problem := self._agree(path, code, problem):
                self._skip(path, problem, on_skip)
                continue
            try:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(path))
                problem = None
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - unreadable: fall back to the previous
                # (DCP's CheckpointException derives from BaseException.)
                problem = _describe(exc)
            if all_reduce(1 if problem else 0, op="max"):
                self._skip(path, problem or "failed to load on another rank", on_skip)
                continue
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            return step, trainer_state, rank_state
        return None

    def load_model_weights(self, model: nn.Module) -> int:
        """Load the newest complete checkpoint's model weights into an unsharded `model` in this one process (no
        process group: DCP reassembles the shards); returns its step. The same safe readers as `load_latest`."""
        found = self.complete_checkpoints()
        if not found:
            raise CheckpointError(f"no complete checkpoint under {self.root}")
        step, path = found[-1]
        load_dcp_metadata(path / METADATA)  # refuses a tampered file before DCP reads it
        state = {"model": model.state_dict()}
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(path))
        model.load_state_dict(state["model"])
        return step

    def _skip(self, path: Path, problem: str, on_skip: Callable[[str], None] | None) -> None:
        message = f"checkpoint {path} is unusable ({problem}); falling back to the previous complete checkpoint"
        if on_skip is not None:
            on_skip(message)
        else:
            logger.warning(message)

    def has_checkpoint(self) -> bool:
        return bool(self.complete_checkpoints())
