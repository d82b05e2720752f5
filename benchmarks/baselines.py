"""The loss-normalization and metric schemes veomni_lite is compared with: small re-implementations, benchmarks only.

These are NOT VeOmni's code. Each class re-implements, in a few lines and on top of veomni_lite's own helpers, the
communication pattern of a published scheme, and computes the same gradients as veomni_lite (the benchmark asserts
it on its first step), so the comparison is at equal correctness.

Loss normalization (every strategy returns, per loss key, the tensor to sum and backpropagate):
- `PerMicroBatchDenominator` (a): VeOmni's `mean_global_loss` before the step denominators were reused: on EVERY
  micro-batch and for every loss key, the step's token count is read to the host (`.item()`) and all-reduced over
  the world; under SP, the model's loss is also SP-reduced (VeOmni's `ReduceLoss`: two SP all-reduces, loss x count
  and count) and the micro-batch count is all-reduced over the SP group after a host read.
- `StepStartDenominator` (b): VeOmni 0.1.12: ONE all-reduce per token key of the step dict at step start
  (`reduce_global_loss_token`, a host read before and after each), then per micro-batch only the SP reductions of
  (a) (none without SP).
- `VeOmniLite` (c): `veomni_lite.utils.loss_utils.mean_global_loss` (one packed all-reduce per step, memoized).
- `HFTrainerScheme` (d): the Hugging Face Trainer's `average_tokens_across_devices`: once per step the `labels`
  count is all-gathered over the world and read to the host (`.item()`); each micro-batch's `foundation_loss`
  becomes its token sum / that count x world size. It has a global count for `labels` only: any other head stays a
  micro-batch mean (here divided by GA, the mean of micro-batch means), which is NOT the global token mean, so (d)
  is equal-gradient on the foundation head only (`global_heads`) and is checked there only.
- `Oracle` (o): the floor (torchtitan's scheme for one label key): ONE device all-reduce of the step's counts, no
  host read, no key check, then `loss * n * W / T`. On the VLM step it all-reduces the step's counts of every loss
  key in one buffer (equal gradients); for the loss path alone (`path_count`) it is exactly one bare 1-element
  all-reduce of the step's `labels` count and no scaling work at all: a lower bound, not a scheme to check.

Every strategy gets `start_step(step_token_len, grad_accum)` once per step, then `scale(...)` per micro-batch.

Metrics (what a trainer does with per-micro-batch and per-step values it logs):
- `EagerMetrics` (a): every record is reduced at once: one all-reduce and one host read per metric per record.
- `LogTimeMetrics` (b): veomni_lite's `MetricAccumulator`: local records, two packed all-reduces per log event.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from veomni_lite.distributed.collectives import all_reduce
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.metrics import MetricAccumulator, MetricSpec
from veomni_lite.utils.loss_utils import mean_global_loss

__all__ = [
    "LOSS_STRATEGIES",
    "METRIC_STRATEGIES",
    "EagerMetrics",
    "HFTrainerScheme",
    "LogTimeMetrics",
    "LossStrategy",
    "MetricStrategy",
    "Oracle",
    "PerMicroBatchDenominator",
    "StepStartDenominator",
    "VeOmniLite",
    "sp_reduce_loss",
]


# ---------------------------------------------------------------------------------------------- loss normalization


def _all_gather_tensor(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """accelerate's `gather` of a tensor: all_gather_into_tensor (named all_gather_single in newer torch), looked
    up at call time so the benchmark's counter sees it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


class LossStrategy(Protocol):
    key: str
    label: str

    def start_step(self, step_token_len: Mapping[str, torch.Tensor], grad_accum: int) -> None: ...

    def scale(
        self,
        losses: Mapping[str, torch.Tensor],
        micro_token_len: Mapping[str, torch.Tensor],
        step_token_len: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]: ...


class _SPReduceLoss(torch.autograd.Function):
    """Models VeOmni's sequence-parallel `ReduceLoss`: the SP group's token-weighted mean of the local means.

    Forward: two all-reduces over the SP group (loss x count, count). Backward: `sp_size * n_local / N_sp`, the
    variant that pairs with the `/ sp_size` of `mean_global_loss`, so the product is the exact global-token-mean
    gradient `n_local / T * W`, the one veomni_lite computes.
    """

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, count: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        local_count = count.detach().to(loss.dtype)
        weighted = torch.where(count > 0, loss.detach(), torch.zeros_like(loss)) * local_count
        total_count = local_count.clone()
        dist.all_reduce(weighted, group=group)
        dist.all_reduce(total_count, group=group)
        ctx.save_for_backward(local_count, total_count)
        ctx.sp_size = dist.get_world_size(group)
        return weighted / total_count.clamp(min=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        local_count, total_count = ctx.saved_tensors
        return grad * ctx.sp_size * local_count / total_count.clamp(min=1), None, None


def sp_reduce_loss(loss: torch.Tensor, count: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The SP-group token mean of `loss` (this rank's local mean over `count` tokens); see `_SPReduceLoss`."""
    return _SPReduceLoss.apply(loss, count, group)


def _veomni_scale(
    losses: Mapping[str, torch.Tensor],
    micro_token_len: Mapping[str, torch.Tensor],
    step_denominator: Mapping[str, int | float] | None,
    step_token_len: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """VeOmni's per-micro-batch path; `step_denominator=None` all-reduces the step count here (scheme (a))."""
    state = get_parallel_state()
    world = state.world_size
    scaled: dict[str, torch.Tensor] = {}
    for key, loss in losses.items():
        name = key[: -len("_loss")]
        tokens = micro_token_len[f"{name}_tokens"]
        if state.sp_enabled:
            loss = sp_reduce_loss(loss, tokens, state.sp_group)
            tokens = all_reduce(tokens.item(), op="sum", group=state.sp_group)
        if step_denominator is None:
            total = all_reduce(step_token_len[f"{name}_tokens"].item(), op="sum")
        else:
            total = step_denominator[f"{name}_tokens"]
        if total != 0:
            loss = loss * tokens / total * world
        elif not torch.allclose(loss, torch.zeros_like(loss)):
            raise ValueError(f"{name}_tokens is 0 on every rank but the loss is {loss}")
        if state.sp_enabled:
            loss = loss / state.sp_size
        scaled[key] = loss
    return scaled


class PerMicroBatchDenominator:
    """(a) VeOmni before denominator reuse: the step denominator all-reduced (after a host read) per micro-batch."""

    key = "a"
    label = "(a) per-micro-batch denominator (VeOmni before reuse)"

    def start_step(self, step_token_len: Mapping[str, torch.Tensor], grad_accum: int) -> None:
        pass

    def scale(
        self,
        losses: Mapping[str, torch.Tensor],
        micro_token_len: Mapping[str, torch.Tensor],
        step_token_len: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        return _veomni_scale(losses, micro_token_len, None, step_token_len)


class StepStartDenominator:
    """(b) VeOmni 0.1.12: one all-reduce per token key at step start; under SP, per-micro-batch SP reduces."""

    key = "b"
    label = "(b) step-start per-key reduce + SP reduces (VeOmni 0.1.12)"

    def __init__(self) -> None:
        self._denominator: dict[str, int | float] = {}

    def start_step(self, step_token_len: Mapping[str, torch.Tensor], grad_accum: int) -> None:
        self._denominator = {key: all_reduce(value.item(), op="sum") for key, value in step_token_len.items()}

    def scale(
        self,
        losses: Mapping[str, torch.Tensor],
        micro_token_len: Mapping[str, torch.Tensor],
        step_token_len: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        return _veomni_scale(losses, micro_token_len, self._denominator, step_token_len)


class VeOmniLite:
    """(c) veomni_lite: `mean_global_loss`, one packed all-reduce per step dict, no host read on the device path."""

    key = "c"
    label = "(c) veomni_lite"

    def start_step(self, step_token_len: Mapping[str, torch.Tensor], grad_accum: int) -> None:
        pass

    def scale(
        self,
        losses: Mapping[str, torch.Tensor],
        micro_token_len: Mapping[str, torch.Tensor],
        step_token_len: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        return mean_global_loss(losses, micro_token_len, step_token_len)


class HFTrainerScheme:
    """(d) HF Trainer: the step's `labels` count all-gathered and read to the host once per step; labels only."""

    key = "d"
    label = "(d) HF Trainer: all-gather of the labels count + host read per step (labels only)"
    global_heads = ("foundation_loss",)  # the heads it normalizes by a global count; the others are not comparable

    def __init__(self) -> None:
        self._total = 1
        self._grad_accum = 1
        self._world = 1

    def start_step(self, step_token_len: Mapping[str, torch.Tensor], grad_accum: int) -> None:
        count = step_token_len["foundation_tokens"].reshape(1)
        state = get_parallel_state()
        gathered = count
        if dist.is_initialized() and state.world_size > 1:
            gathered = count.new_empty(state.world_size)
            _all_gather_tensor(gathered, count, group=state.world_group)
        self._total = max(gathered.sum().item(), 1)  # the step's host read (`num_items_in_batch`)
        self._grad_accum = grad_accum
        self._world = state.world_size

    def scale(
        self,
        losses: Mapping[str, torch.Tensor],
        micro_token_len: Mapping[str, torch.Tensor],
        step_token_len: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        scaled = {}
        for key, loss in losses.items():
            if key == "foundation_loss":  # token sum / global count, times W (the gradient average divides by W)
                scaled[key] = loss * micro_token_len["foundation_tokens"] / self._total * self._world
            else:  # no global count for this head: the micro-batch mean, averaged over the step's micro-batches
                scaled[key] = loss / self._grad_accum
        return scaled


class Oracle:
    """(o) The floor: one device all-reduce of the step's counts, no host read, then `loss * n * W / T`."""

    key = "o"
    label = "(o) oracle: one device all-reduce of the step's counts, no host read (torchtitan)"

    def __init__(self) -> None:
        self._scales: dict[str, torch.Tensor] = {}

    def start_step(self, step_token_len: Mapping[str, torch.Tensor], grad_accum: int) -> None:
        names = sorted(step_token_len)
        totals = torch.stack([step_token_len[name] for name in names])
        if dist.is_initialized():
            dist.all_reduce(totals, group=get_parallel_state().world_group)
        scales = get_parallel_state().world_size / totals.clamp(min=1).double()
        self._scales = dict(zip(names, scales.unbind()))

    def scale(
        self,
        losses: Mapping[str, torch.Tensor],
        micro_token_len: Mapping[str, torch.Tensor],
        step_token_len: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        scaled = {}
        for key, loss in losses.items():
            tokens = key[: -len("_loss")] + "_tokens"
            factor = micro_token_len[tokens] * self._scales[tokens]
            scaled[key] = loss * factor.to(torch.promote_types(loss.dtype, torch.float32))
        return scaled

    @staticmethod
    def path_count(micro_batches: Iterable[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """The loss path alone: the step's `labels` count, then ONE bare 1-element all-reduce of it; nothing else."""
        labels = torch.cat([micro_batch["labels"].reshape(-1) for micro_batch in micro_batches])
        count = (labels != IGNORE_INDEX).sum().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(count)
        return count


LOSS_STRATEGIES: tuple[type[LossStrategy], ...] = (
    PerMicroBatchDenominator,
    StepStartDenominator,
    VeOmniLite,
    HFTrainerScheme,
    Oracle,
)


# --------------------------------------------------------------------------------------------------------- metrics


class MetricStrategy(Protocol):
    key: str
    label: str

    def record(self, name: str, value: float | torch.Tensor, count: float | torch.Tensor | None = None) -> None: ...

    def log(self) -> dict[str, float]: ...


class EagerMetrics:
    """(a) Every metric reduced over the world as it is recorded: one all-reduce and one host read per record.

    Host-side running totals give the same window values as `MetricAccumulator` (mean weighted by count, sum,
    min, max, `last` averaged over ranks; `sp_dedup` values only from sp_rank 0), so `log()` needs no collective.
    """

    key = "a"
    label = "(a) reduce every metric on every micro-batch"

    def __init__(self, specs: Iterable[MetricSpec], sp_rank: int = 0) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.sp_rank = sp_rank
        self._totals: dict[str, list[float]] = {}

    def record(self, name: str, value: float | torch.Tensor, count: float | torch.Tensor | None = None) -> None:
        spec = self.specs[name]
        value = torch.as_tensor(value, dtype=torch.float64).detach().reshape(())
        keep = 0.0 if spec.sp_dedup and self.sp_rank != 0 else 1.0
        if spec.reduce in ("min", "max"):
            reduced = all_reduce(value.reshape(1), op=spec.reduce).tolist()[0]
            slot = self._totals.setdefault(name, [math.inf if spec.reduce == "min" else -math.inf])
            slot[0] = min(slot[0], reduced) if spec.reduce == "min" else max(slot[0], reduced)
            return
        weight = torch.as_tensor(1.0 if count is None else count, dtype=torch.float64).reshape(())
        pair = torch.stack([value * weight * keep, weight * keep])
        total, reduced_weight = all_reduce(pair, op="sum").tolist()
        if spec.reduce == "last":
            self._totals[name] = [total, reduced_weight]
            return
        slot = self._totals.setdefault(name, [0.0, 0.0])
        slot[0] += total
        slot[1] += reduced_weight

    def log(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, spec in self.specs.items():
            slot = self._totals.get(name)
            if slot is None:
                continue
            if spec.reduce in ("min", "max"):
                out[name] = slot[0]
            elif slot[1] > 0:
                out[name] = slot[0] if spec.reduce == "sum" else slot[0] / slot[1]
        self._totals = {}
        return out


class LogTimeMetrics:
    """(b) veomni_lite: `MetricAccumulator.record` (local) and `reduce()` at log time (two packed all-reduces)."""

    key = "b"
    label = "(b) veomni_lite log-time reduction"

    def __init__(self, specs: Iterable[MetricSpec], sp_rank: int = 0) -> None:
        self.accumulator = MetricAccumulator(specs, sp_rank=sp_rank)

    def record(self, name: str, value: float | torch.Tensor, count: float | torch.Tensor | None = None) -> None:
        self.accumulator.record(name, value, count)

    def log(self) -> dict[str, float]:
        return self.accumulator.reduce()


METRIC_STRATEGIES: tuple[type[MetricStrategy], ...] = (EagerMetrics, LogTimeMetrics)
