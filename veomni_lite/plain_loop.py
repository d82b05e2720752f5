"""The one call sequence of an optimizer step's loss normalization, and a loop of your own in three lines.

    for batch, scale in normalized(micro_batches, modes="token-mean"):
        outputs = model(**batch)                      # each "<name>_loss" (or the tensor) = the local mean
        scale(outputs).backward()                     # the micro-batch's share of the step's exact global value

`LossStep` is the sequence every loop here runs (the trainer, the HF drop-in, the split-invariance harness, the GPU
audit and `normalized`): mark the sequences for a per-sequence mode (`mark_sequences`, on whole micro-batches), count
the step once (`count_loss_token`), count each micro-batch, scale each micro-batch's losses with `mean_global_loss`
(one all-reduce for the step, at the first scale; none after), then `verify` the ranks' key agreement where the step
reads the host anyway. Under Ulysses SP, mark the whole micro-batches, slice them (`slice_micro_batch`) and pass
`marked=True`. A loss is a tensor (the `foundation` head), a `{"<name>_loss": tensor}` dict, or a model output with a
`.loss` (a transformers `ModelOutput`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from veomni_lite.utils.loss_utils import (
    STEP_SLOTS,
    LossMemo,
    LossModes,
    count_loss_token,
    mark_sequences,
    mean_global_loss,
    step_slots,
)

__all__ = ["LossStep", "normalized"]


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


class LossStep:
    """One optimizer step's micro-batches, marked and counted once: iterate `(micro_batch, its counts)`, scale each
    micro-batch's losses with `scaled`/`loss`, then call `verify` once.

    `extra_counts`: counts every micro-batch adds besides its labels' (e.g. `{"router_aux_tokens": 1}` for a head
    averaged over micro-batches), or a function of the micro-batch giving them (the MoE router heads' counts); the
    step's count of such a key is its sum over the micro-batches. `slots`: a 1-D int64 vector summed over the world in
    the step's one all-reduce (`STEP_SLOTS`; read with `step_slots`)."""

    def __init__(
        self,
        micro_batches: Sequence[Mapping[str, Any]],
        modes: LossModes | str | None = None,
        *,
        marked: bool = False,
        extra_counts: Mapping[str, Any] | Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
        slots: torch.Tensor | None = None,
    ) -> None:
        self.modes = LossModes.of(modes)
        mark = not marked and self.modes.needs_sequences()
        self.micro_batches = [mark_sequences(b, self.modes) if mark else dict(b) for b in micro_batches]
        extra = [dict(extra_counts(b) if callable(extra_counts) else extra_counts or {}) for b in self.micro_batches]
        self.micro_tokens: list[dict[str, Any]] = [
            {**count_loss_token(b), **e} for b, e in zip(self.micro_batches, extra)
        ]
        # The step's count dict: `mean_global_loss` reduces it once, keyed by its identity (build one per step).
        self.tokens: dict[str, Any] = count_loss_token(self.micro_batches)
        for counts in extra:
            for key, value in counts.items():
                self.tokens[key] = self.tokens[key] + value if key in self.tokens else value
        if slots is not None:
            self.tokens[STEP_SLOTS] = slots
        self.memo = LossMemo()

    def __iter__(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        return zip(self.micro_batches, self.micro_tokens)

    def __len__(self) -> int:
        return len(self.micro_batches)

    def scaled(self, outputs: Any, tokens: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Each loss of `outputs` scaled to its share of the step's exact global value (`mean_global_loss`), given the
        micro-batch's counts `tokens`."""
        return mean_global_loss(_losses(outputs), tokens, self.tokens, modes=self.modes, memo=self.memo)

    def loss(self, outputs: Any, tokens: Mapping[str, Any]) -> torch.Tensor:
        """The sum of `scaled`: what the micro-batch backpropagates."""
        return sum(self.scaled(outputs, tokens).values())

    def step_slots(self, loss_keys: tuple[str, ...]) -> torch.Tensor:
        """The step's `slots` summed over the world, from its one all-reduce (made now, with the head names of
        `loss_keys`, if no micro-batch has been scaled yet)."""
        return step_slots(loss_keys, self.tokens, self.modes, memo=self.memo)

    def verify(self) -> None:
        """The ranks' loss-key agreement: a host read on an accelerator, so call it once per step where the step reads
        the host anyway; a no-op on CPU (checked at the reduce)."""
        self.memo.verify()


def normalized(
    micro_batches: Sequence[Mapping[str, Any]], modes: LossModes | str | None = None, marked: bool = False
) -> Iterator[tuple[dict[str, Any], Callable[[Any], torch.Tensor]]]:
    """(micro-batch, scale) per micro-batch of one optimizer step (see the module docstring); the step's key agreement
    is verified after the last micro-batch."""
    step = LossStep(micro_batches, modes, marked=marked)
    for batch, tokens in step:

        def scale(outputs: Any, tokens: dict[str, Any] = tokens) -> torch.Tensor:
            return step.loss(outputs, tokens)

        yield batch, scale
    step.verify()
