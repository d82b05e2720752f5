"""The `pref` config section of `trainers/train_preference.py` (read with `load_config(..., sections={"pref":
PrefConfig})`): the preference loss and its settings, each field naming TRL's default it follows (the losses:
`veomni_lite.preference.losses`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from veomni_lite.config import ConfigError
from veomni_lite.preference.losses import PAIR_LOSSES, PREF, PREF_MODE
from veomni_lite.registries import Entry

__all__ = ["PREF", "PREF_MODE", "PrefConfig"]


@dataclass
class PrefConfig:
    """Preference training (`trainers/train_preference.py`): the `pref` section (`veomni_lite.preference.losses`)."""

    loss: str = "sigmoid"
    """A registered pair loss (`veomni_lite.preference.losses`, `register_pair_loss`): sigmoid (DPO), ipo, hinge,
    simpo (reference-free), bradley_terry (a reward model: one score per sequence), kto (unpaired rows {prompt,
    completion, label}; TRL's KTOTrainer) or orpo (reference-free; TRL's ORPOTrainer). TRL's DPOTrainer default:
    sigmoid."""
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
    def entry(self) -> Entry:
        """The registered pair loss `loss` names (a ConfigError with the closest name if none)."""
        return PAIR_LOSSES.get(self.loss, "pref.loss")

    @property
    def needs_reference(self) -> bool:
        """The loss reads the frozen reference's log-probabilities (its entry's flag)."""
        return self.entry.needs_reference

    def validate(self, config: Any) -> None:
        """Cross-field checks (ConfigError naming the key)."""
        read = self.entry.hyperparameters  # a hyperparameter off its default that pref.loss does not read is an error

        def readers(key: str) -> str:
            return ", ".join(n for n in PAIR_LOSSES.names() if key in PAIR_LOSSES.get(n, "pref.loss").hyperparameters)

        if not self.beta > 0:
            raise ConfigError(f"pref.beta: must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"pref.label_smoothing: must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and "label_smoothing" not in read:
            raise ConfigError(f"pref.label_smoothing: applies to {readers('label_smoothing')}, not {self.loss}")
        if self.center_rewards < 0 or (self.center_rewards and "center_rewards" not in read):
            raise ConfigError(f"pref.center_rewards: a coefficient >= 0 of pref.loss {readers('center_rewards')}")
        if self.rpo_alpha < 0 or (self.rpo_alpha and "rpo_alpha" not in read):
            raise ConfigError(
                f"pref.rpo_alpha: a coefficient >= 0 of pref.loss {readers('rpo_alpha')}, not {self.loss}"
            )
        for key in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, key)
            if not value > 0 or (value != 1.0 and key not in read):
                raise ConfigError(f"pref.{key}: a weight > 0 of pref.loss {readers(key)}, got {value} (pref.loss "
                                  f"{self.loss})")  # fmt: skip
        if self.orpo_lambda < 0 or (self.orpo_lambda != 0.1 and "orpo_lambda" not in read):
            raise ConfigError(f"pref.orpo_lambda: a weight >= 0 of pref.loss {readers('orpo_lambda')}, got "
                              f"{self.orpo_lambda}")  # fmt: skip
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
