"""The `pref` config section of `trainers/train_preference.py` (read with `load_config(..., sections={"pref":
PrefConfig})`): the preference loss and its settings, each field naming TRL's default it follows (the losses:
`veomni_lite.preference.losses`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from veomni_lite.config import ConfigError

__all__ = ["PREF", "PREF_LOSSES", "PREF_MODE", "PrefConfig"]

PREF = "pref"  # the head's name: `pref_labels`, `pref_loss`
PREF_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "bradley_terry", "kto", "orpo")
PREF_MODE = "seq-mean-token-sum"  # the head's loss mode, always: the mean over the step's pairs


@dataclass
class PrefConfig:
    """Preference training (`trainers/train_preference.py`): the `pref` section (`veomni_lite.preference.losses`)."""

    loss: Literal["sigmoid", "ipo", "hinge", "simpo", "bradley_terry", "kto", "orpo"] = "sigmoid"
    """sigmoid (DPO), ipo, hinge, simpo (reference-free), bradley_terry (a reward model: one score per sequence), kto
    (unpaired rows {prompt, completion, label}; TRL's KTOTrainer) or orpo (reference-free; TRL's ORPOTrainer). TRL's
    DPOTrainer default: sigmoid."""
    beta: float = 0.1
    """The inverse temperature of the implicit reward (TRL's DPO, KTO and CPO/SimPO default 0.1; the SimPO paper uses 2
    to 2.5 with gamma / beta 0.5). Not ORPO's: that is `orpo_lambda`."""
    gamma: float = 0.5
    """SimPO's target reward margin gamma (TRL's simpo_gamma 0.5)."""
    label_smoothing: float = 0.0
    """The probability that a pair's labels are flipped (conservative DPO, cDPO; sigmoid and simpo; TRL's 0)."""
    precompute_reference: bool = False
    """Compute the reference log-probabilities once before training, kept per pair in a file beside the data cache,
    instead of a reference forward per micro-batch (TRL's precompute_ref_log_probs, default off)."""
    center_rewards: float = 0.0
    """bradley_terry: the coefficient c of c (r_c + r_r)^2, which centers the rewards on 0 (TRL's
    center_rewards_coefficient, default None = 0; its docs suggest 0.01)."""
    rpo_alpha: float = 0.0
    """The DPO family: add alpha x the chosen response's negative log-likelihood per token to each pair's loss (RPO,
    Pang et al. 2024, whose alpha is 1; TRL's rpo_alpha, default None = 0, averages it over the batch's chosen tokens
    instead of per pair). Keeps the chosen responses likely while the margins grow."""

    desirable_weight: float = 1.0
    """kto: the weight of a desirable row's loss (label true; TRL's KTOConfig desirable_weight, default 1.0). TRL
    suggests weights with desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in [1, 4/3]."""
    undesirable_weight: float = 1.0
    """kto: the weight of an undesirable row's loss (label false; TRL's undesirable_weight, default 1.0)."""
    orpo_lambda: float = 0.1
    """orpo: lambda, the weight of the odds-ratio term beside the chosen response's NLL, also the scale of the logged
    rewards lambda x log-prob (TRL's ORPOConfig names it beta, default 0.1; the ORPO paper's lambda)."""

    @property
    def reward_model(self) -> bool:
        return self.loss == "bradley_terry"

    @property
    def kto(self) -> bool:
        """Unpaired rows: each sample is (prompt + completion, prompt + a mismatched completion), see pairs.py."""
        return self.loss == "kto"

    @property
    def needs_reference(self) -> bool:
        return self.loss in ("sigmoid", "ipo", "hinge", "kto")

    def validate(self, config: Any) -> None:
        """Cross-field checks (ConfigError naming the key)."""
        if self.loss not in PREF_LOSSES:
            raise ConfigError(f"pref.loss: {self.loss!r} is not one of {list(PREF_LOSSES)}")
        if not self.beta > 0:
            raise ConfigError(f"pref.beta: must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"pref.label_smoothing: must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss not in ("sigmoid", "simpo"):
            raise ConfigError(f"pref.label_smoothing: applies to sigmoid and simpo, not {self.loss}")
        if self.center_rewards < 0 or (self.center_rewards and not self.reward_model):
            raise ConfigError("pref.center_rewards: a coefficient >= 0 of pref.loss bradley_terry")
        if self.rpo_alpha < 0 or (self.rpo_alpha and self.loss in ("bradley_terry", "kto", "orpo")):
            raise ConfigError("pref.rpo_alpha: a coefficient >= 0 of the DPO family (not bradley_terry, kto, orpo)")
        for key in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, key)
            if not value > 0 or (value != 1.0 and self.loss != "kto"):
                raise ConfigError(f"pref.{key}: a weight > 0 of pref.loss kto, got {value} (pref.loss {self.loss})")
        if self.orpo_lambda < 0 or (self.orpo_lambda != 0.1 and self.loss != "orpo"):
            raise ConfigError(f"pref.orpo_lambda: a weight >= 0 of pref.loss orpo, got {self.orpo_lambda}")
        if self.precompute_reference and not self.needs_reference:
            raise ConfigError(f"pref.precompute_reference: pref.loss {self.loss} has no reference")
        if config.data.format != "preference":
            raise ConfigError(f"data.format: preference training reads pairs (data.format: preference), not "
                              f"{config.data.format!r}")  # fmt: skip
        for key, value in (("data.sources", config.data.sources), ("data.streaming", config.data.streaming)):
            if value:
                raise ConfigError(f"{key}: preference training reads data.train_path (and data.eval_path) whole")
        modes = getattr(config, "loss", None)
        per_head = dict(getattr(modes, "modes", None) or {})
        if per_head.get(PREF, PREF_MODE) != PREF_MODE:
            raise ConfigError(f"loss.modes.{PREF}: the preference head is a mean over pairs ({PREF_MODE}), always")
