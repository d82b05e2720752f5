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
  per-sequence modes and counts the step once (its `LossStep`, the micro-batches counted for the router loss). The
  step's count dict goes to `compute_loss` as `num_items_in_batch`, so the Trainer's own count never runs.
- `compute_loss` while training, the terms the wrapped Trainer trains on, each normalized over the whole step:
  - `foundation`: the per-token next-token loss from `foundation_token_losses` (the seam for another LM head):
    cross-entropy over `outputs.logits` (float32 or float64, chunked); under TRL's `SFTTrainer`, TRL's fused LM head
    (no logits built) with its `loss_type` (`nll`, `dft`); this rank's mean over the micro-batch, in its mode.
  - `<name>`: the model's own `<name>_loss` output, its mean over the `<name>_labels` it was given (unchanged).
  - `router_aux`: a Mixture-of-Experts model's load-balancing loss (`outputs.aux_loss`, transformers'
    `load_balancing_loss_func`, which the model computes per forward, i.e. per micro-batch, when it returns router
    logits) times its coefficient (the model's `router_aux_loss_coef`; TRL's resolved `router_aux_loss_coef`),
    averaged over every micro-batch of the step on every rank (the count is the micro-batches, in the step's one
    all-reduce). That equals one process running the same micro-batches with accumulation; it is not the loss of
    one forward over the concatenated global batch, which transformers' definition (a product of per-forward
    routing averages) makes a different number. The stock Trainer sums it over the micro-batches and ranks
    (GA x world times the mean); TRL averages it, as here.
  - `compute_loss_func=`: called as the stock Trainer calls it, `(outputs, labels, num_items_in_batch=N)`, with N
    the step's global count of next-token targets (an int64 tensor) and `labels` in the collator's (unshifted)
    layout, their shift being exactly the targets counted; its value (sum over the micro-batch's targets / N, as
    transformers' `ForCausalLMLoss` returns) replaces the foundation head and, as in the stock Trainer, the
    model's router loss. It needs the token-mean mode for the foundation head.
  Each is scaled by `mean_global_loss`: ONE all-reduce per step (at its first micro-batch), none after. Evaluation
  keeps the Trainer's own `compute_loss`.
- TRL's `SFTTrainer`: the metrics it logs from its `compute_loss` (`entropy`, `mean_token_accuracy`, `num_tokens`,
  `aux_loss`) are logged as TRL computes them (same values for the same batch and parameters).
- The logged `loss` is then the step's exact value (the Trainer sums the scaled losses and averages over ranks).

Not seen: a term a model adds to its own `loss` beyond the above (the model is called without `labels`).
Host reads on an accelerator: the step's `LossStep.verify()` once per step, after the first micro-batch (the
Trainer's default NaN filter reads every micro-batch's loss anyway); per-sequence modes read the sequence sizes
(`mark_sequences`); TRL's metrics read theirs per micro-batch, as in TRL.
Limits, raised at construction: data parallelism only (DDP or FSDP; accelerate's tensor, context and sequence
parallel sizes 1), no label smoothing, `compute_loss_func` only with a token-mean foundation head, of TRL only the
`SFTTrainer` with `loss_type` `nll` or `dft`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Trainer

from veomni_lite.distributed.collectives import group_size
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.loss_keys import (
    FOUNDATION,
    IGNORE_INDEX,
    SEQUENCE_IDS,
    loss_key,
    loss_weights_key,
    name_of_labels,
    name_of_loss,
    tokens_key,
)
from veomni_lite.models.heads import token_cross_entropy
from veomni_lite.models.moe import ROUTER_AUX  # the MoE load-balancing head; here its count is the micro-batches
from veomni_lite.plain_loop import LossStep
from veomni_lite.utils.loss_utils import LossModes, mark_sequences

__all__ = ["ROUTER_AUX", "TRL_LOSS_TYPES", "ExactLossMixin", "ExactLossTrainer", "exact_loss", "prepare_micro_batch"]

_TOKENS = "veomni_micro_batch_tokens"  # each prepared micro-batch's own counts, popped before the forward
TRL_LOSS_TYPES = ("nll", "dft")  # TRL's SFTConfig.loss_type values computed here (per-token, then normalized)


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


def _trl_classes(trainer: Any) -> list[str]:
    return [c.__name__ for c in type(trainer).__mro__ if c.__module__.startswith("trl.")]


def _output(outputs: Any, key: str) -> Any:
    return outputs.get(key) if isinstance(outputs, Mapping) else None


class ExactLossMixin:
    """Put it before a `transformers.Trainer` class in the bases (see the module docstring); `loss_modes=` is the
    one keyword it adds."""

    loss_is_scaled_for_ga = True  # the Trainer must not divide by the accumulation steps again

    def __init__(self, *args: Any, loss_modes: LossModes | str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_modes = LossModes.of(loss_modes)
        # The router head is a mean over micro-batches whatever the modes of the token heads.
        per_head = {**self.loss_modes.per_head, ROUTER_AUX: "token-mean"}
        self._modes = LossModes(self.loss_modes.default, per_head, self.loss_modes.scale_factor)
        if self.args.label_smoothing_factor:
            raise ValueError("exact loss: label_smoothing_factor is not supported (set it to 0)")
        sizes = {"tensor": self.get_tp_size(), "context": self.get_cp_size(), "sequence": self.get_sp_size()}
        if any(size > 1 for size in sizes.values()):
            raise ValueError(
                f"exact loss: data parallelism only (DDP or FSDP); accelerate's parallel sizes are {sizes}: its "
                "context parallelism and DeepSpeed Ulysses shard the sequence after the step is counted, and tensor "
                "parallel ranks share a batch. For Ulysses sequence parallelism use veomni_lite's own trainer "
                "(`parallel.sp_size`)."
            )
        if self.compute_loss_func is not None and self.loss_modes.mode(FOUNDATION) != "token-mean":
            raise ValueError(
                f"exact loss: compute_loss_func divides by a token count (num_items_in_batch), so it cannot be exact "
                f"in loss mode {self.loss_modes.mode(FOUNDATION)!r}; use loss_modes='token-mean' or drop the function"
            )
        trl = _trl_classes(self)
        if trl and "SFTTrainer" not in trl:  # DPO, GRPO, ...: their loss is not a next-token loss over `labels`
            raise ValueError(f"exact loss: of TRL's trainers only SFTTrainer is supported, not {trl[0]}")
        self._trl = bool(trl)
        if self._trl:
            loss_type = getattr(self.args, "loss_type", "nll")
            if loss_type not in TRL_LOSS_TYPES:
                raise ValueError(
                    f"exact loss: SFTConfig.loss_type={loss_type!r} is not supported; supported: {list(TRL_LOSS_TYPES)}"
                )
            self._router_coef = float(getattr(self, "router_aux_loss_coef", 0.0) or 0.0)
        else:
            unwrapped = self.accelerator.unwrap_model(self.model)
            coef = getattr(unwrapped, "router_aux_loss_coef", None)
            config = getattr(unwrapped, "config", None)
            if coef is None and config is not None:
                coef = getattr(config.get_text_config(), "router_aux_loss_coef", None)
            self._router_coef = float(coef or 0.0)

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The step's micro-batches, prepared and each carrying its counts, and the step's count dict."""
        raw = list(itertools.islice(epoch_iterator, num_batches))
        if self.compute_loss_func is not None and any("shift_labels" in b for b in raw):
            raise ValueError(
                "exact loss: compute_loss_func takes `labels`, but the collator writes `shift_labels` (whose "
                "targets the function would not see); collate `labels` only"
            )
        step = LossStep(
            [prepare_micro_batch(b, self.loss_modes) for b in raw],
            self._modes,
            marked=True,
            extra_counts={tokens_key(ROUTER_AUX): 1},
        )
        self._loss_step = step
        for batch, tokens in step:
            batch[_TOKENS] = tokens
        return step.micro_batches, step.tokens

    def foundation_token_losses(
        self, model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor | None
    ) -> tuple[Any, torch.Tensor | None]:
        """The model's outputs and the foundation head's per-token loss at the next-token `labels` (shape of
        `labels`, 0 where IGNORE_INDEX), or None without labels or when `compute_loss_func` gives the loss.

        The seam for another LM head (a fused linear cross-entropy): return the per-token loss without the logits.
        Default: the model's forward and cross-entropy over `outputs.logits`; TRL's SFTTrainer: TRL's fused head.
        """
        if self._trl and labels is not None:
            return self._trl_token_losses(model, inputs, labels)
        outputs = model(**inputs)
        if labels is None or self.compute_loss_func is not None:
            return outputs, None
        return outputs, token_cross_entropy(outputs["logits"], labels).view_as(labels)

    def _trl_token_losses(
        self, model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor
    ) -> tuple[Any, torch.Tensor | None]:
        """TRL's `SFTTrainer.compute_loss` (TRL 1.16) on our targets: its fused LM head scores `shift_labels`
        without building the logits; the per-token loss of its `loss_type`; its metrics logged."""
        if getattr(self, "aux_loss_enabled", False):
            inputs = {**inputs, "output_router_logits": True}
        if self.compute_loss_func is not None:  # TRL: the function gets the full logits, the metrics a fused pass
            outputs = model(**inputs)
            with torch.no_grad():
                self._log_trl_metrics(model(**inputs, shift_labels=labels, fused_lm_head=True), inputs)
            return outputs, None
        outputs = model(**inputs, shift_labels=labels, fused_lm_head=True)
        per_token = -outputs.log_probs  # 0 at ignored targets
        if self.args.loss_type == "dft":  # DFT: https://huggingface.co/papers/2508.05629
            per_token = per_token * outputs.log_probs.exp().detach()
        self._log_trl_metrics(outputs, inputs)
        return outputs, per_token

    def _log_trl_metrics(self, outputs: Any, inputs: Mapping[str, Any]) -> None:
        """TRL 1.16's `SFTTrainer.compute_loss` metrics, as it computes them (training)."""
        metrics, gather = self._metrics["train"], self.accelerator.gather_for_metrics
        num_valid = gather(outputs.label_mask.sum()).sum()
        entropy_sum = gather(outputs.entropy.detach().sum()).sum()
        num_correct = gather(outputs.is_top1.sum()).sum()
        metrics["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        metrics["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        if "attention_mask" in inputs:
            num_tokens = gather(inputs["attention_mask"].sum()).sum().item()
        elif "position_ids" in inputs:
            positions = inputs["position_ids"]
            num_tokens = gather(torch.tensor(positions.size(1), device=positions.device)).sum().item()
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        self._total_train_tokens += num_tokens // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        if getattr(self, "aux_loss_enabled", False):
            metrics["aux_loss"].append(gather(outputs.aux_loss).mean().item())

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
        outputs, per_token = self.foundation_token_losses(model, inputs, labels)
        losses = {}
        for key in inputs:
            name = name_of_labels(key)
            if name is not None:
                if _output(outputs, loss_key(name)) is None:
                    raise KeyError(f"exact loss: the batch has {key!r} but the model returned no {loss_key(name)!r}")
                losses[loss_key(name)] = outputs[loss_key(name)]
        if per_token is not None:
            if weights is not None:
                per_token = per_token * weights.to(per_token.dtype)
            losses[loss_key(FOUNDATION)] = per_token.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)
        aux = _output(outputs, "aux_loss")
        if isinstance(aux, torch.Tensor) and self._router_coef and self.compute_loss_func is None:
            losses[loss_key(ROUTER_AUX)] = self._router_coef * aux
        if self.compute_loss_func is not None and labels is not None:
            value, tokens = self._loss_func_term(outputs, labels, losses, tokens)
            losses[loss_key(FOUNDATION)] = value
        loss = self._loss_step.loss(losses, tokens)
        return (loss, outputs) if return_outputs else loss

    def _loss_func_term(
        self,
        outputs: Any,
        labels: torch.Tensor,
        losses: Mapping[str, torch.Tensor],
        tokens: Mapping[str, Any],
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """`compute_loss_func`'s value with the step's global count N, and the micro-batch counts that make
        `mean_global_loss` scale it by the world size only (it is already / N)."""
        names = sorted({FOUNDATION, *map(name_of_loss, losses)})
        one = torch.ones((), dtype=torch.float64, device=labels.device)
        # W / D per head from the step's one all-reduce (memoized: the call with the real losses reuses it).
        unit = self._loss_step.scaled({loss_key(n): one for n in names}, {tokens_key(n): 1 for n in names})
        world = group_size(get_parallel_state().world_group)
        count = (world / unit[loss_key(FOUNDATION)]).round().long()
        unshifted = F.pad(labels[..., :-1], (1, 0), value=IGNORE_INDEX)  # its causal shift: exactly `labels`
        value = self.compute_loss_func(outputs, unshifted, num_items_in_batch=count)
        return value, {**tokens, tokens_key(FOUNDATION): count}

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self._loss_step.verify()  # no-op on CPU and after the step's first micro-batch
        return loss


class ExactLossTrainer(ExactLossMixin, Trainer):
    """`transformers.Trainer` training on the exact global value of each loss head (see the module docstring)."""


def exact_loss(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` (a `transformers.Trainer` subclass, e.g. TRL's `SFTTrainer`) with `ExactLossMixin` first."""
    return type(f"Exact{trainer_class.__name__}", (ExactLossMixin, trainer_class), {})
