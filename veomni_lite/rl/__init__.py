"""Online RL post-training (GRPO family): rollout engines, rewards, advantages and policy losses on the exact core."""
