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
from veomni_lite.metrics import MetricAccumulator, MetricSpec
from veomni_lite.utils.loss_utils import mean_global_loss

__all__ = [
    "LOSS_STRATEGIES",
    "METRIC_STRATEGIES",
    "EagerMetrics",
    "LogTimeMetrics",
    "LossStrategy",
    "MetricStrategy",
    "PerMicroBatchDenominator",
    "StepStartDenominator",
    "VeOmniLite",
    "sp_reduce_loss",
]


# ---------------------------------------------------------------------------------------------- loss normalization


class LossStrategy(Protocol):
    key: str
    label: str

    def start_step(self, step_token_len: Mapping[str, torch.Tensor]) -> None: ...

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

    def start_step(self, step_token_len: Mapping[str, torch.Tensor]) -> None:
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

    def start_step(self, step_token_len: Mapping[str, torch.Tensor]) -> None:
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

    def start_step(self, step_token_len: Mapping[str, torch.Tensor]) -> None:
        pass

    def scale(
        self,
        losses: Mapping[str, torch.Tensor],
        micro_token_len: Mapping[str, torch.Tensor],
        step_token_len: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        return mean_global_loss(losses, micro_token_len, step_token_len)


LOSS_STRATEGIES: tuple[type[LossStrategy], ...] = (PerMicroBatchDenominator, StepStartDenominator, VeOmniLite)


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
