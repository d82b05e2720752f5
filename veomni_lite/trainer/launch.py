"""Shared body of the torchrun entry points: parse the config, set up the logger, train, say where the outputs are.

The usage line, config errors and the final summary are printed (they are the CLI's own output); everything the
library says goes through the `veomni_lite` logger.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from veomni_lite.config import ConfigError, load_config
from veomni_lite.log import setup_logging
from veomni_lite.trainer.base import BaseTrainer


def main(trainers: Mapping[str, type[BaseTrainer]], argv: list[str] | None = None) -> int:
    """`<entry>.py CONFIG.yaml [--section.key VALUE ...]`; `trainers` maps each `model.arch` this entry trains to its
    trainer. Config errors exit 2 before any process group."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("--"):
        print(f"usage: {sys.argv[0]} CONFIG.yaml [--section.key VALUE ...]", file=sys.stderr)
        return 2
    try:
        config = load_config(argv[0], argv[1:])
        if config.model.arch not in trainers:
            raise ConfigError(f"model.arch: {sys.argv[0]} trains {sorted(trainers)}, not {config.model.arch!r}")
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    setup_logging(int(os.environ.get("RANK", "0")))
    trainer = trainers[config.model.arch](config)
    try:
        trainer.train()
        if trainer.is_main:
            print(f"[veomni_lite] done: {trainer.step} steps. Outputs in {trainer.output_dir.resolve()}:")
            for name in ("metrics.jsonl", "loss_curve.png", "tensorboard/", "checkpoints/", "config.yaml"):
                print(f"  {trainer.output_dir / name}")
    finally:
        trainer.close()
    return 0
