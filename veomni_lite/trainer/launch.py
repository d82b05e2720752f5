"""Shared body of the torchrun entry points: parse the config, set up the logger, train, list what the run wrote.

The usage line and the final summary are printed (they are the CLI's own output); everything the library says goes
through the `veomni_lite` logger. An error that stops the run is said once (`veomni_lite.torchrun.record_error`):
under torchrun in each rank's error file, which torchrun's report and `python -m veomni_lite.torchrun` print (the
latter last, with its exit code), else on stderr. An error every rank raises alike (`AGREED_ERRORS`: a bad config,
bad data, a cause the ranks agreed on) is one line without a traceback; any other keeps its traceback.

A finished run's last lines list every top-level entry of `train.output_dir` that the run wrote or changed (files,
then directories with a trailing `/`): metrics.jsonl, the figures (loss_curve.png, a trainer's own: reward_curve.png,
accuracy_curve.png), rollouts.jsonl, tensorboard/, checkpoints/, config.yaml, ...; what the directory held before and
the run left alone (an earlier command's file) is not listed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from veomni_lite.config import NAMED_ARCHES, ConfigError, load_config
from veomni_lite.data.checks import DataError
from veomni_lite.distributed.collectives import destroy_process_groups
from veomni_lite.log import setup_logging
from veomni_lite.models.pretrained import PretrainedDirError
from veomni_lite.models.registry import CAUSAL_LM, family_of
from veomni_lite.torchrun import record_error, recording
from veomni_lite.trainer.base import BaseTrainer, NonFiniteError
from veomni_lite.trainer.checkpoint import CheckpointError
from veomni_lite.utils.loss_utils import LossKeyMismatchError

# Errors every rank raises alike (read from the same config, or agreed through `agree` before raising): how each is
# labelled, and the exit code (2: the user's input).
AGREED_ERRORS: dict[type[Exception], tuple[str, int]] = {
    ConfigError: ("config error", 2),
    DataError: ("data error", 2),
    PretrainedDirError: ("data error", 2),
    CheckpointError: ("CheckpointError", 1),
    NonFiniteError: ("NonFiniteError", 1),
    LossKeyMismatchError: ("LossKeyMismatchError", 1),
}


def main(
    trainers: Mapping[str, type[BaseTrainer]],
    argv: list[str] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
    sections: Mapping[str, type] | None = None,
) -> int:
    """`<entry>.py CONFIG.yaml [--section.key VALUE ...]`; `trainers` maps each `model.arch` this entry trains to its
    trainer (`"*"`: any transformers causal-LM model_type); `defaults`: this entry's own config defaults, under the
    YAML (see `load_config`); `sections`: its own config sections (e.g. `{"rl": RLConfig}`). Returns the exit code:
    0; 2 for a config or data error (config errors come before any process group); 1 for another error, whose
    traceback is recorded under torchrun and raised without it."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("--"):
        print(f"usage: {sys.argv[0]} CONFIG.yaml [--section.key VALUE ...]", file=sys.stderr)
        return 2
    trainer: BaseTrainer | None = None
    before: dict[str, int] = {}
    try:  # an error is recorded before the teardown, which a rank that already exited does not wait for
        trainer = _build(trainers, argv, defaults, sections, before)
        trainer.train()
        if trainer.is_main:
            print(f"[veomni_lite] done: {trainer.step} steps. Outputs in {trainer.output_dir.resolve()}:")
            for name in written_since(trainer.output_dir, before):
                print(f"  {os.path.join(trainer.output_dir, name)}")  # a directory keeps its trailing /
        return 0
    except tuple(AGREED_ERRORS) as exc:
        label, code = next(AGREED_ERRORS[kind] for kind in type(exc).__mro__ if kind in AGREED_ERRORS)
        record_error(f"{label}: {exc}", agreed=True)
        if recording():  # torchrun stops the ranks still running when one exits: each finishes its own exit instead
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return code
    except Exception:
        if not recording():
            raise
        record_error(traceback.format_exc().rstrip(), agreed=False)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        destroy_process_groups()


def snapshot(directory: Path) -> dict[str, int]:
    """{name: newest modification time in ns} of each top-level entry of `directory` (a directory's over everything
    under it, itself included); {} when `directory` does not exist."""
    if not directory.is_dir():
        return {}
    times = {}
    for entry in directory.iterdir():
        newest = entry.lstat().st_mtime_ns
        if entry.is_dir() and not entry.is_symlink():
            for root, dirs, files in os.walk(entry):
                for name in dirs + files:
                    with contextlib.suppress(OSError):  # a file removed while walking
                        newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime_ns)
        times[entry.name] = newest
    return times


def written_since(directory: Path, before: Mapping[str, int]) -> list[str]:
    """The top-level entries of `directory` that are new or changed since `before` (`snapshot`): files, then
    directories with a trailing `/`, each sorted by name."""
    changed = [name for name, newest in snapshot(directory).items() if before.get(name) != newest]
    files = sorted(name for name in changed if not (directory / name).is_dir())
    return files + sorted(f"{name}/" for name in changed if (directory / name).is_dir())


def _build(
    trainers: Mapping[str, type[BaseTrainer]],
    argv: list[str],
    defaults: Mapping[str, Mapping[str, Any]] | None,
    sections: Mapping[str, type] | None = None,
    before: dict[str, int] | None = None,
) -> BaseTrainer:
    """The trainer `argv`'s config names (logging set up in between: config errors come before any process group);
    `before` gets the output directory's `snapshot` from before the trainer is built (the main rank's)."""
    config = load_config(argv[0], argv[1:], defaults=defaults, sections=sections)
    if before is not None and int(os.environ.get("RANK", "0")) == 0:
        before.update(snapshot(Path(config.train.output_dir)))
    arch = config.model.arch
    causal_lm = arch not in NAMED_ARCHES and family_of(arch).wrapper == CAUSAL_LM.wrapper  # a listed one too
    trainer_cls = trainers.get(arch, trainers.get("*") if causal_lm else None)
    if trainer_cls is None:
        names = sorted(name if name != "*" else "any causal LM (qwen2, llama, ...)" for name in trainers)
        raise ConfigError(f"model.arch: {sys.argv[0]} trains {names}, not {arch!r}")
    setup_logging(int(os.environ.get("RANK", "0")))
    return trainer_cls(config)
