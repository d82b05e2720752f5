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
and, with `rpo_alpha` a, the DPO family adds a x the chosen side's mean negative log-likelihood per token (RPO).
Metrics (TRL's names, pair-weighted): `rewards/chosen` b (pi_c - ref_c) (simpo: b pi_c), `rewards/rejected`,
`rewards/margins`, `rewards/accuracies` (chosen reward > rejected), `logps/chosen`, `logps/rejected`; a reward
model: `rewards/chosen` r_c, `rewards/rejected`, `rewards/margins`, `rewards/accuracy`, `rewards/mean` (r_c + r_r) / 2.
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
RM_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "rewards/mean")

__all__ = [
    "DPO_METRICS",
    "MARGINS",
    "PREF",
    "PREF_LABELS",
    "PREF_LOSSES",
    "PREF_MODE",
    "PREF_STARTS",
    "REF_LOGPROBS",
    "RM_METRICS",
    "PreferenceLoss",
]


@dataclass(frozen=True)
class PreferenceLoss:
    """The loss settings (from `PrefConfig`) and the head itself (see the module docstring)."""

    loss: str = "sigmoid"
    beta: float = 0.1
    gamma: float = 0.5
    label_smoothing: float = 0.0
    center_rewards: float = 0.0
    rpo_alpha: float = 0.0

    @classmethod
    def of(cls, pref: PrefConfig) -> PreferenceLoss:
        return cls(pref.loss, pref.beta, pref.gamma, pref.label_smoothing, pref.center_rewards, pref.rpo_alpha)

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each pair's loss L_p [P] and metric values {name: [P]} from the sides' complete totals [K, P]: (policy
        log-prob sum, response tokens, reference log-prob sum), or (reward, margin) for bradley_terry."""
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
        self, output: torch.Tensor, batch: Mapping[str, Any], sp_group: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """{"pref_loss": this shard's placed pair losses over its valid `pref_labels` entries (an exact 0 without
        any), "metrics": {name: (total, pairs)} of the pairs anchored on this shard}. `output` [B, S]: the model's
        log-probability of each `pref_labels` target (DPO family; `LogprobRequest`, 0 where ignored) or its
        per-position scores (bradley_terry). Collective over `sp_group` (every shard calls
        it alike)."""
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
        totals = sequence_totals(torch.stack(channels), ids, sp_group)
        pairs = totals.shape[1] // 2
        losses, values = self.pair_losses(totals[:, 0 : 2 * pairs : 2], totals[:, 1 : 2 * pairs : 2])
        anchors = batch[PREF_STARTS].to(device).bool() & valid
        pair = ids.clamp(min=0) // 2
        placed = torch.where(anchors, losses[pair], 0.0)
        loss = placed.sum() / valid.sum().clamp(min=1)
        with torch.no_grad():
            count = anchors.sum().double()
            metrics = {name: (torch.where(anchors, value[pair], 0.0).sum(), count) for name, value in values.items()}
        return {f"{PREF}_loss": loss.to(torch.promote_types(output.dtype, torch.float32)), "metrics": metrics}
