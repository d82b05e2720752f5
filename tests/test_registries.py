"""`veomni_lite.registries.Registry`: registration, lookup, and the did-you-mean error of an unknown name."""

import pytest

from veomni_lite.config import ConfigError
from veomni_lite.registries import Registry


def test_registry_registers_and_names_an_unknown_entry() -> None:
    losses = Registry("policy loss")

    @losses.register("ppo_clip", metrics=("rl/clip_fraction",), needs_reference=True, hyperparameters={"clip": 0.2})
    def ppo_clip(x: float) -> float:
        return 2 * x

    entry = losses.get("ppo_clip", "rl.policy_loss")
    assert entry.fn(3.0) == 6.0 and entry.metrics == ("rl/clip_fraction",) and entry.needs_reference
    assert entry.hyperparameters == {"clip": 0.2} and not entry.needs_critic
    assert "ppo_clip" in losses and losses.names() == ["ppo_clip"]
    with pytest.raises(ConfigError, match=r"rl.policy_loss: unknown policy loss 'ppo_clp' \(did you mean `ppo_clip`"):
        losses.get("ppo_clp", "rl.policy_loss")
    with pytest.raises(ValueError, match="registered twice"):
        losses.register("ppo_clip")(ppo_clip)
