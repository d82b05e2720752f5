"""The policy head's per-token loss, as the loss contract wants it: this rank's mean over its valid local tokens.

Batch keys (per position of the SP shard, in the shifted frame of `policy_labels`: position t holds what concerns the
target token at t + 1): `policy_labels` (response tokens; prompts, padding and masked responses are IGNORE_INDEX),
`policy_advantages` (the sample's advantage A), `policy_old_logprobs` (old_t, before the rollout batch's first update;
absent on policy, with one mini-batch and one epoch, where it is logp_t itself, detached, as TRL and verl take it),
`policy_ref_logprobs` (the frozen reference's, where `kl_coef` > 0), `policy_engine_logprobs` (the rollout engine's,
where `importance_sampling` is on), `policy_teacher_logprobs` (the teacher's, `rl.teacher`), `sequence_ids`, and
`policy_loss_weights` under seq-mean-token-mean.

The model gives logp_t = log softmax(logits / temperature) at the target and the entropy H_t of that distribution
(`LogprobRequest`: fused with the LM head, the [tokens, vocab] logits never whole). `rl.policy_loss` names a
registered function giving each token's objective pg_t (`register_policy_loss`); with r_t = exp(logp_t - old_t):
  ppo_clip  pg_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)); with dual_clip c and A < 0, min(pg_t, -A c)
  gspo      the same with r_t replaced by s = exp(mean over the sequence's response tokens of (logp - old)), the mean
            taken over the whole sequence (`sequence_sums`, exact under packing and SP, with its gradient)
On-policy distillation (`teacher_coef` = `rl.teacher.coef` > 0, `veomni_lite.rl.teacher`): every policy loss reads
the advantage A_t = A - teacher_coef (old_t - teacher_t), the sampled token's reverse KL against the teacher.
Every policy loss's token loss is l_t = w_t pg_t + kl_coef kl_t - entropy_coef H_t, where w_t is the
importance weight of the rollout engine's (the behaviour policy's) log-probabilities: `rl.importance_sampling` names a
registered correction (`register_is_correction`) of the log-ratio d_t = old_t - engine_t (detached; w = 1 for rollouts
given without the engine's log-probabilities):
  none           w = 1; under `rl.decoupled` the raw weight exp(d_t)
  token          min(exp(d_t), is_cap) (truncated IS, verl's token TIS)
  sequence       min(exp(D), is_cap), D the sum of d over the whole sequence (`sequence_sums`: exact under packing
                 and SP), at each of its tokens (verl's sequence TIS)
  token_mask     exp(d_t) where is_low <= exp(d_t) <= is_cap, else 0: the token dropped, not truncated (masked IS)
  sequence_mask  exp(D) where is_low <= exp(D) <= is_cap, else 0 at every token of the sequence (verl's seq-MIS)
  icepop         token_mask's weight (IcePop's M(k) = k in [alpha, beta], else 0; its paper takes [0.5, 5])
A dropped token keeps its place in the denominators (its policy-gradient term is 0; its KL and entropy terms stay).
With the old pass (off policy) the ratio r_t is the proximal policy's and w_t the behaviour's: AReaL's decoupled PPO
objective, which `rl.decoupled` makes explicit for `none` too.
kl_t is `kl_estimator` of d = logp - ref: k1 d, k2 d^2 / 2, k3 exp(-d) + d - 1. `mean_global_loss` then makes the step's
value exactly the mode's over every micro-batch and rank.

A policy loss is one function `fn(inputs: PolicyInputs, **hyperparameters) -> (pg [B, S], metrics)`, registered with
the metric names it records ({name: (total, count)} of this shard's tokens, no grad) and its hyperparameters (fields
of `RLConfig`, with their defaults):

    @register_policy_loss("vanilla", metrics=("rl/ratio",))
    def vanilla(x: PolicyInputs) -> tuple[torch.Tensor, dict[str, Any]]:
        ratio = torch.exp(x.logp - x.old)
        return -x.advantages * ratio, {"rl/ratio": ((ratio.detach() * x.valid).sum(), x.valid.sum().double())}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS, loss_weights_key
from veomni_lite.models.heads import token_logprobs
from veomni_lite.post_training import sequence_sums
from veomni_lite.registries import Entry, Registry

POLICY = "policy"  # the head's name: `policy_labels`, `policy_loss`
POLICY_LABELS = f"{POLICY}_labels"
ADVANTAGES = f"{POLICY}_advantages"
OLD_LOGPROBS = f"{POLICY}_old_logprobs"
REF_LOGPROBS = f"{POLICY}_ref_logprobs"
ENGINE_LOGPROBS = f"{POLICY}_engine_logprobs"
TEACHER_LOGPROBS = f"{POLICY}_teacher_logprobs"
TOKEN_VALUES = (ADVANTAGES, OLD_LOGPROBS, REF_LOGPROBS, ENGINE_LOGPROBS, TEACHER_LOGPROBS)  # float per-token keys

__all__ = [
    "ADVANTAGES",
    "ENGINE_LOGPROBS",
    "OLD_LOGPROBS",
    "POLICY_LABELS",
    "REF_LOGPROBS",
    "POLICY",
    "TEACHER_LOGPROBS",
    "POLICY_LOSSES",
    "TOKEN_VALUES",
    "PolicyInputs",
    "PolicyLoss",
    "IS_CORRECTIONS",
    "engine_mismatch",
    "register_is_correction",
    "register_policy_loss",
    "token_logprobs",
]


def _kl(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    d = logp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return d * d / 2
    return torch.exp(-d) + d - 1


POLICY_LOSSES = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register  # `rl.policy_loss`: fn(PolicyInputs, **hyperparameters) -> (pg, metrics)


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy loss reads, per position of the SP shard [B, S], float64 and 0 off the valid tokens."""

    logp: torch.Tensor
    """The policy's log-probability of each target, with its gradient."""
    old: torch.Tensor
    """old_t, before the rollout batch's first update (on policy: `logp` detached)."""
    advantages: torch.Tensor
    valid: torch.Tensor
    """bool: a response target of the loss."""
    sequences: torch.Tensor
    """Each position's sequence id, for a sequence's sums (`sequence_sums(..., sequences, sp_group)`)."""
    sp_group: dist.ProcessGroup | None


CLIP = {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 0.0}
CLIP_METRICS = ("rl/clip_ratio/low", "rl/clip_ratio/high")


def clipped(
    log_ratio: torch.Tensor, x: PolicyInputs, clip_low: float, clip_high: float, dual_clip: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO's clipped objective of the ratio exp(`log_ratio`) and the shares of tokens clipped low and high."""
    advantages, ratio = x.advantages, torch.exp(log_ratio)
    low, high = 1 - clip_low, 1 + clip_high
    pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(low, high))
    if dual_clip:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * dual_clip), pg)
    with torch.no_grad():
        count = x.valid.sum().double()
        clipped_low = (ratio < low) & (advantages < 0) & x.valid
        clipped_high = (ratio > high) & (advantages > 0) & x.valid
        metrics = {CLIP_METRICS[0]: (clipped_low.sum().double(), count),
                   CLIP_METRICS[1]: (clipped_high.sum().double(), count)}  # fmt: skip
    return pg, metrics


@register_policy_loss("ppo_clip", metrics=CLIP_METRICS, hyperparameters=CLIP)
def ppo_clip(
    x: PolicyInputs, clip_low: float, clip_high: float, dual_clip: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO's clipped token ratio r_t = exp(logp_t - old_t)."""
    return clipped(torch.where(x.valid, x.logp - x.old, 0.0), x, clip_low, clip_high, dual_clip)


@register_policy_loss("gspo", metrics=CLIP_METRICS, hyperparameters=CLIP)
def gspo(x: PolicyInputs, clip_low: float, clip_high: float, dual_clip: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """GSPO: the sequence's ratio exp(mean over its response tokens of logp - old) at each of its tokens."""
    counts = sequence_sums(x.valid.double(), x.sequences, x.sp_group)
    log_ratio = sequence_sums(torch.where(x.valid, x.logp - x.old, 0.0), x.sequences, x.sp_group)
    return clipped(log_ratio / counts.clamp(min=1), x, clip_low, clip_high, dual_clip)


IS_CORRECTIONS = Registry("importance-sampling correction")
register_is_correction = IS_CORRECTIONS.register  # `rl.importance_sampling`: fn(d, PolicyInputs, **hp) -> (w, metrics)
TRUNCATED_SHARE, MASKED_SHARE = "rl/is/truncated_ratio", "rl/is/masked_ratio"  # shares of the response tokens
CAP = {"is_cap": 2.0}
BOUNDS = {"is_low": 0.5, "is_cap": 2.0}


def _share(flags: torch.Tensor, x: PolicyInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens flagged, valid tokens) of this shard."""
    return (flags & x.valid).sum().double(), x.valid.sum().double()


@register_is_correction("none")
def raw_weight(log_ratio: torch.Tensor, x: PolicyInputs) -> tuple[torch.Tensor, dict[str, Any]]:
    """exp(d_t) unbounded: applied only under `rl.decoupled` (AReaL's decoupled PPO without a weight cap)."""
    return torch.exp(log_ratio), {}


@register_is_correction("token", metrics=(TRUNCATED_SHARE,), hyperparameters=CAP)
def truncated_token(log_ratio: torch.Tensor, x: PolicyInputs, is_cap: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """min(exp(d_t), is_cap)."""
    ratio = torch.exp(log_ratio)
    return ratio.clamp(max=is_cap), {TRUNCATED_SHARE: _share(ratio > is_cap, x)}


@register_is_correction("sequence", metrics=(TRUNCATED_SHARE,), hyperparameters=CAP)
def truncated_sequence(log_ratio: torch.Tensor, x: PolicyInputs, is_cap: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """min(exp(the sequence's sum of d), is_cap) at each of its tokens (collective over the SP group)."""
    return truncated_token(sequence_sums(log_ratio, x.sequences, x.sp_group), x, is_cap)


@register_is_correction("token_mask", metrics=(MASKED_SHARE,), hyperparameters=BOUNDS)
def masked_token(
    log_ratio: torch.Tensor, x: PolicyInputs, is_low: float, is_cap: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """exp(d_t) inside [is_low, is_cap], else 0."""
    ratio = torch.exp(log_ratio)
    kept = (ratio >= is_low) & (ratio <= is_cap)
    return torch.where(kept, ratio, 0.0), {MASKED_SHARE: _share(~kept, x)}


@register_is_correction("sequence_mask", metrics=(MASKED_SHARE,), hyperparameters=BOUNDS)
def masked_sequence(
    log_ratio: torch.Tensor, x: PolicyInputs, is_low: float, is_cap: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """exp(the sequence's sum of d) inside [is_low, is_cap], else 0, at each of its tokens (collective over SP)."""
    return masked_token(sequence_sums(log_ratio, x.sequences, x.sp_group), x, is_low, is_cap)


register_is_correction("icepop", metrics=(MASKED_SHARE,), hyperparameters=BOUNDS)(masked_token)


@dataclass(frozen=True)
class PolicyLoss:
    """The settings of the policy loss (from `RLConfig`) and the loss itself (see the module docstring): the terms
    every policy loss shares, and `hyperparameters`, the named loss's own over its registered defaults."""

    policy_loss: str = "ppo_clip"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    importance_sampling: str = "none"
    temperature: float = 1.0
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    is_hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    """The IS correction's own (`is_cap`, `is_low`), over its registered defaults."""
    decoupled: bool = False
    teacher_coef: float = 0.0
    """`rl.teacher.coef` (0: no teacher): the reverse KL's weight in the advantage (module docstring)."""

    def __post_init__(self) -> None:
        for kind, entry, given in (
            ("policy loss", self.entry, self.hyperparameters),
            ("importance-sampling correction", self.correction, self.is_hyperparameters),
        ):
            unknown = set(given) - set(entry.hyperparameters)
            if unknown:
                raise ValueError(f"{kind} {entry.name!r} takes {list(entry.hyperparameters)}, not {sorted(unknown)}")

    @classmethod
    def of(cls, rl: Any) -> PolicyLoss:
        """From the `rl` section (an `RLConfig`): each setting its field of the same name."""
        read = {"hyperparameters", "is_hyperparameters", "teacher_coef"}
        shared = {f.name: getattr(rl, f.name) for f in fields(cls) if f.name not in read}
        correction = IS_CORRECTIONS.get(rl.importance_sampling, "rl.importance_sampling")
        coef = rl.teacher.coef if rl.teacher else 0.0
        return cls(**shared, hyperparameters=POLICY_LOSSES.get(rl.policy_loss, "rl.policy_loss").read(rl),
                   is_hyperparameters=correction.read(rl), teacher_coef=coef)  # fmt: skip

    @property
    def entry(self) -> Entry:
        """The registered policy loss (`POLICY_LOSSES`)."""
        return POLICY_LOSSES.get(self.policy_loss, "rl.policy_loss")

    @property
    def correction(self) -> Entry:
        """The registered importance-sampling correction (`IS_CORRECTIONS`)."""
        return IS_CORRECTIONS.get(self.importance_sampling, "rl.importance_sampling")

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, Any], sp_group: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """{"policy_loss": this shard's mean over its valid tokens of w l_t (an exact 0 without any), "metrics":
        {name: (total, count)} of this shard's tokens} from the model's `outputs` ({"logprobs", "entropy"} [B, S] of
        `LogprobRequest(batch["policy_labels"], temperature, entropy=True)`). Collective over `sp_group` for gspo and
        sequence-level importance sampling (every shard calls it alike)."""
        logp, entropy = outputs["logprobs"], outputs["entropy"]
        device = logp.device
        labels = batch[POLICY_LABELS].to(device)
        valid = labels != IGNORE_INDEX
        mask = valid.to(torch.float64)
        out_dtype = torch.promote_types(logp.dtype, torch.float32)
        logp = torch.where(valid, logp.double(), 0.0)

        def key(name: str) -> torch.Tensor:
            return torch.where(valid, batch[name].to(device, torch.float64), 0.0)

        on_policy = OLD_LOGPROBS not in batch
        advantages, old = key(ADVANTAGES), logp.detach() if on_policy else key(OLD_LOGPROBS)
        metrics: dict[str, Any] = {}
        count = mask.sum()
        if self.teacher_coef:  # on-policy distillation: the sampled token's reverse KL against the teacher
            reverse_kl = torch.where(valid, old - key(TEACHER_LOGPROBS), 0.0)
            advantages = advantages - self.teacher_coef * reverse_kl
            metrics["rl/teacher/reverse_kl"] = (reverse_kl.sum(), count)
        sequences = batch[SEQUENCE_IDS].to(device)
        inputs = PolicyInputs(logp, old, advantages, valid, sequences, sp_group)
        entry = self.entry
        pg, loss_metrics = entry.fn(inputs, **{**entry.hyperparameters, **self.hyperparameters})
        engine = key(ENGINE_LOGPROBS) if ENGINE_LOGPROBS in batch else None  # None: rollouts given without them
        if (self.importance_sampling != "none" or self.decoupled) and engine is not None:
            correction = self.correction
            settings = {**correction.hyperparameters, **self.is_hyperparameters}
            weights, is_metrics = correction.fn(torch.where(valid, old - engine, 0.0), inputs, **settings)
            pg = pg * weights
            metrics.update(is_metrics)
        if on_policy and engine is not None:  # else the trainer records these from the old pass
            metrics.update(engine_mismatch(old, engine, valid, sequences, sp_group))
        per_token = pg
        if self.kl_coef:
            kl = _kl(logp, key(REF_LOGPROBS), self.kl_estimator)
            per_token = per_token + self.kl_coef * kl
            metrics["rl/kl"] = ((kl.detach() * mask).sum(), count)
        entropy = entropy.double()
        if self.entropy_coef:
            per_token = per_token - self.entropy_coef * entropy
        weights = batch.get(loss_weights_key(POLICY))
        if weights is not None:
            per_token = per_token * weights.to(device, torch.float64)
        loss = torch.where(valid, per_token, 0.0).sum() / count.clamp(min=1)
        with torch.no_grad():
            metrics["rl/entropy"] = ((torch.where(valid, entropy, 0.0)).sum(), count)
        metrics.update(loss_metrics)
        return {f"{POLICY}_loss": loss.to(out_dtype), "metrics": metrics}


@torch.no_grad()
def engine_mismatch(
    old: torch.Tensor,
    engine: torch.Tensor,
    valid: torch.Tensor,
    sequences: torch.Tensor,
    sp_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """The mismatch of the engine's (behaviour) log-probabilities with `old` over the `valid` tokens of [B, S] values:
    `rl/importance_ratio/{mean,min,max}` exp(old - engine), `rl/logprob_diff` |old - engine|, `rl/mismatch/kl` the
    mean of engine - old (verl's direct estimator of KL(engine || old)) and `rl/mismatch/ppl_ratio` the mean over
    sequences of exp(the sequence's mean of engine - old) (the old policy's perplexity over the engine's, verl's
    ppl_ratio; whole sequences by `sequences`, collective over `sp_group`). Metric values: (total, count) for means,
    tensors for extrema, +-inf without valid tokens; no host read."""
    diff = torch.where(valid, old - engine, 0.0)
    ratio = torch.exp(diff)
    count = valid.sum().double()
    lengths = sequence_sums(valid.double(), sequences, sp_group).clamp(min=1)
    per_sequence = torch.exp(-sequence_sums(diff, sequences, sp_group) / lengths)  # each of its tokens: 1 / length
    return {
        "rl/importance_ratio/mean": (torch.where(valid, ratio, 0.0).sum(), count),
        "rl/importance_ratio/min": torch.where(valid, ratio, torch.inf).min(),
        "rl/importance_ratio/max": torch.where(valid, ratio, -torch.inf).max(),
        "rl/logprob_diff": (diff.abs().sum(), count),
        "rl/mismatch/kl": (-diff.sum(), count),
        "rl/mismatch/ppl_ratio": (
            torch.where(valid, per_sequence / lengths, 0.0).sum(),
            torch.where(valid, 1 / lengths, 0.0).sum(),
        ),
    }
