"""Shared body of the torchrun entry points: parse the config, set up the logger, train, say where the outputs are.

The usage line, config and data errors and the final summary are printed (they are the CLI's own output); everything the
library says goes through the `veomni_lite` logger.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from veomni_lite.config import NAMED_ARCHES, ConfigError, load_config
from veomni_lite.data.checks import DataError
from veomni_lite.distributed.collectives import destroy_process_groups
from veomni_lite.log import setup_logging
from veomni_lite.models.pretrained import PretrainedDirError
from veomni_lite.models.registry import CAUSAL_LM, family_of
from veomni_lite.trainer.base import BaseTrainer


def main(
    trainers: Mapping[str, type[BaseTrainer]],
    argv: list[str] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
    sections: Mapping[str, type] | None = None,
) -> int:
    """`<entry>.py CONFIG.yaml [--section.key VALUE ...]`; `trainers` maps each `model.arch` this entry trains to its
    trainer (`"*"`: any transformers causal-LM model_type); `defaults`: this entry's own config defaults, under the
    YAML (see `load_config`); `sections`: this entry's own config sections (e.g. `{"rl": RLConfig}`). Config errors
    exit 2 before any process group."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("--"):
        print(f"usage: {sys.argv[0]} CONFIG.yaml [--section.key VALUE ...]", file=sys.stderr)
        return 2
    try:
        config = load_config(argv[0], argv[1:], defaults=defaults, sections=sections)
        arch = config.model.arch
        causal_lm = arch not in NAMED_ARCHES and family_of(arch) is CAUSAL_LM
        trainer_cls = trainers.get(arch, trainers.get("*") if causal_lm else None)
        if trainer_cls is None:
            names = sorted(name if name != "*" else "any causal LM (qwen2, llama, ...)" for name in trainers)
            raise ConfigError(f"model.arch: {sys.argv[0]} trains {names}, not {arch!r}")
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    setup_logging(int(os.environ.get("RANK", "0")))
    try:
        trainer = trainer_cls(config)
    except (DataError, PretrainedDirError) as exc:  # every rank raises it alike (see SFTTrainer.build_datasets)
        print(f"data error: {exc}", file=sys.stderr)
        destroy_process_groups()
        return 2
    try:
        trainer.train()
        if trainer.is_main:
            print(f"[veomni_lite] done: {trainer.step} steps. Outputs in {trainer.output_dir.resolve()}:")
            for name in ("metrics.jsonl", "loss_curve.png", "tensorboard/", "checkpoints/", "config.yaml"):
                print(f"  {trainer.output_dir / name}")
    finally:
        trainer.close()
    return 0
