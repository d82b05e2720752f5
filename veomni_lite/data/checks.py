"""Host-side checks of a micro-batch before it reaches the model or any collective.

The loader produces CPU tensors, so these reads cost no device sync. Errors name the key and the bad value; the
trainer adds the rank and step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from veomni_lite.loss_keys import IGNORE_INDEX, is_labels_key, labels_key, name_of_loss

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A micro-batch that violates the data contract."""


def data_problem(exc: Exception, where: str = "") -> Exception | str:
    """What a rank gives `collectives.agree` for an exception met preparing data (reading, collating, sharding) that
    only this rank may meet: a DataError as it is; any other as "Type: message", its traceback logged here first
    (`where` leads the log line), since the error every rank raises carries only the message."""
    if isinstance(exc, DataError):
        return exc
    logger.error("%spreparing micro-batches failed", where, exc_info=exc)
    return f"{type(exc).__name__}: {exc}"


def validate_micro_batch(
    micro_batch: Mapping[str, Any],
    vocab_size: int,
    loss_keys: tuple[str, ...],
    label_limits: Mapping[str, int] | None = None,
    where: str = "micro-batch",
) -> None:
    """Raise DataError for a missing key, a wrong dtype/shape, or an id/label outside its range.

    `label_limits` maps a labels key to its number of classes (default: `labels` -> vocab_size).
    """
    limits = {"labels": vocab_size, **(label_limits or {})}
    required = ["input_ids", "position_ids", *(labels_key(name_of_loss(key)) for key in loss_keys)]
    missing = [key for key in required if key not in micro_batch]
    if missing:
        raise DataError(f"{where}: missing key(s) {missing}; has {sorted(micro_batch)}")
    input_ids = micro_batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise DataError(f"{where}: 'input_ids' must be a 2-D [batch, seq] tensor, got {_describe(input_ids)}")
    for key, value in micro_batch.items():
        if key not in ("input_ids", "position_ids") and not is_labels_key(key):
            continue
        if not isinstance(value, torch.Tensor):
            raise DataError(f"{where}: {key!r} must be a tensor, got {type(value).__name__}")
        if value.dtype not in (torch.int64, torch.int32):
            raise DataError(f"{where}: {key!r} must be an integer tensor (int64), got dtype {value.dtype}")
        if value.shape[:2] != input_ids.shape or (key != "position_ids" and value.dim() != 2):
            raise DataError(
                f"{where}: {key!r} has shape {tuple(value.shape)}, 'input_ids' has {tuple(input_ids.shape)}"
            )
    if input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise DataError(f"{where}: 'input_ids' holds {bad}, outside the vocabulary [0, {vocab_size})")
    for key, limit in limits.items():
        labels = micro_batch.get(key)
        if labels is None:
            continue
        valid = labels[labels != IGNORE_INDEX]
        if valid.numel():
            low, high = int(valid.min()), int(valid.max())
            if low < 0 or high >= limit:
                bad = low if low < 0 else high
                raise DataError(
                    f"{where}: {key!r} holds {bad}, outside [0, {limit}) (and not IGNORE_INDEX={IGNORE_INDEX})"
                )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
