"""DAPO's dynamic sampling (`rl.dynamic_sampling`, verl's `algorithm.filter_groups`): which groups of a round learn.

Contract:
- `learning_groups(values, group_size)`: one bool per consecutive group of `group_size` entries of `values` (the
  metric of each response): True when the values differ within the group, or the group has one response (verl keeps
  `std > 0 or len == 1`); equal values (exactly: max == min) carry no gradient under any group advantage and are
  dropped. Pure local math: the trainer calls it on the world's all-gathered round, so every rank decides alike.
- `metric_values(samples, metric)`: the metric of each sample, `reward` the total, else `rewards[metric]`.
- `DynamicSamplingError`: `max_generation_rounds` rounds gave fewer than `rl.prompts_per_step` learning groups (verl
  raises too); raised on every rank alike, since every rank holds the same gathered rewards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from veomni_lite.rl.rollouts import RolloutSample

__all__ = ["DynamicSamplingError", "learning_groups", "metric_values"]


class DynamicSamplingError(RuntimeError):
    """Too few learning groups within `rl.dynamic_sampling.max_generation_rounds` (every rank alike)."""


def metric_values(samples: Sequence[RolloutSample], metric: str) -> torch.Tensor:
    """float64 [N]: each sample's total reward (`metric` "reward") or its reward `metric` (unweighted)."""
    return torch.tensor([s.reward if metric == "reward" else s.rewards[metric] for s in samples], dtype=torch.float64)


def learning_groups(values: torch.Tensor, group_size: int) -> list[bool]:
    """Per consecutive group of `group_size`: whether its values differ (or it has one response)."""
    if values.dim() != 1 or group_size < 1 or values.numel() % group_size:
        raise ValueError(f"learning_groups: {values.numel()} values do not split into groups of {group_size}")
    grouped = values.reshape(-1, group_size)
    if group_size == 1:
        return [True] * grouped.shape[0]
    return (grouped.amax(dim=1) != grouped.amin(dim=1)).tolist()
