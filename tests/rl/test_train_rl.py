"""`trainers/train_rl.py`'s trainer on given rollouts (`rl.rollouts_path`): every layout logs the same per-step
policy loss and grad norm; an interrupt inside a rollout batch resumes to the uninterrupted run, also on another world
size; bad rollouts and configs are named errors."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_distributed, run_ranks
from tests.float32_bounds import cancelling_atol
from tests.trainer.helpers import read_events, train_built
from veomni_lite.config import ConfigError, load_config
from veomni_lite.data.checks import DataError
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.trainer import RLTrainer

RTOL = 1e-5


def write_rollouts(
    path: Path, groups: int = 8, group_size: int = 4, vocab: int = 2000, seed: int = 0, episodes: bool = False
) -> Path:
    """Rollouts of random tokens (prompts of 3-8, responses of 1-9), rewards in [0, 1), engine log-probabilities,
    one truncated response. `episodes`: each group's second response is an episode instead (`turns`: the model's
    tokens, a tool's 2-4, the model's 1-3)."""
    rng = random.Random(seed)
    rows = []
    for group in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        for j in range(group_size):
            response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
            row = {"group": f"g{group}", "prompt_ids": prompt, "response_ids": response,
                   "reward": round(rng.random(), 3), "logprobs": [-7.6 + 0.3 * rng.random() for _ in response],
                   "truncated": (group, j) == (1, 3)}  # fmt: skip
            if episodes and j == 1:
                tool = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 4))]
                answer = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 3))]
                row["turns"] = [{"role": "assistant", "ids": row.pop("response_ids")}, {"role": "tool", "ids": tool},
                                {"role": "assistant", "ids": answer}]  # fmt: skip
                row["logprobs"] += [0.0] * len(tool) + [-7.6 + 0.3 * rng.random() for _ in answer]
            rows.append(row)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rl_args(demo: Path, rollouts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model.arch", "auto", "--model.pretrained_dir", str(demo / "models/qwen2_help"),
        "--rl.rollouts_path", str(rollouts), "--rl.prompts_per_step", "4", "--rl.num_generations", "4",
        "--rl.epochs", "2", "--rl.kl_coef", "0.1", "--rl.importance_sampling", "token", "--rl.mask_truncated", "true",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.max_steps", "8",
        "--train.output_dir", str(out), "--optim.lr", "1e-3", "--optim.warmup_steps", "0",
        "--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", *extra,
    ]  # fmt: skip


def config(args: list[str], world_size: int = 1) -> Any:
    return load_config(None, args, world_size=world_size, sections={"rl": RLConfig})


def train(args: list[str], world_size: int = 1, stop_after: int | None = None) -> None:
    train_built(RLTrainer(config(args, world_size)), stop_after)


def _ranked(rank: int, world: int, args: list[str]) -> None:
    train(args, world)


def by_step(out: Path, key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in read_events(out) if key in e}


def cancelling_bounds(run: Path) -> dict[str, dict[int, float]]:
    """Per step of run `run`, the absolute bounds (tests/float32_bounds.py) of the policy loss and `rl/kl`: both are
    built from per-token differences of float32 log-probabilities (new - old, ref - new), each log-probability about
    as large as the policy's entropy here (random tokens under a near-uniform random model); the loss weighs them by
    advantages up to max |A| and ratios up to 1 + clip_high (at most 2)."""
    entropy = by_step(run, "rl/entropy")
    advantage = max(abs(v) for key in ("rl/advantage/min", "rl/advantage/max") for v in by_step(run, key).values())
    return {
        "rl/kl": {step: cancelling_atol(2 * h, step) for step, h in entropy.items()},
        "train/policy_loss": {step: cancelling_atol(2 * h * advantage * 2, step) for step, h in entropy.items()},
    }


def assert_same(got: dict[int, float], expected: dict[int, float], bound: dict[int, float] | None, what: Any) -> None:
    """Step by step within RTOL, or within `bound`'s absolute value at that step (a cancelling quantity)."""
    assert sorted(got) == sorted(expected), what
    for step, value in expected.items():
        tolerance = bound[step] if bound else 1e-7
        assert got[step] == pytest.approx(value, rel=RTOL, abs=tolerance), (what, step, got, expected)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rollouts(tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl")


@pytest.mark.slow
def test_given_rollouts_train_alike_at_one_process_dp2_and_sp2_packed(demo, rollouts, tmp_path):
    train(rl_args(demo, rollouts, tmp_path / "one"))
    reference = {key: by_step(tmp_path / "one", key) for key in ("train/policy_loss", "train/grad_norm")}
    assert sorted(reference["train/policy_loss"]) == list(range(1, 9))
    layouts = {
        "dp2": [],
        "sp2": ["--parallel.sp_size", "2", "--data.packing", "true", "--data.max_tokens_per_micro_batch", "40"],
    }
    bounds = cancelling_bounds(tmp_path / "one")
    for name, extra in layouts.items():
        run_distributed(_ranked, 2, rl_args(demo, rollouts, tmp_path / name, *extra), timeout_s=600)
        for key, expected in reference.items():
            assert_same(by_step(tmp_path / name, key), expected, bounds.get(key), (name, key))
    # packed at 1 process, each group's prompt run once (data.shared_prefix): the same steps from fewer tokens
    train(rl_args(demo, rollouts, tmp_path / "packed", "--data.packing", "true"))
    for key, expected in reference.items():
        assert_same(by_step(tmp_path / "packed", key), expected, bounds.get(key), ("packed", key))
    tokens = {name: by_step(tmp_path / name, "train/tokens") for name in ("one", "packed")}
    assert all(tokens["packed"][step] < tokens["one"][step] for step in tokens["one"]), tokens
    events = read_events(tmp_path / "one")
    first = events[0]
    assert 0.0 <= first["rl/reward/min"] < first["rl/reward/mean"] < first["rl/reward/max"] < 1.0
    assert 0.0 < first["rl/truncated_ratio"] < 1.0 and first["rl/kl"] == pytest.approx(0.0, abs=1e-12)
    assert {"rl/importance_ratio/mean", "rl/logprob_diff", "rl/entropy", "time/generate_s"} <= set(first)


@pytest.mark.slow
def test_an_interrupt_inside_a_rollout_batch_resumes_to_the_uninterrupted_run(demo, tmp_path):
    """Rollouts holding episodes: stopped at step 3 of a batch of 4, resumed on another world size."""
    rollouts = write_rollouts(tmp_path / "episodes.jsonl", episodes=True)
    train(rl_args(demo, rollouts, tmp_path / "whole"))
    expected = by_step(tmp_path / "whole", "train/policy_loss")
    train(rl_args(demo, rollouts, tmp_path / "cut"), stop_after=3)  # step 3 of a batch of 4 steps
    assert sorted(by_step(tmp_path / "cut", "train/policy_loss")) == [1, 2, 3]
    resume = rl_args(demo, rollouts, tmp_path / "cut", "--checkpoint.resume", "true")
    run_distributed(_ranked, 2, resume, timeout_s=600)  # on another world size
    bound = cancelling_bounds(tmp_path / "whole")["train/policy_loss"]
    assert_same(by_step(tmp_path / "cut", "train/policy_loss"), expected, bound, "resumed")


def test_bad_rollouts_and_rl_configs_are_named_errors(demo, tmp_path):
    bad = tmp_path / "bad.jsonl"
    write_rollouts(bad, groups=2)
    rows = bad.read_text().splitlines()
    rows[5] = rows[5].replace('"reward"', '"score"')
    bad.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl, row 5 \(0-based\): missing \['reward'\]"):
        RLTrainer(config(rl_args(demo, bad, tmp_path / "out", "--train.max_steps", "1")))
    with pytest.raises(ConfigError, match="must divide the rollout batch"):
        config(rl_args(demo, bad, tmp_path / "out", "--train.global_batch_size", "12"))
    with pytest.raises(ConfigError, match="unknown config key 'rl.temprature'"):
        config(rl_args(demo, bad, tmp_path / "out", "--rl.temprature", "0.5"))
    with pytest.raises(ConfigError, match="unknown config key 'rl.epochs'"):
        load_config(None, ["--rl.epochs", "2"], world_size=1)


def _run_returning_samples(rank: int, world: int, args: list[str]) -> list[dict[str, Any]]:
    trainer = RLTrainer(config(args, world))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    return [vars(s) for s in trainer.rollouts.last]


@pytest.mark.slow
def test_rollout_metrics_equal_a_hand_computation_over_the_window_at_dp2(demo, rollouts, tmp_path):
    """One log window of 4 steps holds one rollout batch (16 responses, DP=2): every rollout metric is the hand
    computation over the whole batch, though each rank records only the groups it holds."""
    args = rl_args(demo, rollouts, tmp_path, "--train.max_steps", "4", "--logging.log_interval", "4")
    samples = run_distributed(_run_returning_samples, 2, args, timeout_s=600)[0]
    (event,) = [e for e in read_events(tmp_path) if "rl/reward/mean" in e]
    rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float64)
    groups = rewards.view(-1, 4)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).reshape(-1)
    lengths = torch.tensor([len(s["response_ids"]) for s in samples], dtype=torch.float64)
    old = torch.tensor([x for s in samples for x in s["old_logprobs"]], dtype=torch.float64)
    engine = torch.tensor([x for s in samples for x in s["engine_logprobs"]], dtype=torch.float64)
    expected = {
        "rl/reward/mean": rewards.mean(), "rl/reward/std": rewards.std(correction=0),
        "rl/reward/min": rewards.min(), "rl/reward/max": rewards.max(),
        "rl/advantage/mean": advantages.mean(), "rl/advantage/std": advantages.std(correction=0),
        "rl/advantage/min": advantages.min(), "rl/advantage/max": advantages.max(),
        "rl/response_length/mean": lengths.mean(), "rl/response_length/min": lengths.min(),
        "rl/response_length/max": lengths.max(),
        "rl/truncated_ratio": torch.tensor(sum(s["truncated"] for s in samples) / len(samples)),
        "rl/frac_reward_zero_std": (groups == groups[:, :1]).all(1).double().mean(),
        "rl/importance_ratio/mean": (old - engine).exp().mean(), "rl/importance_ratio/min": (old - engine).exp().min(),
        "rl/importance_ratio/max": (old - engine).exp().max(), "rl/logprob_diff": (old - engine).abs().mean(),
        "rl/mismatch/kl": (engine - old).mean(),  # verl's kl and ppl_ratio (a mean over the responses)
        "rl/mismatch/ppl_ratio": torch.stack([(torch.tensor(s["engine_logprobs"], dtype=torch.float64)
            - torch.tensor(s["old_logprobs"], dtype=torch.float64)).mean().exp() for s in samples]).mean(),
    }  # fmt: skip
    for key, value in expected.items():
        assert event[key] == pytest.approx(float(value), rel=1e-9, abs=1e-12), key
    assert [s["advantage"] for s in samples] == pytest.approx(advantages.tolist(), abs=1e-12)


def _run_counting_forwards(rank: int, world: int, args: list[str]) -> dict[str, list[int]]:
    """Train; this rank's planned micro-batches per rollout batch (`prepare`), and the log-probability forwards it
    ran (`logprobs`: old and reference, padding included) per rollout batch."""
    trainer = RLTrainer(config(args, world))
    planned, forwards = [], []
    pipeline = trainer.rollouts
    make, logprobs = pipeline.make, pipeline.context.logprobs

    def counted_make(*args: Any) -> Any:
        forwards.append(0)
        out = make(*args)
        planned.append(sum(len(micro_batches) for micro_batches in out.micro_batches))
        return out

    def counted_logprobs(micro_batch: Any, temperature: float) -> Any:
        forwards[-1] += 1
        return logprobs(micro_batch, temperature)

    pipeline.make, pipeline.context = counted_make, dataclasses.replace(pipeline.context, logprobs=counted_logprobs)
    train_built(trainer)
    return {"planned": planned, "forwards": forwards}


# 4 responses a rank per mini-batch packed under 24 tokens: the ranks plan 5 and 4 micro-batches for rollout batch 0,
# 4 and 5 for batch 1 (dp ranks 0 and 1).
UNEVEN = ["--data.packing", "true", "--data.max_tokens_per_micro_batch", "24", "--parallel.collective_timeout_s", "60"]


@pytest.mark.slow
def test_uneven_token_budget_plans_compute_old_and_reference_logprobs_like_one_process(demo, rollouts, tmp_path):
    """The old and reference log-probability pass runs one FSDP forward per micro-batch: with plans of 5 and 4
    micro-batches every rank runs 5 (a padding forward on the shorter plan) instead of one rank waiting in a forward
    that the other never joins; the run equals one process step by step, at DP=2 and DP=2 x SP=2."""
    train(rl_args(demo, rollouts, tmp_path / "one"))
    reference = {key: by_step(tmp_path / "one", key) for key in ("train/policy_loss", "train/grad_norm", "rl/kl")}
    bounds = cancelling_bounds(tmp_path / "one")
    assert sorted(reference["train/policy_loss"]) == list(range(1, 9))
    for name, world, extra in (("dp2", 2, []), ("dp2sp2", 4, ["--parallel.sp_size", "2"])):
        args = rl_args(demo, rollouts, tmp_path / name, *UNEVEN, *extra)
        ranks = run_distributed(_run_counting_forwards, world, args, timeout_s=600, pg_timeout_s=60)
        sp = world // 2
        assert [r["planned"] for r in ranks] == [[5, 4]] * sp + [[4, 5]] * sp, (name, ranks)
        assert all(r["forwards"] == [2 * 5, 2 * 5] for r in ranks), (name, ranks)  # old + reference, 5 each
        for key, expected in reference.items():
            assert_same(by_step(tmp_path / name, key), expected, bounds.get(key), (name, key))


def _collate_error_on_rank_one(
    rank: int, world: int, args: list[str], call: int = 2, agreed: bool = True
) -> dict[str, Any]:
    """Train; rank 1's `call`-th collate fails (the second: its second micro-batch of the old / reference
    log-probability pass; on policy without a reference the first is the training micro-batches'). `agreed=False`:
    the negative control, the training micro-batches' collate error raised as it is (not a DataError the loop
    agrees)."""
    if not agreed:
        import veomni_lite.rl.logprob_pass as logprob_pass

        def as_it_is(exc: Exception, where: str = "") -> Exception:
            raise exc

        logprob_pass.data_problem = as_it_is
    trainer = RLTrainer(config(args, world))
    collate, calls = trainer.rollouts.context.collate, []

    def failing_collate(samples: Any) -> Any:
        calls.append(1)
        if rank == 1 and len(calls) == call:
            raise ValueError("response 5: 'input_ids' and 'labels' differ in length")
        return collate(samples)

    forwards, logprobs = [], trainer.rollouts.context.logprobs
    trainer.rollouts.context = dataclasses.replace(
        trainer.rollouts.context,
        collate=failing_collate,
        logprobs=lambda batch, temperature: forwards.append(1) or logprobs(batch, temperature),
    )
    try:
        train_built(trainer)
        outcome = "trained"
    except Exception as exc:  # noqa: BLE001 - the test asserts which error each rank raised
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome, "forwards": len(forwards)}


@pytest.mark.slow
def test_a_collate_error_on_one_rank_in_the_logprob_pass_is_agreed_before_any_forward(demo, rollouts, tmp_path):
    """Issue 48: the old / reference pass collates and slices every micro-batch before its first forward and agrees
    the error with the forward count, in its one all-reduce: the same DataError on both ranks naming rank 1, no
    forward run, well within the 4 s collective timeout (the negative control below shows this harness's hang)."""
    args = rl_args(demo, rollouts, tmp_path, "--train.max_steps", "1", "--parallel.collective_timeout_s", "4")
    outcomes = run_ranks(_collate_error_on_rank_one, 2, args, timeout_s=300, pg_timeout_s=4)
    results = [outcomes[rank] for rank in (0, 1)]
    assert [status for status, _ in results] == ["ok", "ok"], results
    expected = "DataError: RL log-probability pass: rank 1: ValueError: response 5: 'input_ids' and 'labels' differ"
    assert results[1][1]["outcome"].startswith(expected), results
    assert results[0][1]["outcome"] == results[1][1]["outcome"], results
    assert [r["forwards"] for _, r in results] == [0, 0], results
    # on policy without a reference no pass runs: the training micro-batches' collate fails, the loop agrees it
    on_policy = ["--rl.epochs", "1", "--rl.prompts_per_step", "2", "--rl.kl_coef", "0"]
    outcomes = run_ranks(_collate_error_on_rank_one, 2, [*args, *on_policy], 1, timeout_s=300, pg_timeout_s=4)
    results = [outcomes[rank] for rank in (0, 1)]
    assert [status for status, _ in results] == ["ok", "ok"], results
    expected = "DataError: step 1: rank 1: RL micro-batches: ValueError: response 5: 'input_ids' and 'labels' differ"
    assert results[1][1]["outcome"].startswith(expected), results
    assert results[0][1]["outcome"] == results[1][1]["outcome"], results
    outcomes = run_ranks(_collate_error_on_rank_one, 2, [*args, *on_policy], 1, False, timeout_s=300, pg_timeout_s=4)
    assert outcomes[1][1]["outcome"].startswith("ValueError: response 5"), outcomes  # rank 1 leaves the loop alone
    lost = outcomes[0][1]["outcome"]  # rank 0, in the loop's agreement, loses its peer: the cause is not there
    assert lost.startswith("CollectiveError: rank 0: all_reduce") and "response 5" not in lost, outcomes


def _run_unpadded(rank: int, world: int, args: list[str]) -> None:
    import veomni_lite.rl.logprob_pass as logprob_pass

    logprob_pass.agree = lambda problem, error, group=None, flags=(), where="": list(flags)  # each rank its own count
    train(args, world)


@pytest.mark.slow
def test_without_the_agreed_count_the_uneven_plans_hang_in_a_forward(demo, rollouts, tmp_path):
    """The negative control: each rank running its own plan's forwards, rank 0 waits in a forward's all-gather while
    rank 1 waits in the gather of the values, until the collective timeout."""
    args = rl_args(demo, rollouts, tmp_path, "--train.max_steps", "1", *UNEVEN, "--parallel.collective_timeout_s", "5")
    outcomes = run_ranks(_run_unpadded, 2, args, timeout_s=300, pg_timeout_s=5)
    assert [status for status, _ in outcomes.values()] == ["error", "error"], outcomes
    assert "all_gather_object" in outcomes[1][1] and "_fsdp_collectives" in outcomes[0][1], outcomes
