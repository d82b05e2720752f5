"""The RL trainer's loader (`RolloutLoader`): optimizer steps from rollout batches, resumable inside a batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from veomni_lite.data.loader import StepLoader
from veomni_lite.rl.rollouts import RolloutSample

__all__ = ["RolloutLoader"]


class RolloutLoader(StepLoader):
    """The RL trainer's loader: step s is optimizer step s mod `steps_per_rollout` of rollout batch s //
    `steps_per_rollout` (see `veomni_lite.rl.trainer`). State: the step, the current batch's samples when a
    checkpoint falls inside it, and the prompt block the next rollout batch starts at (`rl.dynamic_sampling`)."""

    def __init__(self, trainer: Any) -> None:
        config = trainer.config
        super().__init__(
            trainer.collate, config.train.global_batch_size, config.train.micro_batch_size, trainer.parallel.dp_size,
            trainer.parallel.dp_rank, 0, config.data.max_tokens_per_micro_batch, config.data.packing,
        )  # fmt: skip
        self.trainer, self.rl = trainer, config.rl
        self.minibatches = self.rl.rollout_size // config.train.global_batch_size
        self.steps_per_rollout = self.rl.epochs * self.minibatches
        per_epoch = trainer.rollouts_per_epoch
        self.steps_per_epoch = per_epoch * self.steps_per_rollout if per_epoch else None
        self.samples: list[RolloutSample] | None = None  # the current rollout batch's
        self._restored: list[RolloutSample] | None = None  # a checkpoint's, for the batch it fell inside
        self.batch_index = -1
        self._micro_batches: list[list[dict[str, torch.Tensor]]] = []

    @property
    def epoch(self) -> int:
        """Pass over the prompts (or given rollouts) of the most recently produced step (0 before the first)."""
        return max(self.step - 1, 0) // self.steps_per_epoch if self.steps_per_epoch else 0

    def _produce(self, step: int) -> list[dict[str, torch.Tensor]]:
        k, position = divmod(step, self.steps_per_rollout)
        if k != self.batch_index:
            restored, self._restored = self._restored, None
            self.samples = restored if restored is not None else self.trainer.rollouts.make(k)
            self._micro_batches = self.trainer.passes.prepare(self.samples, self)
            self.batch_index = k
        return [dict(micro_batch) for micro_batch in self._micro_batches[position % self.minibatches]]

    def plan(self, minibatch: int, samples: Sequence[RolloutSample]) -> list[list[int]]:
        """This rank's micro-batches of mini-batch `minibatch`, as indices into `samples` (the mini-batch's)."""
        return self.share(minibatch, list(range(len(samples))), lambda i: len(samples[i]))

    def state_dict(self) -> dict[str, Any]:
        """The step and, when the trainer's last step fell inside a rollout batch, that batch's samples (plain data,
        the same on every rank). The trainer's step, not this loader's: an interrupt may have fetched one more."""
        trained = self.trainer.step
        inside = trained % self.steps_per_rollout != 0 and self.samples is not None
        last = (trained - 1) // self.steps_per_rollout  # the rollout batch of the last trained step (-1: none)
        return {
            "step": trained,
            "samples": [s.plain() for s in self.samples] if inside else None,
            "prompt_block": self.trainer.rollouts.start_block(last + 1),  # dynamic sampling: the next batch's first
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step, self.batch_index = int(state["step"]), -1
        last = (self.step - 1) // self.steps_per_rollout
        self.trainer.rollouts.block_ends = {last: int(state.get("prompt_block", last + 1))}
        samples = state.get("samples")
        self._restored = [RolloutSample(**s) for s in samples] if samples is not None else None
