"""The RL trainer's loader (`RolloutLoader`): optimizer steps sliced from rollout batches, resumable inside a batch.

Step s is optimizer step s mod `steps_per_rollout` of rollout batch s // `steps_per_rollout`, and trains mini-batch
s mod `minibatches` of it. The loader asks the pipeline (`veomni_lite.rl.pipeline.RolloutPipeline.make`) for each
batch when its first step is fetched and slices it; it makes nothing itself. State: the step, the current batch's
samples when a checkpoint falls inside it, and the prompt block the next rollout batch starts at
(`rl.dynamic_sampling`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from veomni_lite.rl.pipeline import RolloutBatch, RolloutPipeline
from veomni_lite.rl.rollouts import RolloutSample

__all__ = ["RolloutLoader"]


class RolloutLoader:
    """See the module docstring. `steps_per_epoch`: optimizer steps per pass over the prompts (or the given
    rollouts); `max_steps`: the run's length (set by the trainer; a batch past it starts no background generation);
    `trained`: the optimizer steps the trainer has finished (an interrupt may have fetched one more);
    `made`: the batch made for the latest fetched step, until `take_made`."""

    def __init__(self, pipeline: RolloutPipeline, rollouts_per_epoch: int) -> None:
        self.pipeline = pipeline
        self.minibatches = pipeline.context.minibatches
        self.steps_per_rollout = pipeline.context.steps_per_rollout
        self.steps_per_epoch = rollouts_per_epoch * self.steps_per_rollout if rollouts_per_epoch else None
        self.max_steps: int | None = None
        self.step = self.trained = 0
        self.batch: RolloutBatch | None = None  # the current rollout batch
        self.made: RolloutBatch | None = None
        self._restored: list[RolloutSample] | None = None  # a checkpoint's, for the batch it fell inside

    @property
    def epoch(self) -> int:
        """Pass over the prompts (or given rollouts) of the most recently produced step (0 before the first)."""
        return max(self.step - 1, 0) // self.steps_per_epoch if self.steps_per_epoch else 0

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next optimizer step (its rollout batch made first where it starts one)."""
        k, position = divmod(self.step, self.steps_per_rollout)
        if self.batch is None or self.batch.index != k:
            restored, self._restored = self._restored, None
            last = None if self.max_steps is None else (self.max_steps - 1) // self.steps_per_rollout
            self.batch = self.made = self.pipeline.make(k, self.step, last, restored)
        self.step += 1
        return [dict(micro_batch) for micro_batch in self.batch.micro_batches[position % self.minibatches]]

    def take_made(self) -> RolloutBatch | None:
        """The batch made for the latest fetched step (None: that step continued a batch), once."""
        made, self.made = self.made, None
        return made

    def state_dict(self) -> dict[str, Any]:
        """The trained steps, when the last trained step fell inside a rollout batch that batch's samples, and under
        `rl.async_steps` the blocks generating ahead (collected first: collective) (plain data, the same on every
        rank)."""
        trained = self.trained
        inside = trained % self.steps_per_rollout != 0 and self.batch is not None
        last = (trained - 1) // self.steps_per_rollout  # the rollout batch of the last trained step (-1: none)
        queue = self.pipeline.source.queue
        return {
            "step": trained,
            "samples": [s.plain() for s in self.batch.samples] if inside else None,
            "prompt_block": self.pipeline.source.start_block(self.pipeline.context, last + 1),
            **({"queue": queue.state(self.pipeline.context)} if queue is not None else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = self.trained = int(state["step"])
        self.batch = self.made = None
        last = (self.step - 1) // self.steps_per_rollout
        self.pipeline.source.block_ends = {last: int(state.get("prompt_block", last + 1))}
        queue = self.pipeline.source.queue
        if queue is not None:  # a checkpoint without it (or of k = 0): the blocks ahead are generated anew
            queue.load(self.pipeline.context, state.get("queue", []))
        samples = state.get("samples")
        self._restored = [RolloutSample(**s) for s in samples] if samples is not None else None

    def close(self) -> None:
        """Nothing runs in the background of this loader (the engine's generation is the trainer's to stop)."""
