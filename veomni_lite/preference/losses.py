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

Each loss is one registered function (`register_pair_loss`), `fn(chosen, rejected, z0, **hyperparameters) ->
(losses [P], {metric: [P] values, or ([P] values, [P] weights) for a metric over some pairs})` of the sides' complete
totals [K, P] (policy log-prob sum, response tokens, reference log-prob sum; unpaired: and the row's label; a reward
model: score, margin) and kto's reference point z0, registered with its metric names, `needs_reference`, its
hyperparameters (`PrefConfig` fields, with their defaults), `curves` (the metrics of accuracy_curve.png) and, where
not the default, `scores=True` (a reward model: one score per sequence) or `paired=False` (unpaired rows, each with a
mismatched completion, and the step's z0), `differences` (see `metric_differences`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS, seq_starts_key
from veomni_lite.post_training import sequence_totals
from veomni_lite.registries import Entry, Registry

PREF = "pref"  # the head's name: `pref_labels`, `pref_loss`
PREF_MODE = "seq-mean-token-sum"  # the head's loss mode, always: the mean over the step's pairs
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
    "PAIR_LOSSES",
    "PREF",
    "PREF_LABELS",
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
    "register_pair_loss",
]

PAIR_LOSSES = Registry("pair loss")
register_pair_loss = PAIR_LOSSES.register  # `pref.loss` (see the module docstring for the function's contract)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable (TRL's ORPO helper: the branch at -log 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def metric_names(loss: str) -> tuple[str, ...]:
    """The metrics `pref.loss` logs (TRL's names)."""
    return PAIR_LOSSES.get(loss, "pref.loss").metrics


def metric_differences(loss: str) -> dict[str, tuple[str, str]]:
    """The metrics `pref.loss` logs as the difference of two of its recorded means ({name: (a, b)}: a - b, logged
    when both have a count in the window; registered as `differences`); kto's `rewards/margins`, as TRL's
    KTOTrainer."""
    return dict(PAIR_LOSSES.get(loss, "pref.loss").extra.get("differences", {}))


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


Values = dict[str, Any]  # {metric: [P] values, or ([P] values, [P] weights)}
DPO = {"beta": 0.1, "rpo_alpha": 0.0}  # the DPO family's hyperparameters
ACCURACIES = ("rewards/accuracies", "eval/rewards/accuracies")  # `curves`: accuracy_curve.png's metrics


def _logps(
    chosen: torch.Tensor, rejected: torch.Tensor, averaged: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pi_c, pi_r, ref_c, ref_r) [P]: the sides' summed log-probabilities, or `averaged` over the response tokens."""
    pi_c, pi_r, ref_c, ref_r = chosen[0], rejected[0], chosen[2], rejected[2]
    if averaged:
        n_c, n_r = chosen[1].clamp(min=1), rejected[1].clamp(min=1)
        pi_c, pi_r, ref_c, ref_r = pi_c / n_c, pi_r / n_r, ref_c / n_c, ref_r / n_r
    return pi_c, pi_r, ref_c, ref_r


def _dpo_family(
    losses: torch.Tensor, rewards: tuple[torch.Tensor, torch.Tensor], logps: tuple[torch.Tensor, torch.Tensor],
    chosen: torch.Tensor, rpo_alpha: float,
) -> tuple[torch.Tensor, Values]:  # fmt: skip
    """The losses with RPO's NLL term (`rpo_alpha` x the chosen side's mean NLL per token) and the family's metrics."""
    if rpo_alpha:
        losses = losses - rpo_alpha * chosen[0] / chosen[1].clamp(min=1)
    (reward_c, reward_r), (pi_c, pi_r) = rewards, logps
    return losses, {"rewards/chosen": reward_c, "rewards/rejected": reward_r, "rewards/margins": reward_c - reward_r,
                    "rewards/accuracies": (reward_c > reward_r).double(), "logps/chosen": pi_c,
                    "logps/rejected": pi_r}  # fmt: skip


@register_pair_loss("sigmoid", metrics=DPO_METRICS, needs_reference=True, curves=ACCURACIES,
                    hyperparameters={**DPO, "label_smoothing": 0.0})  # fmt: skip
def sigmoid(
    chosen: torch.Tensor, rejected: torch.Tensor, z0: Any, beta: float, rpo_alpha: float, label_smoothing: float
) -> tuple[torch.Tensor, Values]:
    """DPO (cDPO with label smoothing s): -log sig(b h) (1 - s) - log sig(-b h) s."""
    pi_c, pi_r, ref_c, ref_r = _logps(chosen, rejected)
    h, s = (pi_c - ref_c) - (pi_r - ref_r), label_smoothing
    losses = -F.logsigmoid(beta * h) * (1 - s) - F.logsigmoid(-beta * h) * s
    return _dpo_family(losses, (beta * (pi_c - ref_c), beta * (pi_r - ref_r)), (pi_c, pi_r), chosen, rpo_alpha)


@register_pair_loss("ipo", metrics=DPO_METRICS, needs_reference=True, curves=ACCURACIES, hyperparameters=DPO)
def ipo(
    chosen: torch.Tensor, rejected: torch.Tensor, z0: Any, beta: float, rpo_alpha: float
) -> tuple[torch.Tensor, Values]:
    """IPO: (h - 1 / (2 b))^2 of the log-probabilities averaged over the response tokens."""
    pi_c, pi_r, ref_c, ref_r = _logps(chosen, rejected, averaged=True)
    h = (pi_c - ref_c) - (pi_r - ref_r)
    losses = (h - 1 / (2 * beta)) ** 2
    return _dpo_family(losses, (beta * (pi_c - ref_c), beta * (pi_r - ref_r)), (pi_c, pi_r), chosen, rpo_alpha)


@register_pair_loss("hinge", metrics=DPO_METRICS, needs_reference=True, curves=ACCURACIES, hyperparameters=DPO)
def hinge(
    chosen: torch.Tensor, rejected: torch.Tensor, z0: Any, beta: float, rpo_alpha: float
) -> tuple[torch.Tensor, Values]:
    """SLiC's hinge: max(0, 1 - b h)."""
    pi_c, pi_r, ref_c, ref_r = _logps(chosen, rejected)
    losses = torch.relu(1 - beta * ((pi_c - ref_c) - (pi_r - ref_r)))
    return _dpo_family(losses, (beta * (pi_c - ref_c), beta * (pi_r - ref_r)), (pi_c, pi_r), chosen, rpo_alpha)


@register_pair_loss(
    "simpo", metrics=DPO_METRICS, curves=ACCURACIES, hyperparameters={**DPO, "label_smoothing": 0.0, "gamma": 0.5}
)
def simpo(
    chosen: torch.Tensor, rejected: torch.Tensor, z0: Any, beta: float, rpo_alpha: float, label_smoothing: float,
    gamma: float,
) -> tuple[torch.Tensor, Values]:  # fmt: skip
    """SimPO (reference-free): -log sig(b (pi_c - pi_r) - gamma) (1 - s) - ..., log-probabilities averaged."""
    pi_c, pi_r, _, _ = _logps(chosen, rejected, averaged=True)
    logits, s = beta * (pi_c - pi_r) - gamma, label_smoothing
    losses = -F.logsigmoid(logits) * (1 - s) - F.logsigmoid(-logits) * s
    return _dpo_family(losses, (beta * pi_c, beta * pi_r), (pi_c, pi_r), chosen, rpo_alpha)


@register_pair_loss("bradley_terry", metrics=RM_METRICS, hyperparameters={"center_rewards": 0.0}, scores=True,
                    curves=("rewards/accuracy", "eval/rewards/accuracy"))  # fmt: skip
def bradley_terry(
    chosen: torch.Tensor, rejected: torch.Tensor, z0: Any, center_rewards: float
) -> tuple[torch.Tensor, Values]:
    """A reward model's: -log sig(r_c - r_r - margin) + c (r_c + r_r)^2 of the sides' (score, margin)."""
    r_c, r_r, margin = chosen[0], rejected[0], chosen[1]
    losses = -F.logsigmoid(r_c - r_r - margin) + center_rewards * (r_c + r_r) ** 2
    return losses, {"rewards/chosen": r_c, "rewards/rejected": r_r, "rewards/margins": r_c - r_r,
                    "rewards/accuracy": (r_c > r_r).double(), "rewards/mean": (r_c + r_r) / 2}  # fmt: skip


@register_pair_loss("kto", metrics=KTO_METRICS, needs_reference=True, paired=False, differences=KTO_DIFFERENCES,
                    curves=("rewards/chosen", "rewards/rejected"),
                    hyperparameters={"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0})  # fmt: skip
def kto(
    chosen: torch.Tensor, rejected: torch.Tensor, z0: Any, beta: float, desirable_weight: float,
    undesirable_weight: float,
) -> tuple[torch.Tensor, Values]:  # fmt: skip
    """KTO of each row (its side 2p; `rejected` is the mismatched side, read by z0's pass only)."""
    pi, ref, desirable = chosen[0], chosen[2], chosen[3] > 0.5
    d = pi - ref
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (d - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - d))))  # fmt: skip
    yes, no = desirable.double(), (~desirable).double()
    return losses, {"kl": torch.zeros_like(pi) + z0, "rewards/chosen": (beta * d, yes),
                    "rewards/rejected": (beta * d, no), "logps/chosen": (pi, yes),
                    "logps/rejected": (pi, no)}  # fmt: skip


@register_pair_loss("orpo", metrics=ORPO_METRICS, curves=ACCURACIES, hyperparameters={"orpo_lambda": 0.1})
def orpo(chosen: torch.Tensor, rejected: torch.Tensor, z0: Any, orpo_lambda: float) -> tuple[torch.Tensor, Values]:
    """ORPO (reference-free): -l_c - lambda log sig(log odds_c - log odds_r), l the mean log-prob per token."""
    l_c, l_r = chosen[0] / chosen[1].clamp(min=1), rejected[0] / rejected[1].clamp(min=1)
    log_odds = (l_c - l_r) - (log1mexp(l_c) - log1mexp(l_r))
    ratio = F.logsigmoid(log_odds)
    losses = -l_c - orpo_lambda * ratio
    reward_c, reward_r = orpo_lambda * l_c, orpo_lambda * l_r
    accuracies = (reward_c > reward_r).double()
    return losses, {"rewards/chosen": reward_c, "rewards/rejected": reward_r,
                    "rewards/margins": reward_c - reward_r, "rewards/accuracies": accuracies,
                    "logps/chosen": l_c, "logps/rejected": l_r, "nll_loss": -l_c, "log_odds_ratio": ratio,
                    "log_odds_chosen": log_odds}  # fmt: skip


@dataclass(frozen=True)
class PreferenceLoss:
    """The head (see the module docstring) of the registered pair loss `loss` with its `hyperparameters` (over the
    registered defaults)."""

    loss: str = "sigmoid"
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.hyperparameters) - set(self.entry.hyperparameters)
        if unknown:
            raise ValueError(f"pair loss {self.loss!r} takes {list(self.entry.hyperparameters)}, not {sorted(unknown)}")

    @classmethod
    def of(cls, pref: Any) -> PreferenceLoss:
        """From the `pref` section (a `PrefConfig`): the loss's hyperparameters, each its field of the same name."""
        return cls(pref.loss, PAIR_LOSSES.get(pref.loss, "pref.loss").read(pref))

    @property
    def entry(self) -> Entry:
        """The registered pair loss (`PAIR_LOSSES`)."""
        return PAIR_LOSSES.get(self.loss, "pref.loss")

    @property
    def scores(self) -> bool:
        """A reward model's loss: the model scores each sequence (at its last token) instead of its tokens."""
        return bool(self.entry.extra.get("scores", False))

    @property
    def paired(self) -> bool:
        """Pairs (chosen, rejected); else unpaired rows, each with a mismatched completion and the step's z0."""
        return bool(self.entry.extra.get("paired", True))

    def pair_losses(
        self, chosen: torch.Tensor, rejected: torch.Tensor, z0: torch.Tensor | float = 0.0
    ) -> tuple[torch.Tensor, Values]:
        """Each pair's loss L_p [P] and metric values from the sides' complete totals [K, P] (the registered
        function's contract, see the module docstring). `z0`: an unpaired loss's reference point."""
        entry = self.entry
        return entry.fn(chosen, rejected, z0, **{**entry.hyperparameters, **self.hyperparameters})

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

        if self.scores:
            channels = [torch.where(valid, output.double(), 0.0), per_position(MARGINS)]
        else:
            channels = [torch.where(valid, output.double(), 0.0), valid.double(), per_position(REF_LOGPROBS)]
            if not self.paired:
                channels.append(per_position(KTO_LABELS))
        z0 = 0.0 if self.paired else batch[KL].to(device, torch.float64)
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
            if mean_logits is not None:  # unpaired: per completion token (sequence 2p), by row label
                completion = valid & (ids % 2 == 0)
                desirable = totals[3, 0 : 2 * pairs : 2][pair] > 0.5
                logits = torch.where(completion, mean_logits.detach().to(device, torch.float64), 0.0)
                for name, side in (("logits/chosen", desirable), ("logits/rejected", ~desirable)):
                    mask = completion & side
                    metrics[name] = (torch.where(mask, logits, 0.0).sum(), mask.sum().double())
        return {f"{PREF}_loss": loss.to(torch.promote_types(output.dtype, torch.float32)), "metrics": metrics}
