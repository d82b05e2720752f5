"""Gradient clipping by the global norm over FSDP2 shards, folded with the step's non-finite agreement."""

from __future__ import annotations

import math
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

    ONE all-reduce over `group` carries both: this rank's sum of squares of its gradient shards, each divided by the
    number of ranks holding the same shard (1 under FSDP, dp_replicate under HSDP), so the sum over ranks is the
    global squared norm; and whether its own `local_loss` is non-finite. A loss can be non-finite while every
    gradient is finite (a detached term, a masked head), so the loss must be part of what the ranks agree on.
    """
    by_copies: dict[int, list[torch.Tensor]] = {}
    for grad in (p.grad for p in parameters if p.grad is not None):
        copies = 1
        if isinstance(grad, DTensor):
            if any(placement.is_partial() for placement in grad.placements):
                raise ValueError(f"clip_global_grad_norm: expected reduced gradients, got {grad.placements}")
            copies = math.prod(grad.device_mesh.size(d) for d, p in enumerate(grad.placements) if p.is_replicate())
            grad = grad.to_local()
        by_copies.setdefault(copies, []).append(grad)
    squares = [torch.nn.utils.get_total_norm(g, foreach=True).double().square() / c for c, g in by_copies.items()]
    local_sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    bad_loss = (~torch.isfinite(local_loss.detach())).to(device=local_sq.device, dtype=torch.float64)
    reduced = all_reduce(torch.stack([local_sq, bad_loss.reshape(())]), op="sum", group=group)
    total = reduced[0].sqrt().float()
    if max_norm > 0:
        meshes: dict[object, list[nn.Parameter]] = {}  # a foreach kernel cannot mix DTensors of two meshes (EP)
        for param in parameters:
            meshes.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
        for group in meshes.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total, reduced[1]
