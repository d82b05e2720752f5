"""An RL step's log-probability passes (`LogprobPasses`, composed by `RLTrainer`), on the micro-batches the step trains.

A rollout batch is `rl.epochs` passes of `steps` optimizer steps of `train.global_batch_size` responses (whole groups,
in order); each step's share of this rank is planned into micro-batches as any step's (`StepLoader.share`:
`train.micro_batch_size` or the token budget, padded or packed), marked for the loss mode and SP-sliced (`prepare`).
Before the batch's first update the old log-probabilities (unless on policy: one mini-batch and one epoch, where the
training forward's own are the old ones) and, with `rl.kl_coef`, the reference's are computed on those very
micro-batches, every rank running the same count of forwards (agreed in one all-reduce with any error collating
them, before the first forward), then kept per sample (so a checkpoint holds the batch, and resumes it on any
layout); with the critic (`rl.advantage: gae`) its old values too, and GAE's advantages from them
(`veomni_lite.rl.critic`). `probe`: the current weights' log-probabilities of a token sequence, for the vLLM
engine's sync check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from veomni_lite.data.checks import DataError, data_problem
from veomni_lite.distributed.collectives import agree, all_gather_objects
from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.post_training import ReferenceWeights
from veomni_lite.rl.critic import OLD_VALUES
from veomni_lite.rl.policy_loss import OLD_LOGPROBS, POLICY_LABELS, REF_LOGPROBS
from veomni_lite.rl.rollouts import RolloutSample

__all__ = ["LogprobPasses"]


class LogprobPasses:
    """The log-probability passes of `trainer` (an `RLTrainer`: its model, reference, collate and process groups)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def prepare(self, samples: list[RolloutSample], loader: Any) -> list[list[dict[str, torch.Tensor]]]:
        """Each mini-batch's micro-batches of this rank (marked, sliced); the old (unless `on_policy`) and reference
        log-probabilities computed on them now (before the batch's first update) unless the samples hold them (a
        resumed batch). A collate error is a DataError, which the train loop agrees on every rank."""
        t = self.trainer
        size = t.config.train.global_batch_size
        mask = t.rl.mask_truncated
        plans = []
        for m in range(loader.minibatches):
            chunk = samples[m * size : (m + 1) * size]
            plans.append([(chunk, indices) for indices in loader.plan(m, chunk)])
        first = samples[0]
        held = first.ref_logprobs if t.on_policy else first.old_logprobs  # a resumed batch holds them
        if t.critic is not None:  # the critic's old values, then GAE (a resumed batch holds its advantages)
            held = first.old_values
        if held is None and (t.reference is not None or not t.on_policy or t.critic is not None):
            self._fill(samples, plans)
        if t.critic is not None and first.token_advantages is None:
            t.critic.advantages(samples)
        if not t.on_policy:  # on policy the loss records them, from the training forward
            t.records.engine_mismatch([s for s in samples if s.group % t.parallel.world_size == t.rank])
        try:
            return [
                [t.mark_and_slice(t.collate([chunk[i].tensors(mask) for i in indices])) for chunk, indices in plan]
                for plan in plans
            ]
        except Exception as exc:  # noqa: BLE001 - a DataError: the loop agrees it on every rank before any forward
            problem = data_problem(exc, f"rank {t.rank}: RL micro-batches: ")
            raise problem if isinstance(problem, DataError) else DataError(f"RL micro-batches: {problem}") from exc

    def _fill(self, samples: list[RolloutSample], plans: list[list[tuple[list, list[int]]]]) -> None:
        """Old (and reference) log-probabilities of every sample's response tokens, computed on this rank's
        micro-batches and gathered (collective). Each forward is collective (FSDP), and the ranks' token-budget plans
        may hold different numbers of micro-batches: every rank runs the largest count, a shorter plan padded with
        forwards of its first sample whose values are dropped. The ranks of an SP group share one plan, so they pad
        alike (and skip the SP gather together). Every micro-batch (and the padding one) is collated and sliced
        before the first forward, and ONE MAX all-reduce agrees both the count and any error doing so: an error only
        this rank meets is a DataError on every rank naming it, before any forward could wait for this rank."""
        t = self.trainer
        was_training = t.model.training
        t.model.eval()
        found: dict[str, dict[int, list[float]]] = {OLD_LOGPROBS: {}, REF_LOGPROBS: {}, OLD_VALUES: {}}
        index_of = {id(s): i for i, s in enumerate(samples)}
        work = [(chunk, indices) for plan in plans for chunk, indices in plan]
        passes: list[tuple[str, ReferenceWeights | None]] = [] if t.on_policy else [(OLD_LOGPROBS, None)]
        if t.critic is not None:  # the value head's, from the old pass's forward (on policy: a forward of its own)
            passes.append((OLD_VALUES, None))
        if t.reference is not None:
            passes.append((REF_LOGPROBS, t.reference))
        prepared: list[tuple[list[RolloutSample], dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        problem: Exception | str | None = None
        try:
            for chunk, indices in [*work, (work[0][0], work[0][1][:1])]:  # the last: the padding micro-batch
                members = [chunk[i] for i in indices]
                whole = t.collate([s.tensors() for s in members])
                prepared.append((members, whole, t.mark_and_slice(whole)))
        except Exception as exc:  # noqa: BLE001 - agreed below, then raised on every rank
            problem = data_problem(exc, f"rank {t.rank}: RL log-probability pass: ")
        (count,) = agree(problem, DataError, t.control_group, [len(work)], "RL log-probability pass: ")
        for number in range(count):
            real = number < len(work)
            members, whole, sliced = prepared[number if real else -1]
            if t.critic is not None:
                t.critic.captured.clear()
            for key, reference in passes:
                if key == OLD_VALUES:
                    values = t.critic.old_values(sliced)
                else:
                    with (
                        reference.active() if reference is not None else contextlib.nullcontext(),
                        self._no_values(key),
                    ):
                        values = t.logprobs(sliced)
                if not real:
                    continue
                values = self.whole_sequence(values, whole["input_ids"].shape[1])
                if t.parallel.sp_rank == 0:
                    for position, sample in enumerate(members):
                        found[key][index_of[id(sample)]] = _response_values(whole, values, members, position)
        t.model.train(was_training)
        keys = [(OLD_LOGPROBS, "old_logprobs"), (REF_LOGPROBS, "ref_logprobs")]
        keys += [(OLD_VALUES, "old_values")] if t.critic is not None else []
        for key, attribute in keys:
            merged: dict[int, list[float]] = {}
            for part in all_gather_objects(found[key], t.control_group):
                merged.update(part)
            if (key == REF_LOGPROBS and t.reference is None) or (key == OLD_LOGPROBS and t.on_policy):
                continue
            for index, sample in enumerate(samples):
                setattr(sample, attribute, merged[index])

    def _no_values(self, key: str) -> contextlib.AbstractContextManager[None]:
        """The reference's pass computes no critic values."""
        critic = self.trainer.critic
        return critic.paused() if key == REF_LOGPROBS and critic is not None else contextlib.nullcontext()

    def whole_sequence(self, values: torch.Tensor, length: int) -> torch.Tensor:
        """An SP shard's [B, S/sp] values gathered into the whole micro-batch's [B, length]."""
        t = self.trainer
        if t.parallel.sp_size == 1:
            return values
        shards = all_gather_objects(values, t.parallel.sp_group)
        return torch.cat(shards, dim=1)[:, :length]

    @torch.no_grad()
    def probe(self, ids: list[int]) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1 under the current weights, temperature 1, eval mode (collective: every
        rank runs the forward and gets the values). The vLLM engine's sync check compares its own with these."""
        t = self.trainer
        sample = RolloutSample(group=0, prompt_ids=list(ids[:1]), response_ids=list(ids[1:]))
        whole = t.collate([sample.tensors()])
        was_training = t.model.training
        t.model.eval()
        batch = t.preforward(t.mark_and_slice(whole))
        logp = t.model_logprobs(batch, LogprobRequest(batch[POLICY_LABELS]))["logprobs"]
        t.model.train(was_training)
        values = self.whole_sequence(logp.double().cpu(), whole["input_ids"].shape[1])
        return _response_values(whole, values, [sample], 0)


def _response_values(
    whole: Mapping[str, torch.Tensor], values: torch.Tensor, members: Sequence[RolloutSample], position: int
) -> list[float]:
    """Sample `position` of a collated micro-batch: its response tokens' values (in the shifted frame, response token
    i is predicted at the sample's position prompt + i - 1)."""
    sample = members[position]
    ids = whole[SEQUENCE_IDS]
    if ids.shape[0] == len(members):  # padded: one row per sample
        row, start = position, 0
    else:  # packed: the sample's segment of the one row, less the prefix it shares (`pack`)
        where = torch.nonzero(ids[0] == position)
        shared = len(sample.prompt_ids) + len(sample.response_ids) - len(where)
        row, start = 0, int(where[0]) - shared
    first = start + len(sample.prompt_ids) - 1
    out = values[row, first : first + len(sample.response_ids)]
    labels = whole[POLICY_LABELS][row, first : first + len(sample.response_ids)]
    return torch.where(labels != IGNORE_INDEX, out, 0.0).tolist()
