"""Fixtures of the policy-loss exactness tests, importable by forked ranks.

A float64 Qwen2 and one rollout batch of 4 groups x 4 responses of varied prompt and response lengths (one response
truncated and masked, one group of equal rewards), with old, reference and engine log-probabilities per response
token (the old ones perturbed so that every clip branch is taken). The batch trains 2 epochs of 2 mini-batches of 8
responses (4 optimizer steps of plain SGD). `hand_reference` computes each step's gradient from the formulas alone,
one sample at a time; `layout_steps` runs the same steps through the trainer's pieces (`StepLoader.share`,
`collate_rollouts`, `mark_sequences`, `slice_micro_batch`, `LossStep`, `PolicyLoss`) on one rank of a layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tests.dist_helpers import counting_world_all_reduces
from tests.models.test_hf_models import VOCAB, float64_norms, make_lm
from veomni_lite.data.collator import collate
from veomni_lite.data.loader import StepLoader
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.plain_loop import LossStep
from veomni_lite.rl.policy_loss import POLICY_LABELS, PolicyLoss
from veomni_lite.rl.rollouts import RolloutSample, collate_rollouts
from veomni_lite.split_invariance import Layout
from veomni_lite.utils.loss_utils import LossModes, mark_sequences

GROUP, GROUPS, BATCH, EPOCHS, LR, SCALE = 4, 4, 8, 2, 0.05, 8.0
TEMPERATURE = 0.9
PROMPTS = (3, 5, 2, 7)
RESPONSES = ((4, 1, 6, 3), (2, 5, 5, 8), (7, 2, 3, 1), (3, 6, 2, 4))
REWARDS = ((1.0, 0.0, 0.5, 0.0), (0.0, 1.0, 1.0, 0.0), (1.0, 1.0, 1.0, 1.0), (0.2, 0.9, 0.4, 0.0))
TRUNCATED = 5  # this sample's response is cut, and masked
MODEL_INPUTS = ("input_ids", "position_ids", "attention_sequence_ids")


@dataclass(frozen=True)
class Case:
    mode: str
    loss: PolicyLoss

    def __str__(self) -> str:
        decoupled = "/decoupled" if self.loss.decoupled else ""
        return f"{self.mode}/{self.loss.policy_loss}/{self.loss.importance_sampling}{decoupled}/kl{self.loss.kl_coef}"

    @property
    def modes(self) -> LossModes:
        return LossModes(self.mode, {}, SCALE)


# the IS corrections beyond truncation, with bounds the batch's engine log-probabilities cross on both sides
CORRECTIONS = (
    ("token_mask", {"is_low": 0.9, "is_cap": 1.1}, False),
    ("icepop", {"is_low": 0.95, "is_cap": 1.04}, False),
    ("sequence_mask", {"is_low": 0.85, "is_cap": 1.2}, False),
    ("none", {}, True),  # decoupled PPO, its behaviour weight unbounded
)


def cases(corrections: bool = True) -> list[Case]:
    """Every loss mode x {ppo_clip (dual clip, token IS), gspo (sequence IS)} x kl {0, k3}, entropy on; with
    `corrections`, ppo_clip with each of `CORRECTIONS` at token-mean and seq-mean-token-mean, kl k3."""
    modes = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
    out = []
    for mode in modes:
        for kind in ("ppo_clip", "gspo"):
            for kl in (0.0, 0.1):
                clip = (0.2, 0.28) if kind == "ppo_clip" else (0.1, 0.15)
                sampling = "token" if kind == "ppo_clip" else "sequence"
                dual_clip = 3.0 if kind == "ppo_clip" else 0.0
                loss = PolicyLoss(kind, kl, "k3", 0.01, sampling, TEMPERATURE,
                                  {"clip_low": clip[0], "clip_high": clip[1], "dual_clip": dual_clip},
                                  {"is_cap": 1.5})  # fmt: skip
                out.append(Case(mode, loss))
    for mode in ("token-mean", "seq-mean-token-mean") if corrections else ():
        for name, bounds, decoupled in CORRECTIONS:
            clip = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
            out.append(Case(mode, PolicyLoss("ppo_clip", 0.1, "k3", 0.01, name, TEMPERATURE, clip, bounds, decoupled)))
    return out


def importance_weight(loss: PolicyLoss, old: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
    """One sample's importance weights from the definitions (float64): of each token, or of its whole sequence."""
    bounds = loss.is_hyperparameters
    d = old - engine
    if loss.importance_sampling in ("sequence", "sequence_mask"):
        d = d.sum().expand_as(d)
    ratio = torch.exp(d)
    if loss.importance_sampling == "none":
        return ratio if loss.decoupled else torch.ones_like(ratio)
    if loss.importance_sampling in ("token", "sequence"):
        return torch.clamp(ratio, max=bounds["is_cap"])
    inside = (ratio >= bounds["is_low"]) & (ratio <= bounds["is_cap"])
    return torch.where(inside, ratio, torch.zeros_like(ratio))


def build_model() -> torch.nn.Module:
    return float64_norms(make_lm(seed=3).double())


def _grpo(rewards: torch.Tensor) -> torch.Tensor:
    groups = rewards.view(-1, GROUP)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).reshape(-1)


ENV_TOKENS = ((2,), (3, 1), (1,), (2, 2))  # episodes: each group's environment turns, spliced into the responses


@torch.no_grad()
def rollout_batch(episodes: bool = False) -> list[RolloutSample]:
    """The batch (see the module docstring); log-probabilities from the initial model, perturbed and shifted.
    `episodes`: each response becomes a multi-turn episode, model tokens, then environment turns of `ENV_TOKENS`
    tokens (the last sample of a group: each after one more model token), then the rest of the model's tokens; the
    environment tokens carry log-probabilities too (noise), which must not reach any loss."""
    g = torch.Generator().manual_seed(7)
    model = build_model()
    advantages = _grpo(torch.tensor(REWARDS, dtype=torch.float64).reshape(-1))
    samples = []
    for group in range(GROUPS):
        prompt = torch.randint(1, VOCAB, (PROMPTS[group],), generator=g).tolist()
        for j in range(GROUP):
            index = group * GROUP + j
            response = torch.randint(1, VOCAB, (RESPONSES[group][j],), generator=g).tolist()
            mask = None
            if episodes:
                mask, spliced, cut = [], [], 1 + j % 2
                for position, token in enumerate(response):
                    spliced.append(token)
                    mask.append(1)
                    last = position == len(response) - 1  # a response of one token stays one turn
                    if not last and (position == cut - 1 or (j == GROUP - 1 and position == cut)):
                        env = torch.randint(1, VOCAB, (sum(ENV_TOKENS[group]),), generator=g).tolist()
                        spliced += env
                        mask += [0] * len(env)
                response = spliced
            logp = _logprobs(model, prompt, response)
            noise = 0.3 * torch.randn(len(response), generator=g, dtype=torch.float64)
            samples.append(
                RolloutSample(
                    group=group, prompt_ids=prompt, response_ids=response, reward=REWARDS[group][j],
                    advantage=float(advantages[index]), truncated=index == TRUNCATED,
                    old_logprobs=(logp + noise).tolist(), ref_logprobs=(logp - 0.2 * noise.flip(0)).tolist(),
                    engine_logprobs=(logp + noise + 0.1 * torch.randn(len(response), generator=g)).tolist(),
                    response_mask=mask,
                )
            )  # fmt: skip
    return samples


def _logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log softmax(logits / T) of each response token, the sample alone."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])["logits"][0]
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    first = len(prompt) - 1
    return logp[first : first + len(response)].gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def steps() -> list[list[int]]:
    """Each optimizer step's samples (indices into the batch): mini-batches in order, `EPOCHS` times."""
    minibatches = [list(range(m * BATCH, (m + 1) * BATCH)) for m in range(GROUPS * GROUP // BATCH)]
    return minibatches * EPOCHS


def hand_reference(case: Case, episodes: bool = False) -> list[list[torch.Tensor]]:
    """Each step's gradient, written from the loss's definition, one sample at a time (float64, one process);
    `episodes`: over each episode's model tokens only (every other token attended to, in no sum, mean or ratio)."""
    model, batch, rl = build_model(), rollout_batch(episodes), case.loss
    grads = []
    for indices in steps():
        model.zero_grad()
        kept = [batch[i] for i in indices if i != TRUNCATED]
        per_sample = []
        for sample in kept:
            ids = torch.tensor([sample.prompt_ids + sample.response_ids])
            logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])["logits"][0]
            first = len(sample.prompt_ids) - 1
            logp_all = torch.log_softmax(logits[first : first + len(sample.response_ids)] / TEMPERATURE, -1)
            logp = logp_all.gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            old, ref, engine = (torch.tensor(v, dtype=torch.float64) for v in
                                (sample.old_logprobs, sample.ref_logprobs, sample.engine_logprobs))  # fmt: skip
            if sample.response_mask is not None:  # the model's tokens alone
                model_tokens = torch.tensor(sample.response_mask, dtype=torch.bool)
                logp, entropy = logp[model_tokens], entropy[model_tokens]
                old, ref, engine = old[model_tokens], ref[model_tokens], engine[model_tokens]
            a = sample.advantage
            if rl.policy_loss == "gspo":
                ratio = torch.exp((logp - old).mean()).expand_as(logp)
            else:
                ratio = torch.exp(logp - old)
            weight = importance_weight(rl, old, engine)
            clip_low, clip_high, dual_clip = (rl.hyperparameters[k] for k in ("clip_low", "clip_high", "dual_clip"))
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high))
            if dual_clip and a < 0:
                pg = torch.minimum(pg, torch.full_like(pg, -a * dual_clip))
            d = logp - ref
            kl = torch.exp(-d) + d - 1
            per_sample.append(weight * pg + rl.kl_coef * kl - rl.entropy_coef * entropy)
        tokens = sum(len(x) for x in per_sample)
        n = len(per_sample)
        if case.mode == "token-mean":
            loss = sum(x.sum() for x in per_sample) / tokens
        elif case.mode == "seq-mean-token-mean":
            loss = sum(x.mean() for x in per_sample) / n
        elif case.mode == "seq-mean-token-sum":
            loss = sum(x.sum() for x in per_sample) / n
        elif case.mode == "seq-mean-token-sum-norm":
            loss = sum(x.sum() for x in per_sample) / (n * SCALE)
        else:
            loss = sum(x.sum() for x in per_sample)
        loss.backward()
        step = step_gradients(model)
        grads.append(step)
        descend(model, step, LR)
    return grads


def _collate(samples: list[dict[str, torch.Tensor]], packed: bool) -> dict[str, torch.Tensor]:
    return collate_rollouts(samples, lambda base: collate(base, packing=packed, share_prefixes=packed), packed)


def layout_steps(
    rank: int,
    world: int,
    layout: Layout,
    all_cases: list[Case],
    alone: bool = False,
    shard_local: bool = False,
    episodes: bool = False,
    leak: bool = False,
) -> dict[str, Any]:
    """This rank's run of every case: each step's gradient averaged over the ranks (as FSDP), and the loss
    all-reduces over the world each step made; `episodes`: on the multi-turn batch. Negative controls: `alone`, each
    micro-batch normalized by its own counts; `shard_local`, each SP shard's sequences reduced over its own tokens
    only; `leak`, the episodes' environment tokens trained as the model's."""
    from veomni_lite.distributed.parallel_state import init_parallel_state

    state = init_parallel_state(layout.dp, layout.sp) if world > 1 else get_parallel_state()
    loader = StepLoader(lambda x: x, BATCH, layout.micro_batch_size, layout.dp, state.dp_rank, 0, layout.max_tokens,
                        layout.packed)  # fmt: skip
    batch = rollout_batch(episodes)
    for sample in batch if leak else ():
        sample.response_mask = None
    sp_group = state.sp_group if layout.sp > 1 and not shard_local else None
    out: dict[str, Any] = {}
    for case in all_cases:
        model = build_model()
        if layout.sp > 1:
            model.enable_sequence_parallel(state.sp_group)
        grads, calls, shared = [], [], 0
        for number, indices in enumerate(steps()):
            model.zero_grad(set_to_none=True)
            chunk = [batch[i] for i in indices]
            micro_batches = step_micro_batches(loader, number, chunk, case.modes, layout, state.sp_rank, world)
            shared += sum(bool((mb.get(ATTENTION_SEQUENCE_IDS, torch.zeros(1)) <= -2).any()) for mb in micro_batches)
            with counting_world_all_reduces() as world_calls:
                runs = [[mb] for mb in micro_batches] if alone else [micro_batches]
                for run in runs:
                    step = LossStep(run, case.modes, marked=True)
                    for micro_batch, tokens in step:
                        inputs = {k: v for k, v in micro_batch.items() if k in MODEL_INPUTS}
                        # the trainer's path: the LM head fused with the log-probabilities and entropies
                        request = LogprobRequest(micro_batch[POLICY_LABELS], case.loss.temperature, entropy=True)
                        outputs = case.loss(model(**inputs, logprobs=request), micro_batch, sp_group)
                        step.loss({"policy_loss": outputs["policy_loss"]}, tokens).backward()
                    step.verify()
            step_grads = step_gradients(model, world)
            grads.append(step_grads)
            calls.append(len(world_calls))
            descend(model, step_grads, LR)
        out[str(case)] = {"grads": grads, "calls": calls, "shared": shared}
    return out


def step_micro_batches(
    loader: StepLoader, number: int, chunk: list[RolloutSample], modes: LossModes, layout: Layout, sp_rank: int,
    world: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """This rank's micro-batches of step `number` (the samples `chunk`), planned as the trainer plans them, marked for
    `modes`, padded to the count every rank agrees on (padding micro-batches) and SP-sliced."""
    from veomni_lite.data.packing import padding_micro_batch

    plan = loader.share(number, list(range(len(chunk))), lambda i: len(chunk[i]))
    counts = all_gather(len(plan)) if world > 1 else [len(plan)]
    micro_batches = []
    for j in range(max(counts)):
        members = plan[j] if j < len(plan) else plan[0]
        whole = _collate([chunk[i].tensors(mask_truncated=True) for i in members], layout.packed)
        whole = mark_sequences(whole, modes)
        if j >= len(plan):
            whole = padding_micro_batch(whole)
        micro_batches.append(slice_micro_batch(whole, sp_rank, layout.sp))
    return micro_batches


def step_gradients(model: torch.nn.Module, world: int = 1) -> list[torch.Tensor]:
    """A step's gradient of every parameter (zeros where it has none), averaged over the `world` ranks."""
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    for grad in grads if world > 1 else ():
        dist.all_reduce(grad)
        grad /= world
    return grads


@torch.no_grad()
def descend(model: torch.nn.Module, grads: list[torch.Tensor], lr: float) -> None:
    """One plain SGD step (the references' optimizer: state-free, so every layout's weights stay comparable)."""
    for param, grad in zip(model.parameters(), grads):
        param -= lr * grad


def all_gather(value: int) -> list[int]:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def relative_error(grads: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    scale = max(float(e.abs().max()) for e in expected) or 1.0
    worst = max(float((g - e).abs().max()) for g, e in zip(grads, expected)) / scale
    return worst if math.isfinite(worst) else math.inf
