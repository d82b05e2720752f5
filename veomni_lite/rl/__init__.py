"""Online RL (GRPO family) on the exact loss core (docs/rl.md): `config` (the `rl` section), `prompts` (prompts from
the user's files), `rewards` and `advantages`, `rollouts` (a rollout batch as layout-free samples; given rollouts),
`policy_loss` (the `policy` head), `pipeline` (a rollout batch's stages, in order, from a context that holds no
trainer), `trainer` (`RLTrainer` on the one train loop; entry point `trainers/train_rl.py`).
The rollout engines are `veomni_lite.engines`, preference training `veomni_lite.preference`, what both trainers share
`veomni_lite.post_training`. `register_advantage`, `register_policy_loss` and `register_is_correction` add an algorithm
`rl.advantage` / `rl.policy_loss` / `rl.importance_sampling` can name (docs/architecture.md, "Adding an algorithm").
"""

from veomni_lite.rl.advantages import register_advantage
from veomni_lite.rl.policy_loss import register_is_correction, register_policy_loss

__all__ = ["register_advantage", "register_is_correction", "register_policy_loss"]
