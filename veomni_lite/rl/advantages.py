"""Group-relative advantages: each prompt's `group_size` responses are scored against each other.

Contract:
- Groups are consecutive runs of `group_size` entries of the 1-D rewards (a rollout batch lists each prompt's
  responses together); the length must be a multiple of `group_size`.
- `kind`: `grpo` A_i = (R_i - mean) / (std + eps), std with Bessel's correction (divisor G - 1); `dr_grpo`
  A_i = R_i - mean (Dr. GRPO: no std division); `rloo` A_i = R_i - (sum_{j != i} R_j) / (G - 1) (the leave-one-out
  baseline; equal to G / (G - 1) * (R_i - mean)). `grpo` and `rloo` need G >= 2; `dr_grpo` with G = 1 gives 0.
- A group whose rewards are all equal gets exactly 0 under every kind (its mean, summed in floating point, need not
  equal the common value, which would leave a rounding residue that `grpo` divides by a std near 0).
- Rewards must be finite (a rollouts file's NaN is an error naming its index). Computed in float64, returned in
  the rewards' dtype. Pure local math: the trainer calls it on the whole rollout
  batch (every rank has every group's rewards) or on whole groups, never on a split group.
- `batch_advantages` is REINFORCE++'s (`rl.advantage: reinforce_pp`, verl's
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

import torch

KINDS = ("grpo", "dr_grpo", "rloo")
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


def group_advantages(rewards: torch.Tensor, group_size: int, kind: str, eps: float = 1e-6) -> torch.Tensor:
    """Each response's advantage [N] within its group (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"group_advantages: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    grouped = _groups(rewards, group_size, "group_advantages")
    if group_size < 2 and kind != "dr_grpo":
        raise ValueError(f"group_advantages: {kind} needs at least 2 responses per prompt, got group_size 1")
    if not grouped.numel():
        return rewards.clone()
    mean = grouped.mean(dim=1, keepdim=True)
    if kind == "grpo":
        advantages = (grouped - mean) / (grouped.std(dim=1, correction=1, keepdim=True) + eps)
    elif kind == "dr_grpo":
        advantages = grouped - mean
    else:
        others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        advantages = grouped - others
    flat = _all_equal(grouped)
    advantages = torch.where(flat, torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1).to(rewards.dtype)


def batch_advantages(rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """REINFORCE++'s advantage [N] of each response: its reward whitened over the batch's response tokens (see the
    module docstring); `lengths` [N] the responses' token counts (at least 2 tokens in all)."""
    values = _groups(rewards, 1, "batch_advantages").reshape(-1)
    if not isinstance(lengths, torch.Tensor) or lengths.shape != rewards.shape or bool((lengths < 0).any()):
        raise ValueError(f"batch_advantages: lengths must be [N] counts >= 0 like the rewards, got {lengths!r}")
    weights = lengths.to(torch.float64)
    tokens = weights.sum()
    if tokens < 2:
        raise ValueError(f"batch_advantages: {int(tokens)} response tokens; the batch's variance needs at least 2")
    if bool(values.amax() == values.amin()):
        return torch.zeros_like(rewards)
    mean = (weights * values).sum() / tokens
    var = (weights * (values - mean) ** 2).sum() / (tokens - 1)
    return ((values - mean) * torch.rsqrt(var + WHITEN_EPS)).to(rewards.dtype)


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
