"""The RL step's dataflow as one visible sequence of stages: `RolloutPipeline.make(k, step)` makes rollout batch k.

    generate -> score -> gather      `RolloutSource.collect` (`rollout_batch.py`; dynamic sampling's rounds, async's
                                     background generation, or the given rollouts)
    advantages                       the group / batch advantages (`veomni_lite.rl.advantages`; `gae`: below)
    teacher log-probs                `rl.teacher`: the teacher's of the sampled tokens (`teacher.teacher_logprobs`;
                                     the reverse KL joins the advantage in the loss)
    rollout metrics                  this rank's share (`records.rollout_metrics`)
    plan                             this rank's micro-batches of each mini-batch (`logprob_pass.plan`)
    old / reference log-probs,       one forward pass per micro-batch, every rank the same count
    old values                       (`logprob_pass.fill`; skipped on policy without a reference or critic)
    GAE                              the critic's advantages from the old values (`critic.gae_advantages`)
    engine mismatch metrics          `records.engine_mismatch_metrics` (off policy)
    micro-batches                    collated (`logprob_pass.collate_plans`)

Every stage is a function of the `RolloutContext` (what the stages need, fixed once the model and engine exist: the
engine, tokenizer, rewards, rl config, parallel state, and the policy's collate, SP slice and log-probability
forward, none of them bound to the trainer) and the samples; it returns samples and metric dicts, and never sees the
trainer. `RolloutBatch` is the result: samples, this rank's micro-batches per mini-batch, this rank's metrics, the
generation seconds. The
`RolloutLoader` (`veomni_lite.rl.loader`) only slices batches into optimizer steps and keeps the resume state;
`RLTrainer` builds the context, the pipeline and the loader, and records each batch's metrics with the step that
trains its first part. A batch restored from a checkpoint enters after the generation (`restored`), its samples
holding their rewards, advantages and old log-probabilities.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from veomni_lite.data.loader import StepLoader
from veomni_lite.distributed.parallel_state import ParallelState
from veomni_lite.engines.base import RolloutEngine
from veomni_lite.post_training import ReferenceWeights
from veomni_lite.rl.advantages import ADVANTAGES, estimate
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.critic import Critic, gae_advantages
from veomni_lite.rl.logprob_pass import collate_plans, fill, needs_fill, plan
from veomni_lite.rl.records import engine_mismatch_metrics, rollout_metrics
from veomni_lite.rl.rollout_batch import RolloutSource
from veomni_lite.rl.rollout_queue import RolloutQueue
from veomni_lite.rl.rollouts import RolloutSample, batch_name
from veomni_lite.rl.teacher import teacher_logprobs

__all__ = ["RolloutBatch", "RolloutContext", "RolloutPipeline", "advantages"]


@dataclass(frozen=True)
class RolloutContext:
    """What the pipeline's stages read; none of it is (or holds) the trainer. The policy's functions: `collate`
    (samples' tensors -> one micro-batch), `shard` (a whole micro-batch marked for the loss modes and SP-sliced, as
    the train loop does) and `logprobs` ((sliced micro-batch, temperature) -> [B, S] float64 host log-probabilities
    of its `policy_labels` under the current weights, no grad: `logprob_pass.policy_logprobs`); `planner` cuts a
    mini-batch into this rank's micro-batches (`StepLoader.share`)."""

    rl: RLConfig
    seed: int  # train.seed: the sampling seeds and the prompt order
    parallel: ParallelState
    control_group: Any
    tokenizer: Any
    encoder: Any  # the ChatEncoder: end-of-turn ids, template, image token
    chat_template: bool  # data.chat_template is set (a VL prompt on vLLM carries it)
    image_token_id: int | None  # a VL model's image token (never sampled); None for text models
    rewards: Sequence[Any]
    prompts: Any  # the PromptSet of data.train_path
    given: list[RolloutSample] | None  # rl.rollouts_path's rollouts (no generation)
    engine: RolloutEngine | None
    agent: Any  # multi-turn: the episodes' Agent
    planner: StepLoader
    model: torch.nn.Module  # the policy (eval mode for the passes; its weights synced to the engine)
    lora: Any
    reference: ReferenceWeights | None
    critic: Critic | None
    collate: Callable[[Sequence[Mapping[str, torch.Tensor]]], dict[str, torch.Tensor]]
    shard: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    logprobs: Callable[[Mapping[str, Any], float], torch.Tensor]
    teacher: Any = None  # `rl.teacher`: a `veomni_lite.rl.teacher` LocalTeacher or ServedTeacher
    global_f: bool = False  # moe.balance global-batch: the old pass records each sample's experts for the step's f

    @property
    def minibatches(self) -> int:
        """Optimizer steps per pass over a rollout batch."""
        return self.rl.rollout_size // self.planner.global_batch_size

    @property
    def steps_per_rollout(self) -> int:
        return self.rl.epochs * self.minibatches

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout batch (one mini-batch, one epoch): the old log-probabilities are the
        training forward's own, detached (TRL and verl), so no forward computes them first."""
        return self.steps_per_rollout == 1


@dataclass
class RolloutBatch:
    """Rollout batch `index`: its samples (every rank's, batch order), this rank's collated micro-batches per
    mini-batch, this rank's metrics (values or (total, count) pairs) and the seconds its generation took."""

    index: int
    samples: list[RolloutSample]
    micro_batches: list[list[dict[str, torch.Tensor]]]
    metrics: dict[str, Any]
    generate_s: float


def advantages(context: RolloutContext, samples: Sequence[RolloutSample]) -> None:
    """The advantage stage of the outcome estimators (`veomni_lite.rl.advantages.estimate`): each sample's `advantage`
    from the batch's rewards (every rank holds every sample). A critic's estimator (`gae`) sets token advantages
    later, from the critic's values."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.int64)
    values = estimate(context.rl, rewards, lengths)
    for sample, advantage in zip(samples, values.tolist()):
        sample.advantage = advantage


class RolloutPipeline:
    """Rollout batches from `context`, stage by stage (module docstring). `source` keeps the generation's state (the
    block in flight, dynamic sampling's block ends); `last`: the latest generated batch's samples."""

    def __init__(self, context: RolloutContext) -> None:
        self.context = context
        rl = context.rl
        self.source = RolloutSource(RolloutQueue(rl.async_steps, rl.partial_rollouts) if rl.async_steps else None)
        self.last: list[RolloutSample] = []

    def make(self, k: int, step: int, last: int | None, restored: list[RolloutSample] | None = None) -> RolloutBatch:
        """Rollout batch `k` (collective), made when `step` optimizer steps have trained (the current weights'
        version); `last`: the run's last rollout batch (None: no end); `restored`: the batch's samples from a
        checkpoint."""
        context = self.context
        metrics: dict[str, Any] = {}
        generate_s = 0.0
        if restored is None:
            start = time.perf_counter()
            samples, counts = self.source.collect(context, k, step, last)  # generate -> score -> gather
            if not ADVANTAGES.get(context.rl.advantage, "rl.advantage").needs_critic:
                advantages(context, samples)
            if context.teacher is not None:
                teacher_logprobs(context, samples, batch_name(k, step))
            generate_s = time.perf_counter() - start
            metrics = rollout_metrics(
                self._mine(samples), context.rl.num_generations, self._version(step), context.steps_per_rollout,
                context.rl.async_steps,
            ) | counts  # fmt: skip
            self.last = samples
        else:
            samples = restored
        plans = plan(context, samples)
        if needs_fill(context, samples):
            fill(context, samples, plans)  # old / reference log-probabilities, old values
        if context.critic is not None and samples[0].token_advantages is None:
            metrics |= gae_advantages(samples, context.rl)
        if not context.on_policy:  # on policy the loss records them, from the training forward
            metrics |= engine_mismatch_metrics(self._mine(samples))
        return RolloutBatch(k, samples, collate_plans(context, plans), metrics, generate_s)

    def start_ahead(self, step: int) -> None:
        """Async rollouts: once the batch just made starts training (at `step`), the blocks after it start generating
        by the current weights (`RolloutSource.start_ahead`; collective)."""
        self.source.start_ahead(self.context, step)

    def _mine(self, samples: list[RolloutSample]) -> list[RolloutSample]:
        """The samples this rank records (each sample one rank's)."""
        parallel = self.context.parallel
        return [s for s in samples if s.group % parallel.world_size == parallel.rank]

    def _version(self, step: int) -> int | None:
        """The step the staleness is counted from (None: given rollouts, whose weights are unknown)."""
        return None if self.context.given is not None else step
