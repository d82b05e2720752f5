"""DCP checkpoints that are complete or invisible.

Layout: `<root>/step_00000010/` holds the sharded model + optimizer (`torch.distributed.checkpoint`, `.metadata`;
a LoRA run's adapters and their optimizer state only, see `trainable_only`),
`trainer_state.pt` (what every rank shares: step, scheduler, data position, token count) and `rank_00003.pt`
(what each rank owns: its RNG states; a checkpoint never holds an open metric window). Everything is written under
`step_XXXXXXXX.tmp/` and renamed by rank 0 after every rank has finished, so a crash mid-save leaves no directory
that looks complete. `load_latest` tries complete checkpoints newest first; one that fails to load is reported by
name (a warning) and the previous one is used.

Across machines: the list of checkpoints is rank 0's, shared with every rank, so all ranks resume the same step;
`check_shared` (called by the trainer at start) makes a checkpoint root that some rank cannot see (a node-local
directory) a clear error on every rank, since rank 0 renames every save and every rank reads every checkpoint. A
checkpoint whose parameters do not match the model (names or shapes) is an error naming them, not a fallback. The
model and optimizer are resharded by DCP, so a run may resume on another world size, dp x sp layout or GPU count;
each rank's RNG state is its own current device's, restored to the current device.

Loading runs no code from the checkpoint (see `safe_load`): the two `.pt` files hold plain data read with
`weights_only=True`, and `.metadata` is checked by a restricted unpickler before DCP reads it (through the same
unpickler). A refused file is named in the warning and its checkpoint is skipped on every rank, like a corrupt one.
"""

from __future__ import annotations

import logging
import random
import re
import secrets
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from veomni_lite.config_sections import EXAMPLE_MODEL_FIELDS
from veomni_lite.distributed.collectives import agree, all_gather_objects, all_reduce, name_problems, rank_problems
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
# DCP warns on every single-process save/load; single process is a supported layout here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used; the message names it."""


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
    """This rank's RNG states; on CUDA only its current device's (a rank uses one device), so a resume on a machine
    with another number of visible GPUs restores it unchanged."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, list):  # written before: every visible device's state; take this rank's device's
            cuda = cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
        torch.cuda.set_rng_state(cuda)


class CheckpointManager:
    """Save, list and load checkpoints under `root`, keeping the newest `keep` complete ones. `trainable_only` (a
    LoRA run): the model state saved and restored is the parameters that train (`requires_grad`); the frozen base is
    not copied into each checkpoint but rebuilt as the run built it (`model.pretrained_dir`)."""

    def __init__(self, root: str | Path, keep: int = 2, trainable_only: bool = False) -> None:
        self.root = Path(root)
        self.keep = keep
        self.rank = dist.get_rank() if _distributed() else 0
        self.trainable_only = trainable_only
        # strict=False on load: the frozen parameters are absent by design (`_check_model_fits` checks the rest)
        self._options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint this rank sees, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found)

    def agreed_checkpoints(self) -> list[tuple[int, Path]]:
        """Collective: rank 0's `complete_checkpoints()`, the same list on every rank (one decision for all)."""
        steps = all_gather_objects([step for step, _ in self.complete_checkpoints()])[0]
        return [(step, self.step_dir(step)) for step in steps]

    def check_shared(self) -> None:
        """Collective: raise CheckpointError on every rank when some rank cannot read a file rank 0 writes under the
        root, e.g. a node-local directory (rank 0 renames each save; every rank reads each checkpoint)."""
        if not _distributed():
            return
        token = all_reduce(secrets.randbits(62) if self.rank == 0 else 0, op="max")
        probe = self.root / f".shared_probe_{token:016x}"
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe.write_text(str(token))
            except OSError as exc:
                logger.error("checkpoint root %s: cannot write %s: %s", self.root, probe.name, exc)
        _barrier()
        try:
            seen = probe.read_text() == str(token)
        except OSError:
            seen = False
        try:
            agree(
                None if seen else f"cannot read the file {probe.name} that rank 0 wrote there",
                CheckpointError,
                where=f"checkpoint directory {self.root} is not shared by every rank (put train.output_dir on a "
                "filesystem that every node mounts: rank 0 renames each save; every rank reads each checkpoint): ",
            )
        finally:
            if self.rank == 0 and seen:
                probe.unlink()

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
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options)
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

    def _read_small_files(self, path: Path) -> tuple[str | None, Any, dict[str, Any] | None, dict[str, Any] | None]:
        """(problem naming the file, DCP metadata, trainer_state, rank_state): this rank's small files, read safely,
        before DCP."""
        for name in (METADATA, TRAINER_STATE):
            if not (path / name).is_file():
                return f"missing {path / name}", None, None, None
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
                return f"{kind} {file}: {_describe(exc)}", None, None, None
        return None, loaded[0], loaded[1], loaded[2]

    def load_latest(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        on_skip: Callable[[str], None] | None = None,
        model_settings: dict[str, Any] | None = None,
        checkpoints: list[tuple[int, Path]] | None = None,
    ) -> tuple[int, dict[str, Any], dict[str, Any] | None] | None:
        """Restore the newest loadable checkpoint; (step, trainer_state, this rank's state or None) or None.

        Collective. A checkpoint that fails on any rank is skipped on every rank, with a warning naming it (and the
        file, when a file is missing, refused or unreadable). One whose parameters do not fit `model` raises
        CheckpointError on every rank (they all read the same metadata), naming the `model_settings` (this run's
        model.* config) that differ from the checkpoint's run. `checkpoints`: the `agreed_checkpoints()` the caller
        already has (else they are agreed here).
        """
        for step, path in reversed(self.agreed_checkpoints() if checkpoints is None else checkpoints):
            problem, metadata, trainer_state, rank_state = self._read_small_files(path)
            if problems := rank_problems(problem)[0]:
                self._skip(path, name_problems(problems), on_skip)
                continue
            model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options)
            saved_settings = model_settings_of(trainer_state.get("config", {}))
            _check_model_fits(path, metadata, model_sd, saved_settings, model_settings or {})
            try:
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(path))
                problem = None
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - unreadable: fall back to the previous
                # (DCP's CheckpointException derives from BaseException.)
                problem = _describe(exc)
            if problems := rank_problems(problem)[0]:
                self._skip(path, name_problems(problems), on_skip)
                continue
            loaded = {"model_state_dict": state["model"], "optim_state_dict": state["optim"]}
            set_state_dict(model, optimizer, **loaded, options=self._options)
            return step, trainer_state, rank_state
        return None

    def load_model_weights(self, model: nn.Module) -> int:
        """Load the newest complete checkpoint's model weights into an unsharded `model` in this one process (no
        process group: DCP reassembles the shards); returns its step. The same safe readers as `load_latest`. With
        `trainable_only`, the parameters of `model` that train (a LoRA run's adapters) are loaded, the rest kept."""
        found = self.complete_checkpoints()
        if not found:
            raise CheckpointError(f"no complete checkpoint under {self.root}")
        step, path = found[-1]
        load_dcp_metadata(path / METADATA)  # refuses a tampered file before DCP reads it
        state = {"model": model.state_dict()}
        if self.trainable_only:
            trained = {name for name, param in model.named_parameters() if param.requires_grad}
            state["model"] = {name: value for name, value in state["model"].items() if name in trained}
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(path))
        model.load_state_dict(state["model"], strict=not self.trainable_only)
        return step

    def _skip(self, path: Path, problem: str, on_skip: Callable[[str], None] | None) -> None:
        message = f"checkpoint {path} is unusable ({problem}); falling back to the previous complete checkpoint"
        if on_skip is not None:
            on_skip(message)
        else:
            logger.warning(message)


def model_settings_of(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that shape a model, of a config as `Config.to_dict` writes it: `model` and the tiny examples' sizes
    (`example`, under their old `model.*` names; a checkpoint of before the `example` section holds them there)."""
    sizes = {key: value for key, value in config.get("example", {}).items() if key in EXAMPLE_MODEL_FIELDS}
    return {**sizes, **config.get("model", {})}


def _check_model_fits(
    path: Path, metadata: Any, model_sd: dict[str, Any], saved_settings: dict[str, Any], settings: dict[str, Any]
) -> None:
    """Raise CheckpointError naming the parameters where the checkpoint and the model differ (and the model.*
    settings that differ between the checkpoint's run and this one)."""
    saved = {
        key.removeprefix("model."): list(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
    here = {key: list(value.shape) for key, value in model_sd.items() if isinstance(value, torch.Tensor)}
    problems = [f"{key} is missing there" for key in here if key not in saved]
    problems += [
        f"{key} is {saved[key]} there, {shape} here" for key, shape in here.items() if saved.get(key, shape) != shape
    ]
    problems += [f"{key} is not in this model" for key in saved if key not in here]
    if not problems:
        return
    changed = [
        f"model.{key}: {saved_settings.get(key)!r} there, {value!r} here"
        for key, value in settings.items()
        if key in saved_settings and saved_settings[key] != value
    ]
    raise CheckpointError(
        f"checkpoint {path} does not fit this model: {len(problems)} parameter(s) differ ({'; '.join(problems[:4])})"
        + (f"; settings that differ: {', '.join(changed)}" if changed else "")
        + ". Resume with the model it was written for, or train into a new train.output_dir"
    )
