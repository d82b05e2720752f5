"""Gradient clipping by the global norm over FSDP2 shards, folded with the step's non-finite agreement."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from veomni_lite.distributed.collectives import all_reduce


def clip_global_grad_norm(
    parameters: Sequence[nn.Parameter], max_norm: float, local_loss: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip gradients by their norm over ALL shards; return (global norm, number of ranks whose loss is non-finite).

    ONE all-reduce over `group` carries both: this rank's sum of squares of its gradient shards (FSDP2 shards every
    parameter over the whole dp x sp group, so the sum over ranks is the global squared norm) and whether its own
    `local_loss` is non-finite. A loss can be non-finite while every gradient is finite (a detached term, a masked
    head), so the loss must be part of what the ranks agree on.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    shards = []
    for grad in grads:
        if isinstance(grad, DTensor):
            if not all(placement.is_shard() for placement in grad.placements):
                raise ValueError(f"clip_global_grad_norm: expected sharded gradients, got {grad.placements}")
            grad = grad.to_local()
        shards.append(grad)
    local_sq = torch.nn.utils.get_total_norm(shards, foreach=True).double().square()
    bad_loss = (~torch.isfinite(local_loss.detach())).to(device=local_sq.device, dtype=torch.float64)
    reduced = all_reduce(torch.stack([local_sq, bad_loss.reshape(())]), op="sum", group=group)
    total = reduced[0].sqrt().float()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total, reduced[1]
