"""Fixtures of the preference-loss exactness tests, importable by forked ranks.

A float64 Qwen2 (a reward model for bradley_terry) and 8 pairs of varied prompt and response lengths (one long
enough that SP cuts it, one whose rejected side is longer than its chosen one), with reference log-probabilities per
response token and reward margins. Two optimizer steps of 4 pairs, plain SGD. `hand_reference` computes each step's
gradient from the formulas alone, one side of one pair at a time; `layout_steps` runs the same steps through the
trainer's pieces (`StepLoader.share`, `collate_pairs`, `slice_micro_batch`, `LossStep`, `PreferenceLoss`) on one rank
of a layout, counting the loss all-reduces over the world.

ORPO and KTO (`orpo_kto_cases`) run on the same pairs: KTO reads pair i as one unpaired row, desirable as `LABELS`
says, its completion the pair's chosen response and its mismatched completion (the KL side) the rejected one, whose
reference log-probabilities are lowered by `KL_SHIFT` so that the KL estimate z0 is positive (not clamped to 0).
KTO's z0 is the mean over the step's 4 rows at the step's starting weights; the negative controls take it per rank
or per micro-batch instead.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from tests.dist_helpers import counting_world_all_reduces
from tests.models.test_hf_models import TEXT_SETTINGS, VOCAB, float64_norms, make_lm
from tests.rl.exact_fixtures import all_gather, descend, step_gradients
from veomni_lite.data.collator import collate
from veomni_lite.data.loader import StepLoader
from veomni_lite.data.packing import padding_micro_batch
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS
from veomni_lite.metrics.accumulator import MetricAccumulator, MetricSpec
from veomni_lite.metrics.logger import difference_metrics
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.models.hf_causal_lm import hf_config_from_dict
from veomni_lite.models.hf_reward_model import HFRewardModel
from veomni_lite.plain_loop import LossStep
from veomni_lite.preference.config import PrefConfig
from veomni_lite.preference.losses import (
    KL,
    PREF_LABELS,
    PREF_MODE,
    PreferenceLoss,
    kto_kl_totals,
    kto_reference_point,
    metric_differences,
    metric_names,
)
from veomni_lite.preference.pairs import collate_pairs
from veomni_lite.split_invariance import Layout

PAIRS, BATCH, LR = 8, 4, 0.5
PROMPTS = (3, 5, 2, 7, 4, 1, 6, 3)
CHOSEN = (4, 2, 7, 3, 19, 5, 2, 6)
REJECTED = (2, 6, 3, 3, 4, 8, 1, 5)
MARGINS = (0.0, 0.5, 0.0, 1.0, 0.0, 0.2, 0.0, 0.0)
MODEL_INPUTS = ("input_ids", "position_ids", "attention_sequence_ids")
LABELS = (True, False, True, True, False, True, False, False)  # kto: pair i's row is desirable
KL_SHIFT = 1.5


def cases() -> list[PrefConfig]:
    return [
        PrefConfig(loss="sigmoid", beta=0.5, label_smoothing=0.1),
        PrefConfig(loss="sigmoid", beta=0.5, rpo_alpha=0.7),
        PrefConfig(loss="ipo", beta=0.5),
        PrefConfig(loss="hinge", beta=2.0),
        PrefConfig(loss="simpo", beta=2.0, gamma=0.7, label_smoothing=0.05),
        PrefConfig(loss="bradley_terry", center_rewards=0.01),
    ]


def orpo_kto_cases() -> list[PrefConfig]:
    return [
        PrefConfig(loss="orpo", orpo_lambda=0.7),
        PrefConfig(loss="kto", beta=0.5, desirable_weight=1.3, undesirable_weight=0.8),
    ]


def name(case: PrefConfig) -> str:
    return case.loss + (f"+rpo{case.rpo_alpha}" if case.rpo_alpha else "")


def build_model(case: PrefConfig) -> torch.nn.Module:
    if case.loss == "bradley_terry":
        torch.manual_seed(3)
        return float64_norms(HFRewardModel.from_config(hf_config_from_dict(TEXT_SETTINGS)).double())
    return float64_norms(make_lm(seed=3).double())


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
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "ref": ref, "margin": MARGINS[index],
                    "label": LABELS[index]})  # fmt: skip
    return out


def steps() -> list[list[int]]:
    return [list(range(s * BATCH, (s + 1) * BATCH)) for s in range(PAIRS // BATCH)]


def _side_logps(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])["logits"][0]
    first = len(prompt) - 1
    logp = torch.log_softmax(logits[first : first + len(response)], -1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _side_mean_logits(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The mean over the vocabulary of the logits at each of `response`'s target positions (TRL's `mean_logits`)."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])["logits"][0]
    first = len(prompt) - 1
    return logits[first : first + len(response)].mean(-1)


def _score(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    return model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])["scores"][0, -1]


def _hand_loss(case: PrefConfig, model: torch.nn.Module, pair: dict[str, Any]) -> torch.Tensor:
    """One pair's loss, from the papers' formulas (TRL's conventions), the pair's sides alone."""
    b, s = case.beta, case.label_smoothing
    if case.loss == "bradley_terry":
        r_c, r_r = _score(model, pair["prompt"], pair["chosen"]), _score(model, pair["prompt"], pair["rejected"])
        return -torch.log(torch.sigmoid(r_c - r_r - pair["margin"])) + case.center_rewards * (r_c + r_r) ** 2
    lc, lr = _side_logps(model, pair["prompt"], pair["chosen"]), _side_logps(model, pair["prompt"], pair["rejected"])
    ref_c, ref_r = pair["ref"]
    if case.loss == "orpo":  # the ORPO paper's eq. (4), (7): odds from the length-averaged log-probabilities
        odds_c, odds_r = (torch.exp(x.mean()) / (1 - torch.exp(x.mean())) for x in (lc, lr))
        return -lc.mean() - case.orpo_lambda * torch.log(torch.sigmoid(torch.log(odds_c / odds_r)))
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


@torch.no_grad()
def hand_z0(model: torch.nn.Module, rows: list[dict[str, Any]]) -> torch.Tensor:
    """KTO's reference point over `rows` (TRL's KTO): the mean of pi - ref of their mismatched sides, clamped at 0."""
    kl = [_side_logps(model, r["prompt"], r["rejected"]).sum() - (r["ref"][1] - KL_SHIFT).sum() for r in rows]
    return torch.clamp(sum(kl) / len(kl), min=0)


def _hand_kto(case: PrefConfig, model: torch.nn.Module, row: dict[str, Any], z0: torch.Tensor) -> torch.Tensor:
    """One KTO row's loss (TRL's KTOTrainer, loss_type "kto"; KTO paper eq. (7)), its reference point given."""
    d = _side_logps(model, row["prompt"], row["chosen"]).sum() - row["ref"][0].sum()
    if row["label"]:
        return case.desirable_weight * (1 - torch.sigmoid(case.beta * (d - z0)))
    return case.undesirable_weight * (1 - torch.sigmoid(case.beta * (z0 - d)))


def hand_reference(case: PrefConfig) -> list[list[torch.Tensor]]:
    """Each step's gradient of the mean of its pairs' losses (float64, one process, one pair at a time; kto: z0 of
    the step's rows first)."""
    model, data = build_model(case), pairs()
    grads = []
    for indices in steps():
        model.zero_grad()
        if case.loss == "kto":
            z0 = hand_z0(model, [data[i] for i in indices])
            loss = sum(_hand_kto(case, model, data[i], z0) for i in indices) / len(indices)
        else:
            loss = sum(_hand_loss(case, model, data[i]) for i in indices) / len(indices)
        loss.backward()
        step = step_gradients(model)
        grads.append(step)
        descend(model, step, LR)
    return grads


def _side(prompt: list[int], response: list[int]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor(prompt + response),
            PREF_LABELS: torch.tensor([-100] * len(prompt) + response)}  # fmt: skip


def pair_item(pair: dict[str, Any], reward_model: bool, kto: bool = False) -> dict[str, Any]:
    item = {"chosen": _side(pair["prompt"], pair["chosen"]), "rejected": _side(pair["prompt"], pair["rejected"])}
    if reward_model:
        item["margin"] = pair["margin"]
    else:
        item["ref_chosen"], item["ref_rejected"] = pair["ref"]
    if kto:
        item["ref_rejected"] = item["ref_rejected"] - KL_SHIFT
        item["label"] = pair["label"]
    return item


def pair_length(pair: dict[str, Any], packed: bool) -> int:
    chosen, rejected = (len(pair["prompt"]) + len(pair[k]) for k in ("chosen", "rejected"))
    return chosen + rejected if packed else 2 * max(chosen, rejected)


def layout_steps(rank: int, world: int, layout: Layout, all_cases: list[PrefConfig],
                 shard_local: bool = False, z0_scope: str = "step") -> dict[str, Any]:  # fmt: skip
    """This rank's run of every case: each step's gradient averaged over the ranks (as FSDP), the loss
    all-reduces over the world each step made (kto: and its KL pass's, `kl_calls`), each step's metrics as the
    trainer logs them (`MetricAccumulator` over the world, then `difference_metrics`) and, kto, the micro-batches of
    this rank with rows of one label only (`one_sided`). Negative control `shard_local`:
    each SP shard applies the loss to its own partial sums; kto's `z0_scope` "rank": each rank's z0 from its own
    rows, "micro": each micro-batch's from its own."""
    from veomni_lite.distributed.parallel_state import init_parallel_state

    state = init_parallel_state(layout.dp, layout.sp) if world > 1 else get_parallel_state()
    loader = StepLoader(lambda x: x, BATCH, layout.micro_batch_size, layout.dp, state.dp_rank, 0, layout.max_tokens,
                        layout.packed)  # fmt: skip
    data = pairs()
    sp_group = state.sp_group if layout.sp > 1 and not shard_local else None
    out: dict[str, Any] = {}
    for case in all_cases:
        reward_model, kto = case.loss == "bradley_terry", case.loss == "kto"
        head = PreferenceLoss.of(case)
        model = build_model(case)
        if layout.sp > 1:
            model.enable_sequence_parallel(state.sp_group)
        grads, calls, metrics, kl_calls, plans, one_sided, shared = [], [], [], [], [], [], 0
        specs = [MetricSpec(metric, "mean") for metric in metric_names(case.loss)]
        for number, indices in enumerate(steps()):
            model.zero_grad(set_to_none=True)
            plan = loader.share(number, indices, lambda i: pair_length(data[i], layout.packed))
            counts = all_gather(len(plan)) if world > 1 else [len(plan)]
            micro_batches = []
            for j in range(max(counts)):
                members = plan[j] if j < len(plan) else plan[0]
                whole = collate_pairs([pair_item(data[i], reward_model, kto) for i in members],
                                      lambda sides: collate(sides, packing=layout.packed, share_prefixes=layout.packed),
                                      reward_model)  # fmt: skip
                if j >= len(plan):
                    whole = padding_micro_batch(whole)
                micro_batches.append(slice_micro_batch(whole, state.sp_rank, layout.sp))
                shared += bool((whole.get(ATTENTION_SEQUENCE_IDS, torch.zeros(1)) <= -2).any())
            plans.append(len(plan))
            if kto:  # the KL pass over the whole step before any loss (the trainer's `kto_pass`)
                with counting_world_all_reduces() as kl_world_calls, torch.no_grad():
                    kl = []
                    for micro_batch in micro_batches:
                        inputs = {k: v for k, v in micro_batch.items() if k in MODEL_INPUTS}
                        output = model(**inputs, logprobs=LogprobRequest(micro_batch[PREF_LABELS]))["logprobs"]
                        kl.append(kto_kl_totals(output, micro_batch))
                    if z0_scope == "micro":
                        for micro_batch, totals_ in zip(micro_batches, kl):
                            micro_batch[KL] = kto_reference_point(totals_)
                    else:
                        group = dist.group.WORLD if world > 1 and z0_scope == "step" else None
                        z0 = kto_reference_point(torch.stack(kl).sum(0), group)
                        for micro_batch in micro_batches:
                            micro_batch[KL] = z0
                kl_calls.append(len(kl_world_calls))
            accumulator, sided = MetricAccumulator(specs, sp_rank=state.sp_rank), 0
            with counting_world_all_reduces() as world_calls:
                step = LossStep(micro_batches, PREF_MODE, marked=True)
                for micro_batch, tokens in step:
                    inputs = {k: v for k, v in micro_batch.items() if k in MODEL_INPUTS}
                    if reward_model:
                        output = model(**inputs)["scores"]
                    else:  # the trainer's path: the LM head fused with the log-probabilities
                        request = LogprobRequest(micro_batch[PREF_LABELS], mean_logits=kto)
                        output = model(**inputs, logprobs=request)
                    mean_logits = output.get("mean_logits") if isinstance(output, dict) else None
                    output = output["logprobs"] if isinstance(output, dict) else output
                    outputs = head(output, micro_batch, sp_group, mean_logits)
                    step.loss({"pref_loss": outputs["pref_loss"]}, tokens).backward()
                    if not bool(micro_batch.get("padding_flag", False)):  # as `MetricLogger.record_micro_batch`
                        for key, (total, count) in outputs["metrics"].items():
                            accumulator.record_total(key, total, count)
                    if kto:
                        counts = [float(outputs["metrics"][f"logps/{k}"][1]) for k in ("chosen", "rejected")]
                        sided += int(min(counts) == 0)
                step.verify()
            step_grads = step_gradients(model, world)
            grads.append(step_grads)
            calls.append(len(world_calls))
            reduced = accumulator.reduce()  # the logger's reduction, then its derived differences
            metrics.append(reduced | difference_metrics(reduced, metric_differences(case.loss)))
            one_sided.append(sided)
            descend(model, step_grads, LR)
        out[name(case)] = {"grads": grads, "calls": calls, "metrics": metrics, "kl_calls": kl_calls, "plans": plans,
                           "one_sided": one_sided, "shared": shared}  # fmt: skip
    return out


@torch.no_grad()
def hand_metrics(case: PrefConfig) -> dict[str, float]:
    """The first step's metrics (TRL's names), by hand from the initial model, one pair at a time."""
    model, data = build_model(case), pairs()
    rows = []
    if case.loss == "kto":
        first = [data[i] for i in steps()[0]]
        z0 = float(hand_z0(model, first))
        out = {"kl": z0}
        for key, label in (("chosen", True), ("rejected", False)):
            mine = [r for r in first if r["label"] == label]
            logps = [float(_side_logps(model, r["prompt"], r["chosen"]).sum()) for r in mine]
            out[f"rewards/{key}"] = sum(
                case.beta * (lp - float(r["ref"][0].sum())) for lp, r in zip(logps, mine)
            ) / len(mine)
            out[f"logps/{key}"] = sum(logps) / len(mine)
            logits = [_side_mean_logits(model, r["prompt"], r["chosen"]) for r in mine]  # token-weighted, as TRL
            out[f"logits/{key}"] = float(sum(x.sum() for x in logits)) / sum(len(x) for x in logits)
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out
    for pair in (data[i] for i in steps()[0]):
        if case.loss == "bradley_terry":
            r_c, r_r = (float(_score(model, pair["prompt"], pair[k])) for k in ("chosen", "rejected"))
            rows.append({"rewards/chosen": r_c, "rewards/rejected": r_r, "rewards/margins": r_c - r_r,
                         "rewards/accuracy": float(r_c > r_r), "rewards/mean": (r_c + r_r) / 2})  # fmt: skip
            continue
        lc, lr = (_side_logps(model, pair["prompt"], pair[k]) for k in ("chosen", "rejected"))
        ref_c, ref_r = pair["ref"]
        if case.loss == "orpo":
            l_c, l_r = float(lc.mean()), float(lr.mean())
            log_odds = (l_c - l_r) - (math.log(1 - math.exp(l_c)) - math.log(1 - math.exp(l_r)))
            c, r = case.orpo_lambda * l_c, case.orpo_lambda * l_r
            rows.append({"rewards/chosen": c, "rewards/rejected": r, "rewards/margins": c - r,
                         "rewards/accuracies": float(c > r), "logps/chosen": l_c, "logps/rejected": l_r,
                         "nll_loss": -l_c, "log_odds_ratio": -math.log1p(math.exp(-log_odds)),
                         "log_odds_chosen": log_odds})  # fmt: skip
            continue
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
