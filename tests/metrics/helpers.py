"""A `MetricLogger` fed the way the trainer feeds it, without a model: each step is micro-batches of (loss, tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from veomni_lite.config import LoggingConfig
from veomni_lite.distributed.parallel_state import ParallelState
from veomni_lite.metrics import MetricLogger

TIME_KEYS = ("train/tokens_per_s", "train/tflops", "train/mfu", "train/peak_mem_mb")  # wall clock or memory


def make_logger(output_dir: Path, parallel: ParallelState | None = None, max_steps: int = 7, **settings: Any):
    """One "foundation_loss" head; console, JSONL, TensorBoard and PNG on, bookkeeping inline unless asked."""
    settings = {"log_interval": 3, "progress_bar": False, "async_step_end": False, **settings}
    return MetricLogger(
        LoggingConfig(**settings),
        parallel or ParallelState(),
        loss_names=["foundation_loss"],
        output_dir=output_dir,
        max_steps=max_steps,
        device=torch.device("cpu"),
        flops_per_token=lambda seq_len: 6.0 * seq_len,
    )


def record_step(
    logger: MetricLogger,
    micro_batches: list[tuple[float, int]],
    grad_norm: float = 0.5,
    lr: float = 1e-4,
    skipped: bool = False,
) -> None:
    """One optimizer step: per micro-batch a local mean loss over `tokens` tokens (all real, none padding)."""
    for loss, tokens in micro_batches:
        logger.record_micro_batch(
            {"foundation_loss": torch.tensor(loss)},
            {"foundation_tokens": torch.tensor(tokens)},
            {"input_ids": torch.ones(1, tokens, dtype=torch.long)},
        )
    logger.record_step(torch.tensor(grad_norm), lr=lr, skipped=skipped, step_time=0.1, bookkeeping_wait=0.0)


def train_step(logger: MetricLogger, step: int, epoch: int = 0) -> None:
    """Two micro-batches of 1 and 9 tokens whose token-weighted mean is 10 / step, lr 1e-4 x step; then end_step."""
    loss = 10.0 / step
    record_step(logger, [(loss + 1.0, 1), (loss - 1.0 / 9, 9)], lr=1e-4 * step)
    logger.end_step(step, epoch)


def jsonl(output_dir: Path, drop: tuple[str, ...] = ()) -> list[dict]:
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in drop} for row in rows]
