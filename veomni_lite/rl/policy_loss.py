"""The policy head's per-token loss, as the loss contract wants it: this rank's mean over its valid local tokens.

Batch keys (per position of the SP shard, in the shifted frame of `policy_labels`: position t holds what concerns the
target token at t + 1): `policy_labels` (response tokens; prompts, padding and masked responses are IGNORE_INDEX),
`policy_advantages` (the sample's advantage A), `policy_old_logprobs` (old_t, before the rollout batch's first update),
`policy_ref_logprobs` (the frozen reference's, where `kl_coef` > 0), `policy_engine_logprobs` (the rollout engine's,
where `importance_sampling` is on), `sequence_ids`, and `policy_loss_weights` under seq-mean-token-mean.

With logp_t = log softmax(logits / temperature) at the target, r_t = exp(logp_t - old_t):
  ppo_clip  pg_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)); with dual_clip c and A < 0, min(pg_t, -A c)
  gspo      the same with r_t replaced by s = exp(mean over the sequence's response tokens of (logp - old)), the mean
            taken over the whole sequence (`sequence_sums`, exact under packing and SP, with its gradient)
  l_t = w_t pg_t + kl_coef kl_t - entropy_coef H_t
w_t = min(exp(old_t - engine_t), is_cap) for `importance_sampling: token`, min(exp(sum over the sequence of (old -
engine)), is_cap) for `sequence`, else 1 (detached). kl_t is `kl_estimator` of d = logp - ref: k1 d, k2 d^2 / 2, k3
exp(-d) + d - 1. `mean_global_loss` then makes the step's value exactly the mode's over every micro-batch and rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS, loss_weights_key
from veomni_lite.rl.config import POLICY, RLConfig
from veomni_lite.rl.sequence import sequence_sums

POLICY_LABELS = f"{POLICY}_labels"
ADVANTAGES = f"{POLICY}_advantages"
OLD_LOGPROBS = f"{POLICY}_old_logprobs"
REF_LOGPROBS = f"{POLICY}_ref_logprobs"
ENGINE_LOGPROBS = f"{POLICY}_engine_logprobs"
TOKEN_VALUES = (ADVANTAGES, OLD_LOGPROBS, REF_LOGPROBS, ENGINE_LOGPROBS)  # float per-token keys of a sample

__all__ = [
    "ADVANTAGES",
    "ENGINE_LOGPROBS",
    "OLD_LOGPROBS",
    "POLICY_LABELS",
    "REF_LOGPROBS",
    "TOKEN_VALUES",
    "PolicyLoss",
    "token_logprobs",
]


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([B, S] log-probability of each target under softmax(logits / temperature), 0 where the label is ignored;
    [B, S] entropy of that distribution, or None). Computed in float32 at least."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp_all = F.log_softmax(logits.to(dtype) / temperature, dim=-1)
    valid = labels != IGNORE_INDEX
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, logp, 0.0)
    if not entropy:
        return logp, None
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _kl(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    d = logp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return d * d / 2
    return torch.exp(-d) + d - 1


@dataclass(frozen=True)
class PolicyLoss:
    """The settings of the policy loss (from `RLConfig`) and the loss itself (see the module docstring)."""

    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    importance_sampling: str = "none"
    is_cap: float = 2.0
    temperature: float = 1.0

    @classmethod
    def of(cls, rl: RLConfig) -> PolicyLoss:
        return cls(
            rl.policy_loss, rl.clip_low, rl.clip_high, rl.dual_clip, rl.kl_coef, rl.kl_estimator, rl.entropy_coef,
            rl.importance_sampling, rl.is_cap, rl.temperature,
        )  # fmt: skip

    def __call__(
        self, logits: torch.Tensor, batch: Mapping[str, Any], sp_group: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """{"policy_loss": this shard's mean over its valid tokens of w l_t (an exact 0 without any), "metrics":
        {name: (total, count)} of this shard's tokens}. Collective over `sp_group` for gspo and sequence-level
        importance sampling (every shard calls it alike)."""
        labels = batch[POLICY_LABELS].to(logits.device)
        valid = labels != IGNORE_INDEX
        mask = valid.to(torch.float64)
        logp, entropy = token_logprobs(logits, labels, self.temperature, entropy=True)
        logp = logp.double()

        def key(name: str) -> torch.Tensor:
            return torch.where(valid, batch[name].to(logits.device, torch.float64), 0.0)

        advantages, old = key(ADVANTAGES), key(OLD_LOGPROBS)
        sequences = batch[SEQUENCE_IDS].to(logits.device)
        log_ratio = torch.where(valid, logp - old, 0.0)
        if self.policy_loss == "gspo":
            counts = sequence_sums(mask, sequences, sp_group)
            log_ratio = sequence_sums(log_ratio, sequences, sp_group) / counts.clamp(min=1)
        ratio = torch.exp(log_ratio)
        low, high = 1 - self.clip_low, 1 + self.clip_high
        pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(low, high))
        if self.dual_clip:
            pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * self.dual_clip), pg)
        if self.importance_sampling != "none":
            diff = torch.where(valid, old - key(ENGINE_LOGPROBS), 0.0)
            if self.importance_sampling == "sequence":
                diff = sequence_sums(diff, sequences, sp_group)
            pg = pg * torch.exp(diff).clamp(max=self.is_cap)
        per_token = pg
        metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        count = mask.sum()
        if self.kl_coef:
            kl = _kl(logp, key(REF_LOGPROBS), self.kl_estimator)
            per_token = per_token + self.kl_coef * kl
            metrics["rl/kl"] = ((kl.detach() * mask).sum(), count)
        entropy = entropy.double()
        if self.entropy_coef:
            per_token = per_token - self.entropy_coef * entropy
        weights = batch.get(loss_weights_key(POLICY))
        if weights is not None:
            per_token = per_token * weights.to(logits.device, torch.float64)
        loss = torch.where(valid, per_token, 0.0).sum() / count.clamp(min=1)
        with torch.no_grad():
            metrics["rl/entropy"] = ((entropy * mask).sum(), count)
            clipped_low = (ratio < low) & (advantages < 0) & valid
            clipped_high = (ratio > high) & (advantages > 0) & valid
            metrics["rl/clip_ratio/low"] = (clipped_low.sum().double(), count)
            metrics["rl/clip_ratio/high"] = (clipped_high.sum().double(), count)
        return {f"{POLICY}_loss": loss.to(torch.promote_types(logits.dtype, torch.float32)), "metrics": metrics}
