"""Fixtures of the critic's exactness tests, importable by forked ranks.

The policy-loss fixtures' float64 Qwen2 and rollout batch (`tests.rl.exact_fixtures`: 4 groups x 4 responses of
varied lengths, one truncated and masked; 2 epochs of 2 mini-batches of 8, plain SGD), the model with the critic's
value head (`attach_value_head`, its weights set to seeded non-zero values so the trunk's gradient is not 0), and
per-token old values and returns (seeded; old values near the model's so that both value-clip branches are taken).
Each step trains two heads: the policy (ppo_clip, token-mean) and the value head in the case's mode (`value_loss`
with value_clip 0.2). `hand_reference` writes each step's gradient from the formulas, one sample at a time;
`layout_steps` runs the trainer's pieces (`StepLoader.share`, `collate_rollouts`, `mark_sequences`,
`slice_micro_batch`, `LossStep`, `PolicyLoss`, `ValueLoss`) on one rank of a layout.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.dist_helpers import counting_world_all_reduces
from tests.rl.exact_fixtures import (
    BATCH,
    MODEL_INPUTS,
    SCALE,
    TEMPERATURE,
    TRUNCATED,
    descend,
    step_gradients,
    step_micro_batches,
    steps,
)
from tests.rl.exact_fixtures import build_model as build_policy
from tests.rl.exact_fixtures import rollout_batch as policy_batch
from veomni_lite.data.loader import StepLoader
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.plain_loop import LossStep
from veomni_lite.rl.critic import ValueLoss, attach_value_head
from veomni_lite.rl.policy_loss import POLICY_LABELS, PolicyLoss
from veomni_lite.split_invariance import Layout
from veomni_lite.utils.loss_utils import LossModes

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
CLIP = 0.2
LR = 0.005  # plain SGD; token-sum sums every token's value loss, which the policy fixtures' 0.05 overshoots
POLICY = PolicyLoss("ppo_clip", temperature=TEMPERATURE)


def modes(value_mode: str) -> LossModes:
    return LossModes("token-mean", {"value": value_mode}, SCALE)


def build_model() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The float64 policy with a seeded value head, and the dict its values land in."""
    model, captured = build_policy(), {}
    attach_value_head(model, captured)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.value_head.parameters():
            param.copy_(0.05 * torch.randn(param.shape, generator=g, dtype=torch.float64))
    return model, captured


def rollout_batch() -> list[Any]:
    """The policy fixtures' batch with old values and returns per response token."""
    g = torch.Generator().manual_seed(5)
    samples = policy_batch()
    for sample in samples:
        n = len(sample.response_ids)
        sample.old_values = (0.2 * torch.randn(n, generator=g, dtype=torch.float64)).tolist()
        sample.returns = (sample.reward + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).tolist()
    return samples


def hand_reference(value_mode: str) -> list[list[torch.Tensor]]:
    """Each step's gradient from the definitions (float64, one process, one sample at a time): the policy's token
    mean plus the value head's mode over its per-token 0.5 max((v - R)^2, (o + clip(v - o, -c, c) - R)^2)."""
    (model, captured), batch = build_model(), rollout_batch()
    grads = []
    for indices in steps():
        model.zero_grad()
        kept = [batch[i] for i in indices if i != TRUNCATED]
        policy, value = [], []
        for sample in kept:
            ids = torch.tensor([sample.prompt_ids + sample.response_ids])
            logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])["logits"][0]
            first, n = len(sample.prompt_ids) - 1, len(sample.response_ids)
            v = captured.pop("values")[0, first : first + n]
            logp_all = torch.log_softmax(logits[first : first + n] / TEMPERATURE, -1)
            logp = logp_all.gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
            old = torch.tensor(sample.old_logprobs, dtype=torch.float64)
            ratio, a = torch.exp(logp - old), sample.advantage
            policy.append(torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)))
            o = torch.tensor(sample.old_values, dtype=torch.float64)
            r = torch.tensor(sample.returns, dtype=torch.float64)
            clipped = o + (v - o).clamp(-CLIP, CLIP)
            value.append(0.5 * torch.maximum((v - r) ** 2, (clipped - r) ** 2))
        tokens, n = sum(len(x) for x in value), len(value)
        loss = sum(x.sum() for x in policy) / tokens
        if value_mode == "token-mean":
            loss = loss + sum(x.sum() for x in value) / tokens
        elif value_mode == "seq-mean-token-mean":
            loss = loss + sum(x.mean() for x in value) / n
        elif value_mode == "seq-mean-token-sum":
            loss = loss + sum(x.sum() for x in value) / n
        elif value_mode == "seq-mean-token-sum-norm":
            loss = loss + sum(x.sum() for x in value) / (n * SCALE)
        else:
            loss = loss + sum(x.sum() for x in value)
        loss.backward()
        step = step_gradients(model)
        grads.append(step)
        descend(model, step, LR)
    return grads


def layout_steps(rank: int, world: int, layout: Layout, value_modes: list[str], alone: bool = False) -> dict[str, Any]:
    """This rank's run of each value mode: every step's gradient averaged over the ranks, and the loss all-reduces over
    the world each step made. Negative control `alone`: each micro-batch normalized by its own counts."""
    from veomni_lite.distributed.parallel_state import init_parallel_state

    state = init_parallel_state(layout.dp, layout.sp) if world > 1 else get_parallel_state()
    loader = StepLoader(lambda x: x, BATCH, layout.micro_batch_size, layout.dp, state.dp_rank, 0, layout.max_tokens,
                        layout.packed)  # fmt: skip
    batch = rollout_batch()
    value_loss = ValueLoss(CLIP)
    out: dict[str, Any] = {}
    for value_mode in value_modes:
        (model, captured), step_modes = build_model(), modes(value_mode)
        if layout.sp > 1:
            model.enable_sequence_parallel(state.sp_group)
        grads, calls = [], []
        for number, indices in enumerate(steps()):
            model.zero_grad(set_to_none=True)
            chunk = [batch[i] for i in indices]
            micro_batches = step_micro_batches(loader, number, chunk, step_modes, layout, state.sp_rank, world)
            with counting_world_all_reduces() as world_calls:
                for run in [[mb] for mb in micro_batches] if alone else [micro_batches]:
                    step = LossStep(run, step_modes, marked=True)
                    for micro_batch, tokens in step:
                        inputs = {k: v for k, v in micro_batch.items() if k in MODEL_INPUTS}
                        request = LogprobRequest(micro_batch[POLICY_LABELS], TEMPERATURE, entropy=True)
                        policy = POLICY(model(**inputs, logprobs=request), micro_batch)
                        value = value_loss(captured.pop("values"), micro_batch)
                        losses = {"policy_loss": policy["policy_loss"], "value_loss": value["value_loss"]}
                        step.loss(losses, tokens).backward()
                    step.verify()
            step_grads = step_gradients(model, world)
            grads.append(step_grads)
            calls.append(len(world_calls))
            descend(model, step_grads, LR)
        out[value_mode] = {"grads": grads, "calls": calls}
    return out
