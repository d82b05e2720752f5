"""The rollout pipeline's forward stages (`veomni_lite.rl.pipeline`): a rollout batch planned into this rank's
micro-batches (`plan`), the old / reference log-probabilities and old values computed on them (`fill`), and the
micro-batches collated (`collate_plans`). Every function takes the pipeline's `RolloutContext`, never the trainer.

A rollout batch is `rl.epochs` passes of `steps` optimizer steps of `train.global_batch_size` responses (whole groups,
in order); each step's share of this rank is planned into micro-batches as any step's (`StepLoader.share`:
`train.micro_batch_size` or the token budget, padded or packed); the train loop marks and SP-slices them.
Before the batch's first update the old log-probabilities (unless on policy: one mini-batch and one epoch, where the
training forward's own are the old ones) and, with `rl.kl_coef`, the reference's are computed on those very
micro-batches, every rank running the same count of forwards (agreed in one all-reduce with any error collating
them, before the first forward), then kept per sample (so a checkpoint holds the batch, and resumes it on any
layout); with the critic (`rl.advantage: gae`) its old values too, and GAE's advantages from them
(`veomni_lite.rl.critic`). Routing replay (`rl.routing_replay`): every forward of a micro-batch carrying
`routed_experts` replays them (`replayed`); with `old` the old pass records each sample's experts (`routed_experts`),
and so it does with `none` under `moe.balance: global-batch` (`RolloutContext.global_f`), where the experts only give
each step's f (`veomni_lite.models.moe`) and the training forward does not replay them.
`probe`: the current weights' log-probabilities of a token sequence, for the vLLM engine's sync check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from veomni_lite.data.checks import DataError, data_problem
from veomni_lite.distributed.collectives import agree, all_gather_objects
from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS, is_labels_key
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.models.routing import compact_experts, record_routing, replay_routing
from veomni_lite.post_training import ReferenceWeights
from veomni_lite.rl.critic import OLD_VALUES
from veomni_lite.rl.policy_loss import OLD_LOGPROBS, POLICY_LABELS, REF_LOGPROBS
from veomni_lite.rl.rollouts import ROUTED_EXPERTS, RolloutSample, prefix_positions
from veomni_lite.trainer.base import to_device

__all__ = [
    "Plans",
    "collate_plans",
    "fill",
    "model_logprobs",
    "needs_fill",
    "plan",
    "policy_logprobs",
    "probe",
    "replay_experts",
    "replayed",
    "whole_sequence",
]


Plans = list[list[tuple[list[RolloutSample], list[int]]]]  # per mini-batch: (its samples, one micro-batch's indices)


def plan(context: Any, samples: list[RolloutSample]) -> Plans:
    """Each mini-batch's micro-batches of this rank: `train.global_batch_size` responses per mini-batch, in order, this
    rank's share planned as any step's (`StepLoader.share`)."""
    size = context.planner.global_batch_size
    plans = []
    for m in range(context.minibatches):
        chunk = samples[m * size : (m + 1) * size]
        share = context.planner.share(m, list(range(len(chunk))), lambda i, chunk=chunk: len(chunk[i]))
        plans.append([(chunk, indices) for indices in share])
    return plans


def needs_fill(context: Any, samples: list[RolloutSample]) -> bool:
    """Whether the batch needs the forward passes: old log-probabilities (off policy), reference ones
    (`rl.kl_coef`) or old values (the critic), unless its samples hold them already (a resumed batch)."""
    first = samples[0]
    held = first.ref_logprobs if context.on_policy else first.old_logprobs
    if context.critic is not None:  # the critic's old values (a resumed batch holds them, and its advantages)
        held = first.old_values
    return held is None and (context.reference is not None or not context.on_policy or context.critic is not None)


def collate_plans(context: Any, plans: Plans) -> list[list[dict[str, torch.Tensor]]]:
    """Each mini-batch's micro-batches of this rank, collated (the train loop marks and slices them). A collate error
    is a DataError, which the train loop agrees on every rank."""
    mask = context.rl.mask_truncated
    try:
        return [[context.collate([chunk[i].tensors(mask) for i in indices]) for chunk, indices in p] for p in plans]
    except Exception as exc:  # noqa: BLE001 - a DataError: the loop agrees it on every rank before any forward
        problem = data_problem(exc, f"rank {context.parallel.rank}: RL micro-batches: ")
        raise problem if isinstance(problem, DataError) else DataError(f"RL micro-batches: {problem}") from exc


def fill(context: Any, samples: list[RolloutSample], plans: Plans) -> None:
    """The old-policy stage: old (unless on policy) and reference log-probabilities of every sample's response tokens,
    and with the critic its old values, computed on this rank's micro-batches and gathered (collective). Each forward
    is collective (FSDP), and the ranks' token-budget plans may hold different numbers of micro-batches: every rank
    runs the largest count, a shorter plan padded with forwards of its first sample whose values are dropped. The
    ranks of an SP group share one plan, so they pad alike (and skip the SP gather together). Every micro-batch (and
    the padding one) is collated and sliced before the first forward, and ONE MAX all-reduce agrees both the count
    and any error doing so: an error only this rank meets is a DataError on every rank naming it, before any forward
    could wait for this rank."""
    model, critic, parallel = context.model, context.critic, context.parallel
    temperature = context.rl.temperature
    was_training = model.training
    model.eval()
    found: dict[str, dict[int, list[float]]] = {OLD_LOGPROBS: {}, REF_LOGPROBS: {}, OLD_VALUES: {}}
    index_of = {id(s): i for i, s in enumerate(samples)}
    work = [(chunk, indices) for p in plans for chunk, indices in p]
    passes: list[tuple[str, ReferenceWeights | None]] = [] if context.on_policy else [(OLD_LOGPROBS, None)]
    if critic is not None:  # the value head's, from the old pass's forward (on policy: a forward of its own)
        passes.append((OLD_VALUES, None))
    if context.reference is not None:
        passes.append((REF_LOGPROBS, context.reference))
    # the old pass's experts, kept per sample: replayed (`old`) or, without replay, the global-batch balance's f
    replay = context.rl.routing_replay
    records = (replay == "old" or (replay == "none" and context.global_f)) and not context.on_policy
    routing: dict[int, torch.Tensor] = {}
    prepared: list[tuple[list[RolloutSample], dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    problem: Exception | str | None = None
    try:
        for chunk, indices in [*work, (work[0][0], work[0][1][:1])]:  # the last: the padding micro-batch
            members = [chunk[i] for i in indices]
            whole = context.collate([s.tensors() for s in members])
            prepared.append((members, whole, context.shard(whole)))
    except Exception as exc:  # noqa: BLE001 - agreed below, then raised on every rank
        problem = data_problem(exc, f"rank {parallel.rank}: RL log-probability pass: ")
    (count,) = agree(problem, DataError, context.control_group, [len(work)], "RL log-probability pass: ")
    for number in range(count):
        real = number < len(work)
        members, whole, sliced = prepared[number if real else -1]
        if critic is not None:
            critic.captured.clear()
        for key, reference in passes:
            if key == OLD_VALUES:
                values = critic.old_values(sliced, lambda batch: context.logprobs(batch, temperature))
            else:
                with (
                    reference.active() if reference is not None else contextlib.nullcontext(),
                    critic.paused() if key == REF_LOGPROBS and critic is not None else contextlib.nullcontext(),
                    record_routing(model) if records and key == OLD_LOGPROBS else contextlib.nullcontext() as record,
                ):  # the reference's pass computes no critic values
                    values = context.logprobs(sliced, temperature)
                if record is not None:  # every rank of the SP group gathers, the padding micro-batch's too
                    experts = whole_sequence(context, _per_token(record, sliced), whole["input_ids"].shape[1])
                    if real and parallel.sp_rank == 0:
                        for position, sample in enumerate(members):
                            routing[index_of[id(sample)]] = _sample_experts(whole, experts, members, position)
            if not real:
                continue
            values = whole_sequence(context, values, whole["input_ids"].shape[1])
            if parallel.sp_rank == 0:
                for position, sample in enumerate(members):
                    found[key][index_of[id(sample)]] = _response_values(whole, values, members, position)
    model.train(was_training)
    keys = [(OLD_LOGPROBS, "old_logprobs"), (REF_LOGPROBS, "ref_logprobs")]
    keys += [(OLD_VALUES, "old_values")] if critic is not None else []
    for key, attribute in keys:
        merged: dict[int, list[float]] = {}
        for part in all_gather_objects(found[key], context.control_group):
            merged.update(part)
        if (key == REF_LOGPROBS and context.reference is None) or (key == OLD_LOGPROBS and context.on_policy):
            continue
        for index, sample in enumerate(samples):
            setattr(sample, attribute, merged[index])
    if records:
        for part in all_gather_objects(routing, context.control_group):
            for index, experts in part.items():
                samples[index].routed_experts = experts


def model_logprobs(model: torch.nn.Module, batch: Mapping[str, Any], request: LogprobRequest) -> dict[str, Any]:
    """The model's {"logprobs", "entropy"} of `request` on a prepared micro-batch (the LM head fused with them
    unless `model.fused_lm_head` is false: `LogprobRequest`)."""
    return model(**{k: v for k, v in batch.items() if not is_labels_key(k)}, logprobs=request)


def replay_experts(batch: dict[str, Any], routing_replay: str) -> torch.Tensor | None:
    """The micro-batch's experts to replay (`routed_experts`), None without; under `rl.routing_replay: none` those the
    old pass recorded for `moe.balance: global-batch`'s f only, popped: never replayed."""
    if routing_replay == "none":
        batch.pop(ROUTED_EXPERTS, None)
    return batch.get(ROUTED_EXPERTS)


def replayed(model: torch.nn.Module, batch: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """Pops the micro-batch's `routed_experts` ([B, S, layers, top_k], this rank's shard) and returns the context
    in which `model` routes its tokens to them (`replay_routing`); a null context where the batch carries none."""
    experts = batch.pop(ROUTED_EXPERTS, None)
    if experts is None:
        return contextlib.nullcontext()
    return replay_routing(model, list(experts.flatten(0, 1).unbind(1)))


def _per_token(record: list[torch.Tensor | None], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A forward's recording (`record_routing`: per layer [B * S, top_k]) as [B, S, layers, top_k] on the host."""
    rows, length = batch["input_ids"].shape[:2]
    return torch.stack(record, dim=1).view(rows, length, len(record), -1).cpu()  # type: ignore[arg-type]


def _sample_experts(
    whole: Mapping[str, torch.Tensor], experts: torch.Tensor, members: Sequence[RolloutSample], position: int
) -> torch.Tensor:
    """Sample `position`'s [len(sample), layers, top_k] experts from a collated micro-batch's [B, S, layers, top_k]
    (packed: its branch, after its shared prefix's)."""
    sample = members[position]
    ids = whole[SEQUENCE_IDS]
    if ids.shape[0] == len(members):
        return compact_experts(experts[position, : len(sample)])
    at = torch.nonzero(ids[0] == position)[:, 0]
    shared = len(sample) - len(at)
    prefix = experts[0, prefix_positions(ids[0], int(at[0]), shared)] if shared else experts[0, :0]
    return compact_experts(torch.cat([prefix, experts[0, at]]))


@torch.no_grad()
def policy_logprobs(
    model: torch.nn.Module, device: torch.device, micro_batch: Mapping[str, Any], temperature: float
) -> torch.Tensor:
    """[B, S] log-probabilities of a sliced micro-batch's `policy_labels` at `temperature` under `model`'s current
    weights (float64, host; the caller sets eval mode): the pipeline's forward (`RolloutContext.logprobs`)."""
    batch = to_device(micro_batch, device, model.host_inputs)
    request = LogprobRequest(batch[POLICY_LABELS], temperature)
    with replayed(model, batch):
        return model_logprobs(model, batch, request)["logprobs"].double().cpu()


def whole_sequence(context: Any, values: torch.Tensor, length: int) -> torch.Tensor:
    """An SP shard's [B, S/sp] values gathered into the whole micro-batch's [B, length]."""
    parallel = context.parallel
    if parallel.sp_size == 1:
        return values
    shards = all_gather_objects(values, parallel.sp_group)
    return torch.cat(shards, dim=1)[:, :length]


@torch.no_grad()
def probe(context: Any, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 under the current weights, temperature 1, eval mode (collective: every
    rank runs the forward and gets the values). The vLLM engine's sync check compares its own with these."""
    sample = RolloutSample(group=0, prompt_ids=list(ids[:1]), response_ids=list(ids[1:]))
    whole = context.collate([sample.tensors()])
    was_training = context.model.training
    context.model.eval()
    logp = context.logprobs(context.shard(whole), 1.0)
    context.model.train(was_training)
    values = whole_sequence(context, logp, whole["input_ids"].shape[1])
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
