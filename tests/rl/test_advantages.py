"""Group advantages against a hand computation in Python floats (float64), with negative controls: population std
instead of Bessel's, groups taken interleaved instead of consecutive, and the naive formula on a flat group.
REINFORCE++'s batch whitening against verl's per-token formula, with negative controls: a per-rank normalization and
an unweighted (per-response) one."""

from __future__ import annotations

import math

import pytest
import torch

from veomni_lite.config import ConfigError
from veomni_lite.rl.advantages import ADVANTAGES, WHITEN_EPS, group_stats

KINDS = ("grpo", "dr_grpo", "rloo")
EPS = 1e-6
# three groups of four: mixed, flat at 0.1 (whose float mean is not 0.1), binary
REWARDS = [1.0, 0.0, 0.5, 0.25, 0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.0]


def group_advantages(rewards: torch.Tensor, g: int, kind: str) -> torch.Tensor:
    """The registered estimator `kind` (through the registry, as the trainer calls it), its default hyperparameters."""
    entry = ADVANTAGES.get(kind, "rl.advantage")
    return entry.fn(rewards, g, torch.ones_like(rewards, dtype=torch.int64), **entry.hyperparameters)


def batch_advantages(rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return ADVANTAGES.get("reinforce_pp", "rl.advantage").fn(rewards, 1, lengths)


def hand(rewards: list[float], g: int, kind: str, eps: float = EPS, ddof: int = 1) -> list[float]:
    out = []
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g]
        if max(group) == min(group):
            out += [0.0] * g
            continue
        mean = sum(group) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (g - ddof))
        for i, r in enumerate(group):
            if kind == "grpo":
                out.append((r - mean) / (std + eps))
            elif kind == "dr_grpo":
                out.append(r - mean)
            else:
                out.append(r - (sum(group) - group[i]) / (g - 1))
    return out


def close(got: torch.Tensor, expected: list[float], rel: float = 1e-14) -> bool:
    return got.dtype == torch.float64 and all(
        abs(a - b) <= rel * max(1.0, abs(b)) for a, b in zip(got.tolist(), expected, strict=True)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_matches_the_hand_computation(kind):
    got = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, kind)
    assert close(got, hand(REWARDS, 4, kind))


def test_grpo_values_written_out():
    # group [1, 0, 0, 0]: mean 1/4, Bessel std sqrt((9/16 + 3/16) / 3) = 1/2
    got = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), 4, "grpo")
    assert close(got, [0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS)])
    dr = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), 4, "dr_grpo")
    rloo = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), 4, "rloo")
    assert dr.tolist() == [0.75, -0.25, -0.25, -0.25]
    assert close(rloo, [1.0, -1 / 3, -1 / 3, -1 / 3])  # R_i - mean of the other three


def test_negative_control_population_std_differs():
    got = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, "grpo")
    population = hand(REWARDS, 4, "grpo", ddof=0)
    assert not close(got, population, rel=1e-3)
    # Bessel vs population differ by sqrt(G / (G - 1)) on every non-flat entry (eps aside)
    assert abs(got[0].item() / population[0] - math.sqrt(3 / 4)) < 1e-5


def test_rloo_is_g_over_g_minus_one_times_dr_grpo():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    rloo, dr = group_advantages(rewards, 4, "rloo"), group_advantages(rewards, 4, "dr_grpo")
    assert torch.allclose(rloo, dr * 4 / 3, rtol=1e-14, atol=1e-15)


def test_groups_are_consecutive_runs():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    for kind in KINDS:
        assert group_advantages(rewards, 2, kind).tolist() == [0.0] * 4
    # negative control: grouping the same rewards interleaved ((1, 0), (1, 0)) gives a signal
    assert hand([1.0, 0.0, 1.0, 0.0], 2, "dr_grpo") == [0.5, -0.5, 0.5, -0.5]


@pytest.mark.parametrize("kind", KINDS)
def test_a_flat_group_is_exactly_zero(kind):
    for value, g in ((0.1, 3), (0.7, 6), (1.0, 8), (-2.5, 2)):
        rewards = torch.full((g,), value, dtype=torch.float64)
        got = group_advantages(rewards, g, kind)
        assert got.tolist() == [0.0] * g and not torch.signbit(got).any()
    # negative control: the naive formula leaves a rounding residue on [0.1] * 3 (its float mean is not 0.1)
    flat = torch.full((3,), 0.1, dtype=torch.float64)
    naive = (flat - flat.mean()) / (flat.std() + EPS)
    assert naive.abs().max().item() > 1e-12


def test_group_size_one_and_bad_inputs():
    one = torch.tensor([1.0, 0.0], dtype=torch.float64)
    for kind in ("grpo", "rloo"):
        with pytest.raises(ValueError, match=f"{kind} needs at least 2 responses per prompt"):
            group_advantages(one, 1, kind)
    assert group_advantages(one, 1, "dr_grpo").tolist() == [0.0, 0.0]
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'ppo'; expected one of \['grpo', 'dr_grpo'"):
        group_advantages(one, 2, "ppo")
    with pytest.raises(ValueError, match="3 rewards do not split into groups of 2"):
        group_advantages(torch.zeros(3, dtype=torch.float64), 2, "grpo")
    with pytest.raises(ValueError, match="1-D floating-point tensor"):
        group_advantages(torch.zeros(2, 2, dtype=torch.float64), 2, "grpo")
    with pytest.raises(ValueError, match="1-D floating-point tensor"):
        group_advantages(torch.zeros(2, dtype=torch.int64), 2, "grpo")
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        group_advantages(one, 0, "grpo")
    with pytest.raises(ValueError, match="reward 2 is nan, not finite"):
        group_advantages(torch.tensor([1.0, 0.0, math.nan, 0.0], dtype=torch.float64), 2, "grpo")
    assert group_advantages(torch.zeros(0, dtype=torch.float64), 4, "grpo").numel() == 0


def test_float32_in_float32_out_computed_in_float64():
    rewards32 = torch.tensor(REWARDS, dtype=torch.float32)
    got = group_advantages(rewards32, 4, "grpo")
    assert got.dtype == torch.float32
    reference = torch.tensor(hand(rewards32.double().tolist(), 4, "grpo"), dtype=torch.float64).float()
    assert torch.equal(got, reference)


def test_group_stats_counts_flat_groups():
    stats = group_stats(torch.tensor(REWARDS, dtype=torch.float64), 4)
    assert stats["groups"].item() == 3 and stats["groups_zero_std"].item() == 1
    assert stats["groups"].dtype == stats["groups_zero_std"].dtype == torch.int64
    assert stats["frac_reward_zero_std"].dtype == torch.float64 and stats["frac_reward_zero_std"].item() == 1 / 3
    # two flat groups of different values, one with a single differing entry
    stats = group_stats(torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 1.0 + 2**-40], dtype=torch.float64), 2)
    assert (stats["groups"].item(), stats["groups_zero_std"].item()) == (3, 2)
    assert math.isnan(group_stats(torch.zeros(0, dtype=torch.float64), 2)["frac_reward_zero_std"].item())


# ---- REINFORCE++ (rl.advantage: reinforce_pp): whitened over the whole batch's response tokens ----

PP_REWARDS = [1.0, 0.0, 0.5, 0.25, 0.1, 0.1, 1.0, 0.0, 0.0, 0.0, 0.3]  # 11 responses (uneven over ranks)
PP_LENGTHS = [3, 7, 1, 4, 9, 2, 5, 5, 6, 1, 8]


def hand_reinforce_pp(rewards: list[float], lengths: list[int]) -> list[float]:
    """verl's masked_whiten over per-token returns, written out token by token in Python floats."""
    tokens = [r for r, n in zip(rewards, lengths) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    return [(r - mean) / math.sqrt(var + WHITEN_EPS) for r in rewards]


def test_reinforce_pp_matches_the_per_token_whitening():
    got = batch_advantages(torch.tensor(PP_REWARDS, dtype=torch.float64), torch.tensor(PP_LENGTHS))
    assert close(got, hand_reinforce_pp(PP_REWARDS, PP_LENGTHS), rel=1e-12)
    # token-weighted: the whitened per-token values have mean 0 and (Bessel) variance 1 - eps share
    weights = torch.tensor(PP_LENGTHS, dtype=torch.float64)
    assert abs((got * weights).sum().item()) < 1e-12


def test_reinforce_pp_negative_controls_per_rank_and_unweighted_statistics_differ():
    rewards, lengths = torch.tensor(PP_REWARDS, dtype=torch.float64), torch.tensor(PP_LENGTHS)
    world = batch_advantages(rewards, lengths)
    # a rank whitening its own share (samples i mod 2) gets other advantages than the world's batch
    for rank in range(2):
        share = torch.arange(rank, len(PP_REWARDS), 2)
        local = batch_advantages(rewards[share], lengths[share])
        assert not torch.allclose(local, world[share], rtol=1e-3)
    # sample-weighted statistics (each response counted once) are not the token-weighted ones
    unweighted = batch_advantages(rewards, torch.ones_like(lengths))
    assert not torch.allclose(unweighted, world, rtol=1e-3)


def test_reinforce_pp_flat_batch_and_bad_inputs():
    flat = torch.full((5,), 0.1, dtype=torch.float64)
    assert batch_advantages(flat, torch.tensor([1, 2, 3, 4, 5])).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="needs at least 2"):
        batch_advantages(torch.tensor([1.0], dtype=torch.float64), torch.tensor([1]))
    with pytest.raises(ValueError, match="lengths must be"):
        batch_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="not finite"):
        batch_advantages(torch.tensor([1.0, math.inf], dtype=torch.float64), torch.tensor([1, 2]))
