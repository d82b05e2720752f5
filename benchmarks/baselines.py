"""The loss-normalization schemes veomni_lite's whole step is compared with: small re-implementations, bench only.

These are NOT the peers' code: each class re-implements, on top of veomni_lite's helpers, the communication pattern
of a published scheme and computes the same gradients as veomni_lite (the bench checks it before timing), so the
comparison is at equal correctness. Every strategy gets `start_step(step_token_len, grad_accum)` once per step,
then `scale(losses, micro_token_len, step_token_len)` per micro-batch (the tensors to sum and backpropagate).
- (a) `PerMicroBatchDenominator`: VeOmni before the step denominators were reused: on EVERY micro-batch and loss key
  the step's token count is read to the host and all-reduced; under SP the loss is SP-reduced (VeOmni's
  `ReduceLoss`: two SP all-reduces) and the micro-batch count SP-all-reduced after a host read.
- (b) `StepStartDenominator`: VeOmni 0.1.12: one all-reduce per token key at step start (a host read around each),
  per micro-batch only (a)'s SP reductions.
- (c) `VeOmniLite`: `veomni_lite.utils.loss_utils.mean_global_loss` (one packed all-reduce per step, memoized).
- (d) `HFTrainerScheme`: the HF Trainer's `average_tokens_across_devices`: the step's `labels` count all-gathered
  and read to the host once per step; any other head stays a micro-batch mean (not the global token mean), so (d)
  is equal-gradient on `foundation_loss` only (`global_heads`).
- (o) `Oracle`: the floor (torchtitan's scheme): one device all-reduce of the step's counts of every key, no host
  read, no key check, then `loss * n * W / T`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from veomni_lite.distributed.collectives import all_reduce
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.utils.loss_utils import mean_global_loss

Counts = Mapping[str, torch.Tensor]


def _all_gather_tensor(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """accelerate's `gather` of a tensor: all_gather_into_tensor (named all_gather_single in newer torch), looked
    up at call time so the benchmark's counter sees it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


class LossStrategy(Protocol):
    key: str
    label: str

    def start_step(self, step_token_len: Counts, grad_accum: int) -> None: ...

    def scale(self, losses: Counts, micro_token_len: Counts, step_token_len: Counts) -> dict[str, torch.Tensor]: ...


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


def _veomni_scale(losses: Counts, micro_token_len: Counts, denominator: Mapping | None, step_token_len: Counts) -> dict:
    """VeOmni's per-micro-batch path; `step_denominator=None` all-reduces the step count here (scheme (a))."""
    state = get_parallel_state()
    world = state.world_size
    scaled: dict[str, torch.Tensor] = {}
    for key, loss in losses.items():
        name = key[: -len("_loss")]
        tokens = micro_token_len[f"{name}_tokens"]
        if state.sp_enabled:
            loss = _SPReduceLoss.apply(loss, tokens, state.sp_group)
            tokens = all_reduce(tokens.item(), op="sum", group=state.sp_group)
        if denominator is None:
            total = all_reduce(step_token_len[f"{name}_tokens"].item(), op="sum")
        else:
            total = denominator[f"{name}_tokens"]
        if total != 0:
            loss = loss * tokens / total * world
        elif not torch.allclose(loss, torch.zeros_like(loss)):
            raise ValueError(f"{name}_tokens is 0 on every rank but the loss is {loss}")
        if state.sp_enabled:
            loss = loss / state.sp_size
        scaled[key] = loss
    return scaled


class StepStartDenominator:
    """(b) VeOmni 0.1.12: one all-reduce per token key at step start; under SP, per-micro-batch SP reduces."""

    key = "b"
    label = "(b) step-start per-key reduce + SP reduces (VeOmni 0.1.12)"

    def __init__(self) -> None:
        self._denominator: dict[str, int | float] | None = None

    def start_step(self, step_token_len: Counts, grad_accum: int) -> None:
        self._denominator = {key: all_reduce(value.item(), op="sum") for key, value in step_token_len.items()}

    def scale(self, losses: Counts, micro_token_len: Counts, step_token_len: Counts) -> dict[str, torch.Tensor]:
        return _veomni_scale(losses, micro_token_len, self._denominator, step_token_len)


class PerMicroBatchDenominator(StepStartDenominator):
    """(a) VeOmni before denominator reuse: the step denominator all-reduced (after a host read) per micro-batch."""

    key = "a"
    label = "(a) per-micro-batch denominator (VeOmni before reuse)"

    def start_step(self, step_token_len: Counts, grad_accum: int) -> None:
        self._denominator = None  # `_veomni_scale` all-reduces it on every micro-batch


class VeOmniLite:
    """(c) veomni_lite: `mean_global_loss`, one packed all-reduce per step dict, no host read on the device path."""

    key = "c"
    label = "(c) veomni_lite"

    def start_step(self, step_token_len: Counts, grad_accum: int) -> None:
        pass

    def scale(self, losses: Counts, micro_token_len: Counts, step_token_len: Counts) -> dict[str, torch.Tensor]:
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

    def start_step(self, step_token_len: Counts, grad_accum: int) -> None:
        count = step_token_len["foundation_tokens"].reshape(1)
        state = get_parallel_state()
        gathered = count
        if dist.is_initialized() and state.world_size > 1:
            gathered = count.new_empty(state.world_size)
            _all_gather_tensor(gathered, count, group=state.world_group)
        self._total = max(gathered.sum().item(), 1)  # the step's host read (`num_items_in_batch`)
        self._grad_accum = grad_accum
        self._world = state.world_size

    def scale(self, losses: Counts, micro_token_len: Counts, step_token_len: Counts) -> dict[str, torch.Tensor]:
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

    def start_step(self, step_token_len: Counts, grad_accum: int) -> None:
        names = sorted(step_token_len)
        totals = torch.stack([step_token_len[name] for name in names])
        if dist.is_initialized():
            dist.all_reduce(totals, group=get_parallel_state().world_group)
        scales = get_parallel_state().world_size / totals.clamp(min=1).double()
        self._scales = dict(zip(names, scales.unbind()))

    def scale(self, losses: Counts, micro_token_len: Counts, step_token_len: Counts) -> dict[str, torch.Tensor]:
        scaled = {}
        for key, loss in losses.items():
            tokens = key[: -len("_loss")] + "_tokens"
            factor = micro_token_len[tokens] * self._scales[tokens]
            scaled[key] = loss * factor.to(torch.promote_types(loss.dtype, torch.float32))
        return scaled


LOSS_STRATEGIES: tuple[type[LossStrategy], ...] = (
    PerMicroBatchDenominator,
    StepStartDenominator,
    VeOmniLite,
    HFTrainerScheme,
    Oracle,
)
