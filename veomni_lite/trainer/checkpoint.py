"""DCP checkpoints that are complete or invisible.

Layout: `<root>/step_00000010/` holds the sharded model + optimizer (`torch.distributed.checkpoint`, `.metadata`),
`trainer_state.pt` (what every rank shares: step, scheduler, data position, metric series) and `rank_00003.pt`
(what each rank owns: RNG states, its open metric window). Everything is written under `step_XXXXXXXX.tmp/` and
renamed by rank 0 after every rank has finished, so a crash mid-save leaves no directory that looks complete.
`load_latest` tries complete checkpoints newest first; one that fails to load is reported by name (a warning) and
the previous one is used.
"""

from __future__ import annotations

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

from veomni_lite.distributed.collectives import all_reduce

_STEP_DIR = re.compile(r"^step_(\d{8})$")
TRAINER_STATE = "trainer_state.pt"
# DCP warns on every single-process save/load; single process is a supported layout here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used; the message names it."""


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
        """Collective: every rank calls it with its own `rank_state`."""
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(rank_state, tmp / f"rank_{self.rank:05d}.pt")
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

    def _check_files(self, path: Path) -> str | None:
        for name in (".metadata", TRAINER_STATE):
            if not (path / name).is_file():
                return f"missing {name}"
        return None

    def load_latest(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, on_skip: Callable[[str], None] | None = None
    ) -> tuple[int, dict[str, Any], dict[str, Any] | None] | None:
        """Restore the newest loadable checkpoint; (step, trainer_state, this rank's state or None) or None.

        Collective. A checkpoint that fails on any rank is skipped on every rank, with a warning naming it.
        """
        for step, path in reversed(self.complete_checkpoints()):
            problem = self._check_files(path)
            failed = all_reduce(1 if problem else 0, op="max")
            if failed:
                self._skip(path, problem or "incomplete on another rank", on_skip)
                continue
            try:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=str(path))
                trainer_state = torch.load(path / TRAINER_STATE, weights_only=False)
                rank_file = path / f"rank_{self.rank:05d}.pt"
                rank_state = torch.load(rank_file, weights_only=False) if rank_file.is_file() else None
                problem = None
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - unreadable: fall back to the previous
                # (DCP's CheckpointException derives from BaseException.)
                problem = f"{type(exc).__name__}: {exc}"
            if all_reduce(1 if problem else 0, op="max"):
                self._skip(path, problem or "failed to load on another rank", on_skip)
                continue
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            return step, trainer_state, rank_state
        return None

    def _skip(self, path: Path, problem: str, on_skip: Callable[[str], None] | None) -> None:
        message = f"checkpoint {path} is unusable ({problem}); falling back to the previous complete checkpoint"
        if on_skip is not None:
            on_skip(message)
        else:
            warnings.warn(message, stacklevel=3)

    def has_checkpoint(self) -> bool:
        return bool(self.complete_checkpoints())
