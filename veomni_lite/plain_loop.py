"""Exact loss normalization for a training loop of your own, in three lines.

    for batch, scale in normalized(micro_batches, modes="token-mean"):
        outputs = model(**batch)                      # each "<name>_loss" (or the tensor) = the local mean
        scale(outputs).backward()                     # the micro-batch's share of the step's exact global value

`normalized` marks the sequences for a per-sequence mode (`mark_sequences`), counts the step once
(`count_loss_token`) and yields each micro-batch with a `scale` that returns the sum of its `mean_global_loss`
values: one all-reduce for the step (at its first `scale`), none for the others, under `torchrun` over every rank.
Give it the step's micro-batches whole; under Ulysses SP, slice them after marking (`slice_micro_batch`) and pass
`marked=True`. `scale` takes a loss tensor (the `foundation` head), a `{"<name>_loss": tensor}` dict, or a model
output with a `.loss` (a transformers `ModelOutput`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from veomni_lite.utils.loss_utils import LossModes, count_loss_token, mark_sequences, mean_global_loss

__all__ = ["normalized"]


def _losses(outputs: Any) -> torch.Tensor | Mapping[str, torch.Tensor]:
    """The losses of `outputs`: a tensor, an output's `.loss`, or a dict's `<name>_loss` entries."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    found = (
        {k: v for k, v in outputs.items() if isinstance(k, str) and k.endswith("_loss")}
        if isinstance(outputs, Mapping)
        else {}
    )
    if not found:
        raise TypeError(f"scale: {type(outputs).__name__} is not a loss tensor, a loss dict or an output with .loss")
    return found


def normalized(
    micro_batches: Sequence[Mapping[str, Any]], modes: LossModes | str | None = None, marked: bool = False
) -> Iterator[tuple[dict[str, Any], Callable[[Any], torch.Tensor]]]:
    """(micro-batch, scale) per micro-batch of one optimizer step (see the module docstring)."""
    modes = LossModes.of(modes)
    batches = [dict(b) if marked or not modes.needs_sequences() else mark_sequences(b, modes) for b in micro_batches]
    step_tokens = count_loss_token(batches)
    for batch in batches:
        tokens = count_loss_token(batch)

        def scale(outputs: Any, tokens: dict[str, torch.Tensor] = tokens) -> torch.Tensor:
            return sum(mean_global_loss(_losses(outputs), tokens, step_tokens, modes=modes).values())

        yield batch, scale
