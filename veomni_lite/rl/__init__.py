"""Post-training: online RL (GRPO family) and preference training (DPO family, reward models) on the exact loss core.

`config` (the `rl` section), `prompts` (prompts from the user's files), `engine` (rollout engines), `rewards` and
`advantages`, `rollouts` (a rollout batch as samples; given rollouts), `policy_loss` (the `policy` head), `sequence`
(sequence-level sums exact under packing and SP), `reference` (the frozen reference), `weights` (the policy's weights
for an engine), `trainer` (`RLTrainer` on the one train loop; entry point `trainers/train_rl.py`). Preference training:
`preference` (the `pref` head, exact per pair, and the `pref` section), `preference_data` (pairs from the user's files),
`preference_trainer` (`PreferenceTrainer`; entry point `trainers/train_preference.py`).
"""
