"""The importance-sampling corrections (`rl.importance_sampling`) on one micro-batch against a hand computation: each
weight of given behaviour (engine) log-probabilities, its metrics, masking against truncating (they differ exactly on
the tokens outside the bounds), a whole sequence dropped, decoupled PPO's raw weight, the mismatch metrics of packed
sequences, and the config's checks."""

from __future__ import annotations

import math

import pytest
import torch

from tests.rl.test_policy_loss_unit import batch, outputs_of
from veomni_lite.config import ConfigError, load_config
from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS
from veomni_lite.post_training import sequence_sums
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.policy_loss import (
    ADVANTAGES,
    ENGINE_LOGPROBS,
    OLD_LOGPROBS,
    POLICY_LABELS,
    PolicyLoss,
    engine_mismatch,
)
from veomni_lite.rl.records import engine_mismatch_metrics, rollout_specs
from veomni_lite.rl.rollouts import RolloutSample

# old - engine per position: row 0 (sequence 0) and row 1 (sequence 1); positions 0-1 of row 0 and 4-5 of row 1 are
# not targets (`batch`). Ratios 0.5 (below 0.8), 1.0, 1.5 (above 1.25) on each row's targets.
LOG_RATIOS = torch.log(
    torch.tensor([[9.0, 9.0, 0.5, 1.0, 1.5, 1.1], [1.0, 1.5, 0.9, 0.5, 9.0, 9.0]], dtype=torch.float64)
)
BOUNDS = {"is_low": 0.8, "is_cap": 1.25}


def micro_batch() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, mb = batch()
    mb[ENGINE_LOGPROBS] = mb[OLD_LOGPROBS] - LOG_RATIOS
    return logits, mb


def pg_loss(importance_sampling: str, bounds: dict, decoupled: bool = False, engine: bool = True) -> dict:
    """The loss (kl and entropy off) and metrics of ppo_clip with a correction on `micro_batch`."""
    logits, mb = micro_batch()
    if not engine:
        del mb[ENGINE_LOGPROBS]
    loss = PolicyLoss("ppo_clip", importance_sampling=importance_sampling, is_hyperparameters=bounds,
                      decoupled=decoupled)  # fmt: skip
    return loss(outputs_of(logits, mb), mb)


def hand(weights: torch.Tensor) -> torch.Tensor:
    """The token-mean of w_t pg_t over the valid tokens, pg_t ppo_clip's (clip 0.2) from the definition."""
    logits, mb = micro_batch()
    labels = mb[POLICY_LABELS]
    valid = labels != IGNORE_INDEX
    logp = torch.log_softmax(logits.detach(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ratio, a = torch.exp(logp - mb[OLD_LOGPROBS]), mb[ADVANTAGES]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    return (weights * pg)[valid].mean()


RATIOS = LOG_RATIOS.exp()
VALID = batch()[1][POLICY_LABELS] != IGNORE_INDEX


def test_token_corrections_truncate_or_mask_each_token():
    truncated = pg_loss("token", {"is_cap": 1.25})
    assert torch.allclose(truncated["policy_loss"], hand(RATIOS.clamp(max=1.25)), rtol=1e-12, atol=0)
    inside = (RATIOS >= 0.8) & (RATIOS <= 1.25)
    for name in ("token_mask", "icepop"):
        masked = pg_loss(name, BOUNDS)
        assert torch.allclose(masked["policy_loss"], hand(torch.where(inside, RATIOS, 0.0)), rtol=1e-12, atol=0)
        assert [float(v) for v in masked["metrics"]["rl/is/masked_ratio"]] == [4.0, 8.0]  # 0.5, 1.5, 1.5, 0.5
    assert [float(v) for v in truncated["metrics"]["rl/is/truncated_ratio"]] == [2.0, 8.0]  # the two 1.5s
    # negative control: masking and truncating differ, and exactly by the tokens outside the bounds
    outside = VALID & ~inside
    difference = hand(torch.where(outside, RATIOS.clamp(max=1.25), 0.0))
    assert abs(float(difference)) > 1e-3
    assert torch.allclose(truncated["policy_loss"] - pg_loss("token_mask", BOUNDS)["policy_loss"], difference)


def test_sequence_corrections_weigh_or_drop_whole_sequences():
    sums = torch.where(VALID, LOG_RATIOS, 0.0).sum(1, keepdim=True).exp().expand_as(RATIOS)  # 0.825 and 0.675
    assert torch.allclose(sums[:, 0], torch.tensor([0.825, 0.675], dtype=torch.float64))
    truncated = pg_loss("sequence", {"is_cap": 0.7})
    assert torch.allclose(truncated["policy_loss"], hand(sums.clamp(max=0.7)), rtol=1e-12, atol=0)
    assert [float(v) for v in truncated["metrics"]["rl/is/truncated_ratio"]] == [4.0, 8.0]  # sequence 0's tokens
    masked = pg_loss("sequence_mask", BOUNDS)  # sequence 1 (0.675 < 0.8) is dropped whole
    expected = hand(torch.where(torch.tensor([[True], [False]]), sums, 0.0))
    assert torch.allclose(masked["policy_loss"], expected, rtol=1e-12, atol=0)
    assert [float(v) for v in masked["metrics"]["rl/is/masked_ratio"]] == [4.0, 8.0]
    # negative control: a per-token mask is not the sequence's
    assert not torch.allclose(pg_loss("token_mask", BOUNDS)["policy_loss"], masked["policy_loss"])


def test_decoupled_ppo_weighs_by_the_raw_behaviour_ratio_and_none_alone_by_nothing():
    decoupled = pg_loss("none", {}, decoupled=True)
    assert torch.allclose(decoupled["policy_loss"], hand(RATIOS), rtol=1e-12, atol=0)
    plain = pg_loss("none", {})
    assert torch.allclose(plain["policy_loss"], hand(torch.ones_like(RATIOS)), rtol=1e-12, atol=0)
    assert not torch.allclose(decoupled["policy_loss"], plain["policy_loss"])  # the weight matters here
    # a correction under decoupled weighs as it does alone (the ratio is the old pass's either way)
    assert torch.equal(pg_loss("token_mask", BOUNDS, decoupled=True)["policy_loss"],
                       pg_loss("token_mask", BOUNDS)["policy_loss"])  # fmt: skip
    # rollouts given without the engine's log-probabilities are not weighted
    assert torch.equal(pg_loss("none", {}, decoupled=True, engine=False)["policy_loss"], plain["policy_loss"])


def test_truncated_corrections_are_unchanged_bit_for_bit():
    """token / sequence as before the registry: pg min(exp(d), is_cap), d summed over the sequence (`sequence_sums`)."""
    logits, mb = micro_batch()
    labels = mb[POLICY_LABELS]
    valid = labels != IGNORE_INDEX
    logp = torch.log_softmax(logits.detach(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    old, engine = (torch.where(valid, mb[key], 0.0) for key in (OLD_LOGPROBS, ENGINE_LOGPROBS))
    ratio, a = torch.exp(torch.where(valid, torch.where(valid, logp, 0.0) - old, 0.0)), mb[ADVANTAGES]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    for name, cap in (("token", 1.25), ("sequence", 0.7)):
        d = torch.where(valid, old - engine, 0.0)
        d = sequence_sums(d, mb[SEQUENCE_IDS]) if name == "sequence" else d
        expected = torch.where(valid, pg * torch.exp(d).clamp(max=cap), 0.0).sum() / valid.double().sum()
        assert torch.equal(pg_loss(name, {"is_cap": cap})["policy_loss"], expected)


def test_the_mismatch_metrics_are_verls_over_packed_sequences():
    """`rl/mismatch/kl` the mean of engine - old; `rl/mismatch/ppl_ratio` the mean over sequences of exp(mean of
    engine - old): two sequences packed in one row, a third in the next, padding between; and the same from the
    samples of an off-policy batch (the records' path)."""
    olds = [[-1.0, -2.0], [-0.5, -3.0, -0.7], [-0.2]]
    engines = [[-1.5, -1.0], [-0.5, -2.0, -0.1], [-0.9]]
    diffs = [[e - o for o, e in zip(old, engine)] for old, engine in zip(olds, engines)]
    kl = sum(map(sum, diffs)) / 6
    ppl_ratio = sum(math.exp(sum(d) / len(d)) for d in diffs) / 3
    rows = ([[*v[0], *v[1], 0.0], [*v[2], *[0.0] * 5]] for v in (olds, engines))
    old, engine = (torch.tensor(r, dtype=torch.float64) for r in rows)
    sequences = torch.tensor([[0, 0, 1, 1, 1, -1], [2, -1, -1, -1, -1, -1]])
    packed = engine_mismatch(old, engine, sequences >= 0, sequences)
    samples = [RolloutSample(group=0, prompt_ids=[1], response_ids=[1] * len(o)) for o in olds]
    for sample, o, e in zip(samples, olds, engines):
        sample.old_logprobs, sample.engine_logprobs = o, e
    for metrics in (packed, engine_mismatch_metrics(samples)):
        total, count = metrics["rl/mismatch/kl"]
        assert float(count) == 6 and float(total) / 6 == pytest.approx(kl, rel=1e-12)
        total, count = metrics["rl/mismatch/ppl_ratio"]
        assert float(count) == pytest.approx(3.0, rel=1e-12)
        assert float(total) / float(count) == pytest.approx(ppl_ratio, rel=1e-12)
    # negative control: one sequence per row position (no sequence ids) is a per-token mean, not verl's
    tokens = engine_mismatch(old, engine, sequences >= 0, torch.where(sequences >= 0, torch.arange(6), -1))
    assert float(tokens["rl/mismatch/ppl_ratio"][1]) == pytest.approx(6.0)
    assert float(tokens["rl/mismatch/ppl_ratio"][0]) / 6 != pytest.approx(ppl_ratio, rel=1e-3)


def rl_config(*extra: str):
    args = ["--rl.rollouts_path", "given.jsonl", "--rl.prompts_per_step", "2", "--rl.num_generations", "2",
            "--train.global_batch_size", "4", "--train.micro_batch_size", "1", *extra]  # fmt: skip
    return load_config(None, args, world_size=1, sections={"rl": RLConfig}).rl


def test_the_config_reads_and_checks_the_corrections():
    rl = rl_config("--rl.importance_sampling", "icepop", "--rl.is_low", "0.5", "--rl.is_cap", "5")
    loss = PolicyLoss.of(rl)
    assert loss.is_hyperparameters == {"is_low": 0.5, "is_cap": 5.0} and not loss.decoupled
    assert PolicyLoss.of(rl_config("--rl.importance_sampling", "token")).is_hyperparameters == {"is_cap": 2.0}
    assert PolicyLoss.of(rl_config("--rl.decoupled", "true")).decoupled
    names = [spec.name for spec in rollout_specs(rl, reward_names=[])]
    assert "rl/is/masked_ratio" in names and "rl/is/truncated_ratio" not in names
    assert {"rl/mismatch/kl", "rl/mismatch/ppl_ratio"} <= set(names)
    with pytest.raises(ConfigError, match=r"rl.importance_sampling: unknown .* 'token_masked' \(did you mean"):
        rl_config("--rl.importance_sampling", "token_masked")
    with pytest.raises(ConfigError, match=r"rl.is_low: must be in \[0, rl.is_cap = 2.0\), got 2"):
        rl_config("--rl.importance_sampling", "sequence_mask", "--rl.is_low", "2")
    rl_config("--rl.importance_sampling", "token", "--rl.is_low", "2")  # token does not read is_low
    with pytest.raises(ConfigError, match=r"rl.is_cap: must be > 0, got 0"):
        rl_config("--rl.importance_sampling", "token_mask", "--rl.is_cap", "0", "--rl.is_low", "0")
    with pytest.raises(ValueError, match=r"correction 'token' takes \['is_cap'\], not \['is_low'\]"):
        PolicyLoss(importance_sampling="token", is_hyperparameters={"is_low": 0.5})


def test_async_generation_needs_a_correction_or_decoupled_ppo():
    args = ["--rl.engine", "vllm", "--rl.vllm", "{url: 'http://127.0.0.1:1'}", "--rl.async_steps", "1",
            "--rl.rewards", "[{name: m, function: exact_match, weight: 1.0}]", "--rl.prompts_per_step", "2",
            "--rl.num_generations", "2", "--train.global_batch_size", "4", "--train.micro_batch_size", "1"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"rl.async_steps: .* set rl.importance_sampling \(token, .*icepop\) or rl.d"):
        load_config(None, args, world_size=1, sections={"rl": RLConfig})
    for extra in (["--rl.decoupled", "true"], ["--rl.importance_sampling", "sequence_mask"]):
        load_config(None, [*args, *extra], world_size=1, sections={"rl": RLConfig})


def test_sequence_sums_of_a_padded_micro_batch_with_more_rows_than_positions():
    """A padded row's id is its row: 64 rows of 4 positions (one optimizer step per rollout batch) sum per row, as a
    plain loop does (it raised IndexError when ids reached the row's length)."""
    rows, length = 64, 4
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(rows, length, dtype=torch.float64, generator=gen)
    ids = torch.arange(rows).unsqueeze(1).expand(rows, length).clone()
    ids[:, -1] = -1  # padding
    expected = torch.stack([torch.where(ids[r] >= 0, values[r, :-1].sum(), 0.0) for r in range(rows)])
    assert torch.equal(sequence_sums(values, ids), expected)
