"""Fixtures of the preference-loss exactness tests, importable by forked ranks.

A float64 Qwen2 (a reward model for bradley_terry) and 8 pairs of varied prompt and response lengths (one long
enough that SP cuts it, one whose rejected side is longer than its chosen one), with reference log-probabilities per
response token and reward margins. Two optimizer steps of 4 pairs, plain SGD. `hand_reference` computes each step's
gradient from the formulas alone, one side of one pair at a time; `layout_steps` runs the same steps through the
trainer's pieces (`StepLoader.share`, `collate_pairs`, `slice_micro_batch`, `LossStep`, `PreferenceLoss`) on one rank
of a layout, counting the loss all-reduces over the world.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.dist_helpers import counting_world_all_reduces
from tests.models.test_hf_models import TEXT_SETTINGS, VOCAB, make_lm
from tests.rl.exact_fixtures import all_gather, descend, step_gradients
from veomni_lite.data.collator import collate
from veomni_lite.data.loader import StepLoader
from veomni_lite.data.packing import padding_micro_batch
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.models.hf_causal_lm import hf_config_from_dict
from veomni_lite.models.hf_reward_model import HFRewardModel
from veomni_lite.plain_loop import LossStep
from veomni_lite.preference.losses import PREF_LABELS, PREF_MODE, PreferenceLoss
from veomni_lite.preference.pairs import collate_pairs
from veomni_lite.split_invariance import Layout
from veomni_lite.utils.loss_utils import reset_loss_memo

PAIRS, BATCH, LR = 8, 4, 0.5
PROMPTS = (3, 5, 2, 7, 4, 1, 6, 3)
CHOSEN = (4, 2, 7, 3, 19, 5, 2, 6)
REJECTED = (2, 6, 3, 3, 4, 8, 1, 5)
MARGINS = (0.0, 0.5, 0.0, 1.0, 0.0, 0.2, 0.0, 0.0)
MODEL_INPUTS = ("input_ids", "position_ids", "attention_sequence_ids")


def cases() -> list[PreferenceLoss]:
    return [
        PreferenceLoss("sigmoid", beta=0.5, label_smoothing=0.1),
        PreferenceLoss("sigmoid", beta=0.5, rpo_alpha=0.7),
        PreferenceLoss("ipo", beta=0.5),
        PreferenceLoss("hinge", beta=2.0),
        PreferenceLoss("simpo", beta=2.0, gamma=0.7, label_smoothing=0.05),
        PreferenceLoss("bradley_terry", center_rewards=0.01),
    ]


def name(case: PreferenceLoss) -> str:
    return case.loss + (f"+rpo{case.rpo_alpha}" if case.rpo_alpha else "")


def build_model(case: PreferenceLoss) -> torch.nn.Module:
    if case.loss == "bradley_terry":
        torch.manual_seed(3)
        return HFRewardModel.from_config(hf_config_from_dict(TEXT_SETTINGS)).double()
    return make_lm(seed=3).double()


@torch.no_grad()
def pairs() -> list[dict[str, Any]]:
    """The 8 pairs (see the module docstring): token lists, reference log-probabilities, margins."""
    g = torch.Generator().manual_seed(11)
    out = []
    for index in range(PAIRS):
        prompt = torch.randint(1, VOCAB, (PROMPTS[index],), generator=g).tolist()
        chosen = torch.randint(1, VOCAB, (CHOSEN[index],), generator=g).tolist()
        rejected = torch.randint(1, VOCAB, (REJECTED[index],), generator=g).tolist()
        ref = [-3.0 + 0.5 * torch.randn(len(side), generator=g, dtype=torch.float64) for side in (chosen, rejected)]
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "ref": ref, "margin": MARGINS[index]})
    return out


def steps() -> list[list[int]]:
    return [list(range(s * BATCH, (s + 1) * BATCH)) for s in range(PAIRS // BATCH)]


def _side_logps(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])["logits"][0]
    first = len(prompt) - 1
    logp = torch.log_softmax(logits[first : first + len(response)], -1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _score(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    return model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])["scores"][0, -1]


def _hand_loss(case: PreferenceLoss, model: torch.nn.Module, pair: dict[str, Any]) -> torch.Tensor:
    """One pair's loss, from the papers' formulas (TRL's conventions), the pair's sides alone."""
    b, s = case.beta, case.label_smoothing
    if case.loss == "bradley_terry":
        r_c, r_r = _score(model, pair["prompt"], pair["chosen"]), _score(model, pair["prompt"], pair["rejected"])
        return -torch.log(torch.sigmoid(r_c - r_r - pair["margin"])) + case.center_rewards * (r_c + r_r) ** 2
    lc, lr = _side_logps(model, pair["prompt"], pair["chosen"]), _side_logps(model, pair["prompt"], pair["rejected"])
    ref_c, ref_r = pair["ref"]
    nll = -case.rpo_alpha * lc.mean()  # RPO: the chosen response's mean negative log-likelihood
    if case.loss == "simpo":
        x = b * lc.mean() - b * lr.mean() - case.gamma
        return -(1 - s) * torch.log(torch.sigmoid(x)) - s * torch.log(torch.sigmoid(-x)) + nll
    if case.loss == "ipo":
        h = (lc.mean() - ref_c.mean()) - (lr.mean() - ref_r.mean())
        return (h - 1 / (2 * b)) ** 2 + nll
    h = (lc.sum() - ref_c.sum()) - (lr.sum() - ref_r.sum())
    if case.loss == "hinge":
        return torch.clamp(1 - b * h, min=0) + nll
    return -(1 - s) * torch.log(torch.sigmoid(b * h)) - s * torch.log(torch.sigmoid(-b * h)) + nll


def hand_reference(case: PreferenceLoss) -> list[list[torch.Tensor]]:
    """Each step's gradient of the mean of its pairs' losses (float64, one process, one pair at a time)."""
    model, data = build_model(case), pairs()
    grads = []
    for indices in steps():
        model.zero_grad()
        loss = sum(_hand_loss(case, model, data[i]) for i in indices) / len(indices)
        loss.backward()
        step = step_gradients(model)
        grads.append(step)
        descend(model, step, LR)
    return grads


def _side(prompt: list[int], response: list[int]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor(prompt + response),
            PREF_LABELS: torch.tensor([-100] * len(prompt) + response)}  # fmt: skip


def pair_item(pair: dict[str, Any], reward_model: bool) -> dict[str, Any]:
    item = {"chosen": _side(pair["prompt"], pair["chosen"]), "rejected": _side(pair["prompt"], pair["rejected"])}
    if reward_model:
        item["margin"] = pair["margin"]
    else:
        item["ref_chosen"], item["ref_rejected"] = pair["ref"]
    return item


def pair_length(pair: dict[str, Any], packed: bool) -> int:
    chosen, rejected = (len(pair["prompt"]) + len(pair[k]) for k in ("chosen", "rejected"))
    return chosen + rejected if packed else 2 * max(chosen, rejected)


def layout_steps(rank: int, world: int, layout: Layout, all_cases: list[PreferenceLoss],
                 shard_local: bool = False) -> dict[str, Any]:  # fmt: skip
    """This rank's run of every case: each step's gradient averaged over the ranks (as FSDP) and the loss
    all-reduces over the world each step made. Negative control `shard_local`: each SP shard applies the loss to its
    own partial sums."""
    from veomni_lite.distributed.parallel_state import init_parallel_state

    state = init_parallel_state(layout.dp, layout.sp) if world > 1 else get_parallel_state()
    loader = StepLoader(lambda x: x, BATCH, layout.micro_batch_size, layout.dp, state.dp_rank, 0, layout.max_tokens,
                        layout.packed)  # fmt: skip
    data = pairs()
    sp_group = state.sp_group if layout.sp > 1 and not shard_local else None
    out: dict[str, Any] = {}
    for case in all_cases:
        reward_model = case.loss == "bradley_terry"
        model = build_model(case)
        if layout.sp > 1:
            model.enable_sequence_parallel(state.sp_group)
        grads, calls, metrics = [], [], []
        for number, indices in enumerate(steps()):
            reset_loss_memo()
            model.zero_grad(set_to_none=True)
            plan = loader.share(number, indices, lambda i: pair_length(data[i], layout.packed))
            counts = all_gather(len(plan)) if world > 1 else [len(plan)]
            micro_batches = []
            for j in range(max(counts)):
                members = plan[j] if j < len(plan) else plan[0]
                whole = collate_pairs([pair_item(data[i], reward_model) for i in members],
                                      lambda sides: collate(sides, packing=layout.packed), reward_model)  # fmt: skip
                if j >= len(plan):
                    whole = padding_micro_batch(whole)
                micro_batches.append(slice_micro_batch(whole, state.sp_rank, layout.sp))
            totals: dict[str, list[float]] = {}
            with counting_world_all_reduces() as world_calls:
                step = LossStep(micro_batches, PREF_MODE, marked=True)
                for micro_batch, tokens in step:
                    inputs = {k: v for k, v in micro_batch.items() if k in MODEL_INPUTS}
                    if reward_model:
                        output = model(**inputs)["scores"]
                    else:  # the trainer's path: the LM head fused with the log-probabilities
                        output = model(**inputs, logprobs=LogprobRequest(micro_batch[PREF_LABELS]))["logprobs"]
                    outputs = case(output, micro_batch, sp_group)
                    step.loss({"pref_loss": outputs["pref_loss"]}, tokens).backward()
                    for key, (total, count) in outputs["metrics"].items():
                        seen = totals.setdefault(key, [0.0, 0.0])
                        seen[0], seen[1] = seen[0] + float(total), seen[1] + float(count)
                step.verify()
            step_grads = step_gradients(model, world)
            for seen in totals.values() if world > 1 else ():
                reduced = torch.tensor(seen, dtype=torch.float64)
                dist.all_reduce(reduced)
                seen[:] = reduced.tolist()
            grads.append(step_grads)
            calls.append(len(world_calls))
            metrics.append({key: total / count for key, (total, count) in totals.items()})
            descend(model, step_grads, LR)
        out[name(case)] = {"grads": grads, "calls": calls, "metrics": metrics}
    return out


@torch.no_grad()
def hand_metrics(case: PreferenceLoss) -> dict[str, float]:
    """The first step's metrics (TRL's names), by hand from the initial model, one pair at a time."""
    model, data = build_model(case), pairs()
    rows = []
    for pair in (data[i] for i in steps()[0]):
        if case.loss == "bradley_terry":
            r_c, r_r = (float(_score(model, pair["prompt"], pair[k])) for k in ("chosen", "rejected"))
            rows.append({"rewards/chosen": r_c, "rewards/rejected": r_r, "rewards/margins": r_c - r_r,
                         "rewards/accuracy": float(r_c > r_r), "rewards/mean": (r_c + r_r) / 2})  # fmt: skip
            continue
        lc, lr = (_side_logps(model, pair["prompt"], pair[k]) for k in ("chosen", "rejected"))
        ref_c, ref_r = pair["ref"]
        if case.loss in ("ipo", "simpo"):
            lc, lr, ref_c, ref_r = lc.mean(), lr.mean(), ref_c.mean(), ref_r.mean()
        else:
            lc, lr, ref_c, ref_r = lc.sum(), lr.sum(), ref_c.sum(), ref_r.sum()
        if case.loss == "simpo":
            ref_c = ref_r = 0.0
        c, r = case.beta * float(lc - ref_c), case.beta * float(lr - ref_r)
        rows.append(
            {
                "rewards/chosen": c,
                "rewards/rejected": r,
                "rewards/margins": c - r,
                "rewards/accuracies": float(c > r),
                "logps/chosen": float(lc),
                "logps/rejected": float(lr),
            }
        )
    return {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
