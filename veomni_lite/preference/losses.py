"""Preference losses (DPO family, Bradley-Terry reward models) as one per-pair head, `pref`, exact on every layout.

A pair is two sequences of one micro-batch: its chosen side has sequence id 2p and its rejected side 2p + 1
(`collate_pairs`: padded, rows [c0, r0, c1, r1, ...]; packed, segments in that order in one row, never attending to
each other). Batch keys, in the shifted frame like every labels key:
  `pref_labels`       DPO family: both sides' response targets (prompt, padding: IGNORE_INDEX); reward model: one
                      valid entry (0) at each side's last token, where the score is read;
  `pref_seq_starts`   True at exactly one position of each pair (its chosen side's first valid entry): the pair is the
                      head's sequence, so `pref_sequences` counts pairs and the head's mode `seq-mean-token-sum` makes
                      the step exactly the mean over every pair of the step on all ranks, the pair count in the step's
                      one loss all-reduce;
  `pref_ref_logprobs` the reference's log-probability of each response target (precomputed, or filled by the
                      trainer from the frozen reference's forward on the same micro-batch); `pref_margins` a reward
                      model's per-pair margin (at the anchor, 0 elsewhere), where the data gives one.
`PreferenceLoss` completes each side's sums (policy log-probability, token count, reference log-probability; or the
reward) over the SP group with their gradient (`sequence_totals`: ONE autograd all-reduce per micro-batch) BEFORE the
nonlinearity, computes each pair's loss L_p once, and places it on the pair's anchor (whichever shard holds it); the
head's value is this shard's sum of placed L_p over its valid `pref_labels` entries, as the loss contract wants.

Per pair, with pi / ref the sides' summed log-probabilities (averaged over the response tokens for ipo and simpo, as
their papers and TRL define them), h = (pi_c - ref_c) - (pi_r - ref_r), b = beta, s = label_smoothing:
  sigmoid (DPO; cDPO with s)  -log sig(b h) (1 - s) - log sig(-b h) s           TRL DPOTrainer loss_type "sigmoid"
  ipo                         (h - 1 / (2 b))^2                                 TRL "ipo" (averaged log-probs)
  hinge (SLiC)                max(0, 1 - b h)                                   TRL "hinge"
  simpo (reference-free)      -log sig(b (pi_c - pi_r) - gamma) (1 - s) - ...   TRL CPOTrainer loss_type "simpo"
  bradley_terry (reward)      -log sig(r_c - r_r - margin) + c (r_c + r_r)^2    TRL RewardTrainer, c = center_rewards
  orpo (reference-free)       -l_c - lambda log sig(log odds_c - log odds_r),   TRL ORPOTrainer (its beta = lambda)
                              l the mean log-prob per token, log odds = l - log(1 - exp l)
  kto (unpaired)              w_d (1 - sig(b (d - z0))) for a desirable row,    TRL KTOTrainer loss_type "kto"
                              w_u (1 - sig(b (z0 - d))) for an undesirable one, d = pi - ref of its completion
and, with `rpo_alpha` a, the DPO family adds a x the chosen side's mean negative log-likelihood per token (RPO).
ORPO's NLL is each pair's mean per chosen token (the ORPO paper's per-sample L_SFT), the pairs weighed alike; TRL
averages it over the batch's chosen tokens instead (the same when the chosen responses are equally long).
KTO: a "pair" is one row: its side 2p is prompt + completion, its side 2p + 1 prompt + a mismatched completion (another
row's, `pairs.py`), and the row's label (1 desirable, 0 not) sits at the anchor (`pref_desirable`). z0 is the KL
estimate, the mean over the optimizer step's rows, on all ranks, of pi - ref of the mismatched side, clamped at 0 and
constant (detached): a statistic of the whole step, computed before any loss by `kto_kl_totals` over every micro-batch
(a no-grad pass) and `kto_reference_point` (one all-reduce), then given to the head as `pref_kl`.
Metrics (TRL's names, pair-weighted): `rewards/chosen` b (pi_c - ref_c) (simpo: b pi_c), `rewards/rejected`,
`rewards/margins`, `rewards/accuracies` (chosen reward > rejected), `logps/chosen`, `logps/rejected`; a reward
model: `rewards/chosen` r_c, `rewards/rejected`, `rewards/margins`, `rewards/accuracy`, `rewards/mean` (r_c + r_r) / 2;
orpo adds `nll_loss`, `log_odds_ratio` (log sig of the log odds ratio), `log_odds_chosen` (the log odds ratio), its
rewards lambda l; kto: `kl` (z0), `rewards/chosen` b d and `logps/chosen` pi over the desirable rows, `rewards/rejected`
and `logps/rejected` over the undesirable ones (each its own count, as TRL's KTOTrainer), `logits/chosen` and
`logits/rejected` the mean logit (over the vocabulary) per completion token of the desirable / undesirable rows, and
`rewards/margins` = `rewards/chosen` - `rewards/rejected`, derived when the window is reduced (`metric_differences`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS, seq_starts_key
from veomni_lite.post_training import sequence_totals
from veomni_lite.preference.config import PREF, PREF_LOSSES, PREF_MODE, PrefConfig

PREF_LABELS = f"{PREF}_labels"
PREF_STARTS = seq_starts_key(PREF)
REF_LOGPROBS = f"{PREF}_ref_logprobs"
MARGINS = f"{PREF}_margins"
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected")  # fmt: skip
ORPO_METRICS = (*DPO_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "logits/chosen",
               "logits/rejected")  # fmt: skip
# A logged metric that is the difference of two recorded means, each over its own count (derived at log time)
KTO_DIFFERENCES = {"rewards/margins": ("rewards/chosen", "rewards/rejected")}
KTO_LABELS = f"{PREF}_desirable"
KL = f"{PREF}_kl"
RM_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "rewards/mean")

__all__ = [
    "DPO_METRICS",
    "KL",
    "KTO_LABELS",
    "KTO_DIFFERENCES",
    "KTO_METRICS",
    "ORPO_METRICS",
    "MARGINS",
    "PREF",
    "PREF_LABELS",
    "PREF_LOSSES",
    "PREF_MODE",
    "PREF_STARTS",
    "REF_LOGPROBS",
    "RM_METRICS",
    "PreferenceLoss",
    "kto_kl_totals",
    "kto_reference_point",
    "log1mexp",
    "metric_differences",
    "metric_names",
]


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable (TRL's ORPO helper: the branch at -log 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def metric_names(loss: str) -> tuple[str, ...]:
    """The metrics `pref.loss` logs (TRL's names)."""
    return {"bradley_terry": RM_METRICS, "orpo": ORPO_METRICS, "kto": KTO_METRICS}.get(loss, DPO_METRICS)


def metric_differences(loss: str) -> dict[str, tuple[str, str]]:
    """The metrics `pref.loss` logs as the difference of two of its recorded means ({name: (a, b)}: a - b, logged
    when both have a count in the window); kto's `rewards/margins`, as TRL's KTOTrainer."""
    return dict(KTO_DIFFERENCES) if loss == "kto" else {}


def kto_kl_totals(logprobs: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """[2] float64 of one micro-batch shard (no grad): the sum over its mismatched sides' (odd sequence ids) response
    targets of policy - reference log-probability, and the rows anchored on it. Summed over every micro-batch and
    rank (`kto_reference_point`), they give the step's KL estimate: a sum over tokens needs no sequence completion."""
    device = logprobs.device
    valid = batch[PREF_LABELS].to(device) != IGNORE_INDEX
    mismatched = valid & (batch[SEQUENCE_IDS].to(device) % 2 == 1)
    ref = batch[REF_LOGPROBS].to(device, torch.float64)
    total = torch.where(mismatched, logprobs.detach().double() - ref, 0.0).sum()
    rows = (batch[PREF_STARTS].to(device).bool() & valid).sum().double()
    return torch.stack([total, rows])


def kto_reference_point(totals: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """z0 = max(0, KL sum / rows) from this rank's summed `kto_kl_totals` of the step, all-reduced over `group` (every
    rank of the step, DP and SP: ONE all-reduce; None: this process alone). A float64 scalar, constant."""
    totals = totals.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    return (totals[0] / totals[1].clamp(min=1)).clamp(min=0)


@dataclass(frozen=True)
class PreferenceLoss:
    """The loss settings (from `PrefConfig`) and the head itself (see the module docstring)."""

    loss: str = "sigmoid"
    beta: float = 0.1
    gamma: float = 0.5
    label_smoothing: float = 0.0
    center_rewards: float = 0.0
    rpo_alpha: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    orpo_lambda: float = 0.1

    @classmethod
    def of(cls, pref: PrefConfig) -> PreferenceLoss:
        return cls(pref.loss, pref.beta, pref.gamma, pref.label_smoothing, pref.center_rewards, pref.rpo_alpha,
                   pref.desirable_weight, pref.undesirable_weight, pref.orpo_lambda)  # fmt: skip

    def pair_losses(
        self, chosen: torch.Tensor, rejected: torch.Tensor, z0: torch.Tensor | float = 0.0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]]:
        """Each pair's loss L_p [P] and metric values {name: [P]} (or ([P] values, [P] weights) for a metric over some
        pairs) from the sides' complete totals [K, P]: (policy log-prob sum, response tokens, reference log-prob sum;
        kto: and the label), or (reward, margin) for bradley_terry. `z0`: kto's reference point."""
        if self.loss == "kto":
            pi, ref, desirable = chosen[0], chosen[2], chosen[3] > 0.5
            d = pi - ref
            losses = torch.where(desirable, self.desirable_weight * (1 - torch.sigmoid(self.beta * (d - z0))),
                                 self.undesirable_weight * (1 - torch.sigmoid(self.beta * (z0 - d))))  # fmt: skip
            yes, no = desirable.double(), (~desirable).double()
            values: dict[str, Any] = {"kl": torch.zeros_like(pi) + z0, "rewards/chosen": (self.beta * d, yes),
                                      "rewards/rejected": (self.beta * d, no), "logps/chosen": (pi, yes),
                                      "logps/rejected": (pi, no)}  # fmt: skip
            return losses, values
        if self.loss == "orpo":
            l_c, l_r = chosen[0] / chosen[1].clamp(min=1), rejected[0] / rejected[1].clamp(min=1)
            log_odds = (l_c - l_r) - (log1mexp(l_c) - log1mexp(l_r))
            ratio = F.logsigmoid(log_odds)
            losses = -l_c - self.orpo_lambda * ratio
            reward_c, reward_r = self.orpo_lambda * l_c, self.orpo_lambda * l_r
            accuracies = (reward_c > reward_r).double()
            return losses, {"rewards/chosen": reward_c, "rewards/rejected": reward_r,
                            "rewards/margins": reward_c - reward_r, "rewards/accuracies": accuracies,
                            "logps/chosen": l_c, "logps/rejected": l_r, "nll_loss": -l_c, "log_odds_ratio": ratio,
                            "log_odds_chosen": log_odds}  # fmt: skip
        if self.loss == "bradley_terry":
            r_c, r_r, margin = chosen[0], rejected[0], chosen[1]
            losses = -F.logsigmoid(r_c - r_r - margin) + self.center_rewards * (r_c + r_r) ** 2
            values = {"rewards/chosen": r_c, "rewards/rejected": r_r, "rewards/margins": r_c - r_r,
                      "rewards/accuracy": (r_c > r_r).double(), "rewards/mean": (r_c + r_r) / 2}  # fmt: skip
            return losses, values
        pi_c, pi_r, ref_c, ref_r = chosen[0], rejected[0], chosen[2], rejected[2]
        if self.loss in ("ipo", "simpo"):
            n_c, n_r = chosen[1].clamp(min=1), rejected[1].clamp(min=1)
            pi_c, pi_r, ref_c, ref_r = pi_c / n_c, pi_r / n_r, ref_c / n_c, ref_r / n_r
        b, s = self.beta, self.label_smoothing
        if self.loss == "simpo":
            logits = b * (pi_c - pi_r) - self.gamma
            losses = -F.logsigmoid(logits) * (1 - s) - F.logsigmoid(-logits) * s
            reward_c, reward_r = b * pi_c, b * pi_r
        else:
            h = (pi_c - ref_c) - (pi_r - ref_r)
            if self.loss == "sigmoid":
                losses = -F.logsigmoid(b * h) * (1 - s) - F.logsigmoid(-b * h) * s
            elif self.loss == "ipo":
                losses = (h - 1 / (2 * b)) ** 2
            else:
                losses = torch.relu(1 - b * h)
            reward_c, reward_r = b * (pi_c - ref_c), b * (pi_r - ref_r)
        if self.rpo_alpha:
            losses = losses - self.rpo_alpha * chosen[0] / chosen[1].clamp(min=1)
        values = {"rewards/chosen": reward_c, "rewards/rejected": reward_r, "rewards/margins": reward_c - reward_r,
                  "rewards/accuracies": (reward_c > reward_r).double(), "logps/chosen": pi_c,
                  "logps/rejected": pi_r}  # fmt: skip
        return losses, values

    def __call__(
        self,
        output: torch.Tensor,
        batch: Mapping[str, Any],
        sp_group: dist.ProcessGroup | None = None,
        mean_logits: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """{"pref_loss": this shard's placed pair losses over its valid `pref_labels` entries (an exact 0 without
        any), "metrics": {name: (total, pairs)} of the pairs anchored on this shard}. `output` [B, S]: the model's
        log-probability of each `pref_labels` target (DPO family; `LogprobRequest`, 0 where ignored) or its
        per-position scores (bradley_terry). kto with `mean_logits` [B, S] (the policy's mean logit over the
        vocabulary at each position, `LogprobRequest.mean_logits`): also `logits/chosen` and `logits/rejected`,
        {(sum over this shard's completion targets of desirable / undesirable rows, their count)}, TRL's
        KTOTrainer's token-weighted means. Collective over `sp_group` (every shard calls it alike)."""
        device = output.device
        labels = batch[PREF_LABELS].to(device)
        valid = labels != IGNORE_INDEX
        ids = torch.where(valid, batch[SEQUENCE_IDS].to(device), -1)

        def per_position(key: str) -> torch.Tensor:
            value = batch.get(key)
            return torch.zeros_like(labels, dtype=torch.float64) if value is None else value.to(device, torch.float64)

        if self.loss == "bradley_terry":
            channels = [torch.where(valid, output.double(), 0.0), per_position(MARGINS)]
        else:
            channels = [torch.where(valid, output.double(), 0.0), valid.double(), per_position(REF_LOGPROBS)]
            if self.loss == "kto":
                channels.append(per_position(KTO_LABELS))
        z0 = batch[KL].to(device, torch.float64) if self.loss == "kto" else 0.0
        totals = sequence_totals(torch.stack(channels), ids, sp_group)
        pairs = totals.shape[1] // 2
        losses, values = self.pair_losses(totals[:, 0 : 2 * pairs : 2], totals[:, 1 : 2 * pairs : 2], z0)
        anchors = batch[PREF_STARTS].to(device).bool() & valid
        pair = ids.clamp(min=0) // 2
        placed = torch.where(anchors, losses[pair], 0.0)
        loss = placed.sum() / valid.sum().clamp(min=1)
        with torch.no_grad():
            count, metrics = anchors.sum().double(), {}
            for name, value in values.items():
                value, weight = value if isinstance(value, tuple) else (value, None)
                if weight is None:
                    metrics[name] = (torch.where(anchors, value[pair], 0.0).sum(), count)
                else:
                    weight = torch.where(anchors, weight[pair], 0.0)
                    metrics[name] = ((weight * value.detach()[pair]).sum(), weight.sum())
            if self.loss == "kto" and mean_logits is not None:  # per completion token (sequence 2p), by row label
                completion = valid & (ids % 2 == 0)
                desirable = totals[3, 0 : 2 * pairs : 2][pair] > 0.5
                logits = torch.where(completion, mean_logits.detach().to(device, torch.float64), 0.0)
                for name, side in (("logits/chosen", desirable), ("logits/rejected", ~desirable)):
                    mask = completion & side
                    metrics[name] = (torch.where(mask, logits, 0.0).sum(), mask.sum().double())
        return {f"{PREF}_loss": loss.to(torch.promote_types(output.dtype, torch.float32)), "metrics": metrics}
