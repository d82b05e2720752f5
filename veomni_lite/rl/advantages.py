"""The advantage estimators `rl.advantage` names, each one registered function (`register_advantage`).

An outcome estimator is `fn(rewards [N], group_size, lengths [N], **hyperparameters) -> advantages [N]`: each
response's advantage from the rollout batch's rewards (each prompt's `group_size` responses consecutive) and response
token counts; its hyperparameters are `RLConfig` fields, registered with their defaults. One with `needs_critic` (gae)
is the critic's: per token, from the critic's values, after the log-probability passes (`veomni_lite.rl.critic`);
`fn(rewards [T], values [T], **hyperparameters) -> (advantages [T], returns [T])` of one response.

    @register_advantage("max_baseline")
    def max_baseline(rewards: torch.Tensor, group_size: int, lengths: torch.Tensor) -> torch.Tensor:
        grouped = rewards.reshape(-1, group_size)
        return (grouped - grouped.amax(dim=1, keepdim=True)).reshape(-1)

Contract of the built-in outcome estimators:
- Groups are consecutive runs of `group_size` entries of the 1-D rewards (a rollout batch lists each prompt's
  responses together); the length must be a multiple of `group_size`.
- `grpo` A_i = (R_i - mean) / (std + eps), std with Bessel's correction (divisor G - 1); `dr_grpo`
  A_i = R_i - mean (Dr. GRPO: no std division); `rloo` A_i = R_i - (sum_{j != i} R_j) / (G - 1) (the leave-one-out
  baseline; equal to G / (G - 1) * (R_i - mean)). `grpo` and `rloo` need G >= 2; `dr_grpo` with G = 1 gives 0.
- A group whose rewards are all equal gets exactly 0 under every kind (its mean, summed in floating point, need not
  equal the common value, which would leave a rounding residue that `grpo` divides by a std near 0).
- Rewards must be finite (a rollouts file's NaN is an error naming its index). Computed in float64, returned in
  the rewards' dtype. Pure local math: the trainer calls it on the whole rollout
  batch (every rank has every group's rewards) or on whole groups, never on a split group.
- `reinforce_pp` is REINFORCE++'s (verl's
  `compute_reinforce_plus_plus_outcome_advantage` with gamma 1 and its `masked_whiten`): every response token's return
  is its response's reward, whitened over every response token of the whole rollout batch, A_i = (R_i - mu) /
  sqrt(var + 1e-8) with mu = sum_i L_i R_i / L and var = sum_i L_i (R_i - mu)^2 / (L - 1) (L_i response i's tokens,
  L their sum: token-weighted, Bessel-corrected, as verl; OpenRLHF's `reinforce` divides by L and clamps var at
  1e-8). The statistics are the batch's: the trainer calls it on the world's all-gathered batch, never a rank's part.
  A batch whose rewards all equal gets exactly 0.
- `group_stats` gives the per-batch counts the metrics reduce exactly: groups, groups whose rewards all equal (no
  learning signal under any kind) and their share `frac_reward_zero_std`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from veomni_lite.registries import Registry

__all__ = ["ADVANTAGES", "WHITEN_EPS", "estimate", "gae", "group_stats", "register_advantage"]

ADVANTAGES = Registry("advantage estimator")
register_advantage = ADVANTAGES.register  # `rl.advantage` (see the module docstring for the function's contract)
WHITEN_EPS = 1e-8  # verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


def _groups(rewards: torch.Tensor, group_size: int, what: str) -> torch.Tensor:
    """`rewards` as float64 [groups, group_size], after checking shape and size."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.dtype.is_floating_point:
        raise ValueError(f"{what}: rewards must be a 1-D floating-point tensor, got {rewards!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{what}: group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"{what}: {rewards.numel()} rewards do not split into groups of {group_size}")
    finite = torch.isfinite(rewards)
    if not bool(finite.all()):
        index = int((~finite).nonzero()[0, 0])
        raise ValueError(f"{what}: reward {index} is {rewards[index].item()}, not finite")
    return rewards.to(torch.float64).reshape(-1, group_size)


def estimate(rl: Any, rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The advantages [N] of `rl.advantage` (an outcome estimator) from a rollout batch's rewards and response token
    counts [N], its hyperparameters read from the `rl` section (an `RLConfig`)."""
    estimator = ADVANTAGES.get(rl.advantage, "rl.advantage")
    return estimator.fn(rewards, rl.num_generations, lengths, **estimator.read(rl))


def _per_group(
    rewards: torch.Tensor, group_size: int, name: str, advantage: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`advantage` of the grouped rewards [groups, group_size] (float64), a flat group's exactly 0, in the rewards'
    dtype; the registered `min_group_size` of `name` checked."""
    grouped = _groups(rewards, group_size, name)
    minimum = ADVANTAGES.get(name, "rl.advantage").extra.get("min_group_size", 1)
    if group_size < minimum:
        raise ValueError(f"{name} needs at least {minimum} responses per prompt, got group_size {group_size}")
    if not grouped.numel():
        return rewards.clone()
    advantages = torch.where(_all_equal(grouped), 0.0, advantage(grouped))
    return advantages.reshape(-1).to(rewards.dtype)


@register_advantage("grpo", hyperparameters={"advantage_eps": 1e-6}, min_group_size=2)
def grpo(rewards: torch.Tensor, group_size: int, lengths: torch.Tensor, advantage_eps: float) -> torch.Tensor:
    """(R - mean) / (std + eps) within each group, std with Bessel's correction."""

    def advantage(g: torch.Tensor) -> torch.Tensor:
        return (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, correction=1, keepdim=True) + advantage_eps)

    return _per_group(rewards, group_size, "grpo", advantage)


@register_advantage("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_size: int, lengths: torch.Tensor) -> torch.Tensor:
    """R - mean within each group (Dr. GRPO: no std division)."""
    return _per_group(rewards, group_size, "dr_grpo", lambda g: g - g.mean(dim=1, keepdim=True))


@register_advantage("rloo", min_group_size=2)
def rloo(rewards: torch.Tensor, group_size: int, lengths: torch.Tensor) -> torch.Tensor:
    """R_i - the mean of the group's other rewards (the leave-one-out baseline)."""
    return _per_group(rewards, group_size, "rloo", lambda g: g - (g.sum(dim=1, keepdim=True) - g) / (group_size - 1))


@register_advantage("reinforce_pp")
def reinforce_pp(rewards: torch.Tensor, group_size: int, lengths: torch.Tensor) -> torch.Tensor:
    """REINFORCE++'s advantage [N] of each response: its reward whitened over the batch's response tokens (see the
    module docstring); `lengths` [N] the responses' token counts (at least 2 tokens in all). Groups play no part."""
    values = _groups(rewards, 1, "reinforce_pp").reshape(-1)
    if not isinstance(lengths, torch.Tensor) or lengths.shape != rewards.shape or bool((lengths < 0).any()):
        raise ValueError(f"reinforce_pp: lengths must be [N] counts >= 0 like the rewards, got {lengths!r}")
    weights = lengths.to(torch.float64)
    tokens = weights.sum()
    if tokens < 2:
        raise ValueError(f"reinforce_pp: {int(tokens)} response tokens; the batch's variance needs at least 2")
    if bool(values.amax() == values.amin()):
        return torch.zeros_like(rewards)
    mean = (weights * values).sum() / tokens
    var = (weights * (values - mean) ** 2).sum() / (tokens - 1)
    return ((values - mean) * torch.rsqrt(var + WHITEN_EPS)).to(rewards.dtype)


@register_advantage("gae", needs_critic=True, hyperparameters={"gamma": 1.0, "lam": 1.0})
def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [T] of one response's token rewards and old values [T] (float64): delta_t = r_t +
    gamma V_{t+1} - V_t (V_T = 0), A_t = delta_t + gamma lam A_{t+1}, returns = A + V."""
    rewards, values = rewards.double(), values.double()
    advantages = torch.zeros_like(values)
    running, following = 0.0, 0.0
    for t in range(values.numel() - 1, -1, -1):
        delta = rewards[t] + gamma * following - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
        following = values[t]
    return advantages, advantages + values


def _all_equal(grouped: torch.Tensor) -> torch.Tensor:
    """[groups, 1] bool: the group's rewards all equal."""
    return grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)


def group_stats(rewards: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """{"groups": int64, "groups_zero_std": int64 (groups whose rewards all equal), "frac_reward_zero_std": float64
    (their share; NaN for no groups)}: counts, so a metric summed over ranks and steps stays exact."""
    grouped = _groups(rewards, group_size, "group_stats")
    groups = torch.tensor(grouped.shape[0], dtype=torch.int64)
    zero_std = _all_equal(grouped).sum().to(torch.int64)
    return {
        "groups": groups,
        "groups_zero_std": zero_std,
        "frac_reward_zero_std": zero_std.to(torch.float64) / groups.to(torch.float64),
    }
