"""Exact loss normalization inside the Hugging Face `Trainer` (and TRL's `SFTTrainer`), in one line:

    from veomni_lite.integrations.hf import ExactLossTrainer as Trainer    # transformers.Trainer, exact
    SFTTrainer = exact_loss(trl.SFTTrainer)                                  # any Trainer subclass, exact

Each optimizer step then trains on each head's exact global value (`loss_modes=`, token-mean by default; any mode
of `veomni_lite.utils.loss_utils`) over all the step's micro-batches on every rank, for any model: those that
declare `accepts_loss_kwargs = False` (Qwen2-VL and most vision-language models, which the stock Trainer averages
micro-batch means for), models whose forward drops `num_items_in_batch`, and extra heads (`<name>_labels`).

- `get_batch_samples` (the Trainer's prefetch of the step's micro-batches) shifts `labels` once (a collator's
  `shift_labels` is taken as given), masks the targets that would cross from one sequence into the next
  (`sequence_ids`, or restarts of 2-D `position_ids` as padding-free collators write), marks sequences for the
  per-sequence modes and counts the step (`count_loss_token`). The step's count dict goes to `compute_loss` as
  `num_items_in_batch`, so the Trainer's own count and its all-gather never run.
- `compute_loss` while training: the `foundation` head is next-token cross-entropy over `outputs.logits` (float32),
  this rank's mean over the micro-batch; every other head is the model's own `<name>_loss` output (its mean over the
  `<name>_labels` it was given, which reach the model unchanged). Each is scaled by `mean_global_loss`: ONE
  all-reduce per step (at its first micro-batch), none after. Evaluation keeps the Trainer's own `compute_loss`.
- The logged `loss` is then the step's exact value (the Trainer sums the scaled losses and averages over ranks).

Host reads on an accelerator: `verify_loss_keys()` once per step, after the first micro-batch (the Trainer's default
NaN filter reads every micro-batch's loss anyway); per-sequence modes read the sequence sizes (`mark_sequences`).
Limits, raised at construction: data parallelism only (DDP or FSDP; tensor, context and sequence parallel sizes 1),
no label smoothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Trainer

from veomni_lite.loss_keys import FOUNDATION, IGNORE_INDEX, SEQUENCE_IDS, loss_key, loss_weights_key, name_of_labels
from veomni_lite.models.heads import masked_mean_cross_entropy
from veomni_lite.utils.loss_utils import (
    LossModes,
    count_loss_token,
    mark_sequences,
    mean_global_loss,
    verify_loss_keys,
)

__all__ = ["ExactLossMixin", "ExactLossTrainer", "exact_loss", "prepare_micro_batch"]

_TOKENS = "veomni_micro_batch_tokens"  # each prepared micro-batch's own counts, popped before the forward


def _sequence_ids(batch: Mapping[str, Any], labels: torch.Tensor) -> torch.Tensor | None:
    """`sequence_ids`, else one sequence per run of 2-D `position_ids` that restarts at 0, else None."""
    if SEQUENCE_IDS in batch:
        return batch[SEQUENCE_IDS]
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.shape == labels.shape:
        return (positions == 0).cumsum(-1) - 1
    return None


def prepare_micro_batch(batch: Mapping[str, Any], modes: LossModes) -> dict[str, Any]:
    """One collated Trainer micro-batch in the loss core's form: `labels` shifted to next-token targets (a
    `shift_labels` key taken as given), targets across a sequence boundary masked, sequences marked for `modes`."""
    out = dict(batch)
    if "shift_labels" in out:
        out["labels"] = out.pop("shift_labels")
    elif "labels" in out:
        out["labels"] = F.pad(out["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)
    if "labels" in out:
        ids = _sequence_ids(out, out["labels"])
        if ids is not None:
            crosses = F.pad(ids[..., 1:] != ids[..., :-1], (0, 1), value=True)
            out["labels"] = out["labels"].masked_fill(crosses, IGNORE_INDEX)
            out.setdefault(SEQUENCE_IDS, ids)
    return mark_sequences(out, modes) if modes.needs_sequences() else out


class ExactLossMixin:
    """Put it before a `transformers.Trainer` class in the bases (see the module docstring); `loss_modes=` is the
    one keyword it adds."""

    loss_is_scaled_for_ga = True  # the Trainer must not divide by the accumulation steps again

    def __init__(self, *args: Any, loss_modes: LossModes | str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_modes = LossModes.of(loss_modes)
        if self.args.label_smoothing_factor:
            raise ValueError("exact loss: label_smoothing_factor is not supported (set it to 0)")
        sizes = {"tensor": self.get_tp_size(), "context": self.get_cp_size(), "sequence": self.get_sp_size()}
        if any(size > 1 for size in sizes.values()):
            raise ValueError(f"exact loss: data parallelism only; parallel sizes {sizes}")

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
        """The step's micro-batches, prepared and each carrying its counts, and the step's count dict."""
        batches = [prepare_micro_batch(b, self.loss_modes) for b in itertools.islice(epoch_iterator, num_batches)]
        step_tokens = count_loss_token(batches)
        for batch in batches:
            batch[_TOKENS] = count_loss_token(batch)
        return batches, step_tokens

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if _TOKENS not in inputs:  # evaluation, or a batch that did not come through get_batch_samples
            return super().compute_loss(model, inputs, return_outputs=return_outputs)
        inputs = dict(inputs)
        tokens = inputs.pop(_TOKENS)
        labels = inputs.pop("labels", None)
        weights = inputs.pop(loss_weights_key(FOUNDATION), None)
        for key in [k for k in inputs if k == SEQUENCE_IDS or k.endswith("_seq_starts")]:
            del inputs[key]
        if getattr(getattr(self.accelerator.unwrap_model(model), "config", None), "use_cache", None) is not None:
            inputs["use_cache"] = False  # a cache would also turn off transformers' packed-sequence detection
        outputs = model(**inputs)
        losses = {}
        for key in inputs:
            name = name_of_labels(key)
            if name is not None:
                if loss_key(name) not in outputs:
                    raise KeyError(f"exact loss: the batch has {key!r} but the model returned no {loss_key(name)!r}")
                losses[loss_key(name)] = outputs[loss_key(name)]
        if labels is not None:
            losses[loss_key(FOUNDATION)] = masked_mean_cross_entropy(outputs["logits"], labels, weights)
        loss = sum(mean_global_loss(losses, tokens, num_items_in_batch, modes=self.loss_modes).values())
        return (loss, outputs) if return_outputs else loss

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        verify_loss_keys()  # no-op on CPU and after the step's first micro-batch
        return loss


class ExactLossTrainer(ExactLossMixin, Trainer):
    """`transformers.Trainer` training on the exact global value of each loss head (see the module docstring)."""


def exact_loss(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` (a `transformers.Trainer` subclass, e.g. TRL's `SFTTrainer`) with `ExactLossMixin` first."""
    return type(f"Exact{trainer_class.__name__}", (ExactLossMixin, trainer_class), {})
