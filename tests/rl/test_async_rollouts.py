"""Bounded-staleness rollouts (`rl.async_steps: k`, `rl.partial_rollouts`, `veomni_lite.rl.rollout_queue`): batch b is
sampled by the weights synced at batch b - k (checked against an engine given those weights, and against the newest
as a negative control); partial rollouts continue across weight syncs, each token carrying the version and
log-probability of the weights that sampled it, and with unchanged weights they are the whole generations; the
staleness histogram is a hand count of each batch's tokens (hand-made samples, and the runs' own, the same at DP=2);
a resume (at a batch boundary or inside a batch, also from one process on two ranks and back) trains the samples of
the uninterrupted run (a checkpoint whose queue is lost does not); DP=2 makes the same rollouts as one process; a
block older than the bound is dropped and generated again; a generation failing on one rank is the same named error
on every rank; the background engine keeps its jobs' order; the truncated correction weighs each token by its own
version's behaviour log-probability, against a float64 reference at GA and DP=2 x GA."""

from __future__ import annotations

import math
import shutil
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_distributed, run_ranks
from tests.trainer.helpers import read_events, train_built
from veomni_lite.config import ConfigError, load_config
from veomni_lite.engines.background import BackgroundEngine
from veomni_lite.engines.base import Rollout, RolloutEngine, RolloutRequest, SamplingSettings
from veomni_lite.engines.embedded import TransformersEngine
from veomni_lite.engines.weights import engine_model
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.records import rollout_metrics, rollout_specs, staleness_histogram
from veomni_lite.rl.rollout_batch import request, sampling
from veomni_lite.rl.rollout_queue import chunk_bounds
from veomni_lite.rl.rollouts import RolloutSample
from veomni_lite.rl.trainer import RLTrainer
from veomni_lite.trainer.checkpoint import TRAINER_STATE

P, G, S = 4, 4, 2  # prompts and samples per rollout batch; optimizer steps per rollout batch (two mini-batches)


@pytest.fixture(scope="module")
def math_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.rl_math import write_demo

    return write_demo(tmp_path_factory.mktemp("rl_math"), sft_rows=16, rl_rows=64, eval_rows=8)


def async_args(demo: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model.arch", "auto", "--model.pretrained_dir", str(demo / "models/qwen2_math"),
        "--data.train_path", str(demo / "rl_train.jsonl"), "--data.format", "messages", "--data.max_seq_len", "64",
        "--rl.prompts_per_step", str(P), "--rl.num_generations", str(G), "--rl.max_new_tokens", "8",
        "--rl.rewards", "[{name: correct, function: math}]", "--rl.entropy_coef", "0.01",
        "--rl.importance_sampling", "token", "--rl.async_steps", "2",
        "--train.micro_batch_size", "2", "--train.global_batch_size", str(P * G // S), "--train.max_steps", "8",
        "--train.output_dir", str(out), "--optim.lr", "2e-2", "--optim.warmup_steps", "0",
        "--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", *extra,
    ]  # fmt: skip


def build(args: list[str], world_size: int = 1) -> RLTrainer:
    return RLTrainer(load_config(None, args, world_size=world_size, sections={"rl": RLConfig}))


def record_syncs(trainer: RLTrainer) -> dict[int, dict[str, torch.Tensor]]:
    """Every weights version the engine is given, by version (copies)."""
    seen: dict[int, dict[str, torch.Tensor]] = {}
    original = trainer.engine.sync_weights

    def sync(state: Mapping[str, torch.Tensor], version: int) -> None:
        seen[version] = {key: value.detach().clone() for key, value in state.items()}
        original(state, version)

    trainer.engine.sync_weights = sync
    return seen


def record_batches(trainer: RLTrainer) -> list[tuple[int, list[RolloutSample]]]:
    """Every rollout batch the run generates: (the optimizer steps trained when it was made, its samples)."""
    made: list[tuple[int, list[RolloutSample]]] = []
    original = trainer.rollouts.make

    def make(k: int, step: int, last: int | None, restored: list[RolloutSample] | None = None) -> Any:
        batch = original(k, step, last, restored)
        if restored is None:
            made.append((step, batch.samples))
        return batch

    trainer.rollouts.make = make
    return made


def run(args: list[str], world_size: int = 1, stop_after: int | None = None) -> dict[str, Any]:
    trainer = build(args, world_size)
    seen, made = record_syncs(trainer), record_batches(trainer)
    train_built(trainer, stop_after)
    return {"trainer": trainer, "seen": seen, "made": made, "last": [s.plain() for s in trainer.rollouts.last],
            "events": read_events(trainer.output_dir)}  # fmt: skip


def _ranked(rank: int, world: int, args: list[str], stop_after: int | None = None) -> dict[str, Any]:
    out = run(args, world, stop_after)
    return {"last": out["last"], "events": out["events"]}


def series(events: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in events if key in e}


def reference_engine(trainer: RLTrainer, state: Mapping[str, torch.Tensor]) -> TransformersEngine:
    engine = TransformersEngine(engine_model(trainer.model_config), torch.device("cpu"))
    engine.sync_weights(state, 0)
    return engine


def regenerate(trainer: RLTrainer, block: int, state: Mapping[str, torch.Tensor]) -> list[Rollout]:
    """Block `block`'s rollouts generated synchronously by an engine given `state`, in batch order."""
    context = trainer.rollouts.context
    prompts = context.prompts.batch(block, P, context.seed)
    requests = [request(context, block, i, prompts[i], G) for i in range(P)]
    results = reference_engine(trainer, state).generate(requests, sampling(context, greedy=False))
    return [rollout for result in results for rollout in result]


def token_logprobs(trainer: RLTrainer, state: Mapping[str, torch.Tensor], sample: Mapping[str, Any]) -> torch.Tensor:
    """The response tokens' log-probabilities under `state` (temperature 1), one forward of prompt + response."""
    model = reference_engine(trainer, state).model
    ids = torch.tensor([sample["prompt_ids"] + sample["response_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double().log_softmax(-1)
    start = len(sample["prompt_ids"])
    positions = torch.arange(start - 1, ids.shape[1] - 1)
    return logits[positions, ids[0, start:]]


def hand_histogram(made: Sequence[tuple[int, Sequence[RolloutSample]]], k: int) -> dict[int, list[float]]:
    """Plain Python: each batch's share of response tokens sampled d = 0..k rollout batches (S steps) before the step
    that trains it, d = ceil((step - token version) / S), by the logged step (the batch's first, step + 1)."""
    out = {}
    for step, samples in made:
        counts = [0] * (k + 1)
        for sample in samples:
            for version in sample.versions or [sample.version] * len(sample.response_ids):
                counts[math.ceil((step - version) / S)] += 1
        out[step + 1] = [n / sum(counts) for n in counts]
    return out


def assert_logged_histogram(out: Mapping[str, Any], k: int = 2) -> None:
    """The run's logged `rl/staleness/hist/{d}` is the hand count of the batches it generated."""
    expected = hand_histogram(out["made"], k)
    assert len(expected) == len(out["made"]) >= 3
    for d in range(k + 1):
        logged = series(out["events"], f"rl/staleness/hist/{d}")
        assert logged == pytest.approx({step: shares[d] for step, shares in expected.items()}, rel=0, abs=1e-12), d
    assert not series(out["events"], f"rl/staleness/hist/{k + 1}")


def test_the_staleness_histogram_is_the_share_of_tokens_by_batches_behind():
    # the batch trains from step 8, S = 2 steps per rollout batch, k = 3
    samples = [
        RolloutSample(group=0, prompt_ids=[1], response_ids=[5, 6, 7], version=6),  # 3 tokens 1 batch behind
        RolloutSample(group=0, prompt_ids=[1], response_ids=[5, 6, 7, 8], version=2, versions=[2, 2, 4, 6]),  # 3 3 2 1
        RolloutSample(group=1, prompt_ids=[1], response_ids=[5, 6], version=8),  # 0 0
        RolloutSample(group=1, prompt_ids=[1], response_ids=[5], version=5),  # ceil(3 / 2) = 2
        RolloutSample(group=2, prompt_ids=[1], response_ids=[5, 6], version=4),  # 2 2
        RolloutSample(group=2, prompt_ids=[1], response_ids=[], version=0),  # no tokens
    ]
    counts = {0: 2, 1: 4, 2: 4, 3: 2}  # of 12 tokens
    assert hand_histogram([(8, samples)], 3) == {9: [counts[d] / 12 for d in range(4)]}
    record = rollout_metrics(samples, 2, 8, steps_per_rollout=2, async_steps=3)
    assert {d: record[f"rl/staleness/hist/{d}"] for d in range(4)} == {d: (float(n), 12.0) for d, n in counts.items()}
    halves = [staleness_histogram(part, 8, 2, 3) for part in (samples[:1], samples[1:])]  # two ranks' shares
    for d in range(4):
        (a, ta), (b, tb) = (half[f"rl/staleness/hist/{d}"] for half in halves)
        assert (a + b) / (ta + tb) == counts[d] / 12
    whole = [RolloutSample(**{**sample.plain(), "versions": None}) for sample in samples]  # negative control
    assert staleness_histogram(whole, 8, 2, 3)["rl/staleness/hist/3"] == (4.0, 12.0)
    assert not any("hist" in name for name in rollout_metrics(samples, 2, None, 2, 3))  # given rollouts
    assert not any("hist" in name for name in rollout_metrics(samples, 2, 8, 2, 0))  # synchronous
    names = [spec.name for spec in rollout_specs(RLConfig(async_steps=3, importance_sampling="token"), [])]
    assert [n for n in names if "hist" in n] == [f"rl/staleness/hist/{d}" for d in range(4)]
    assert not any("hist" in spec.name for spec in rollout_specs(RLConfig(), []))


@pytest.mark.slow
def test_k2_samples_each_batch_by_the_weights_synced_two_batches_before(math_demo, tmp_path):
    out = run(async_args(math_demo, tmp_path / "k2"))
    trainer, last = out["trainer"], out["last"]
    # batch b trains from step bS; it was sampled by the weights of step max(b - 2, 0) S
    assert series(out["events"], "rl/staleness/max") == {1: 0.0, 3: 2.0, 5: 4.0, 7: 4.0}
    assert series(out["events"], "rl/staleness/mean") == {1: 0.0, 3: 2.0, 5: 4.0, 7: 4.0}
    assert series(out["events"], "rl/staleness/dropped") == {1: 0.0, 3: 0.0, 5: 0.0, 7: 0.0}
    assert series(out["events"], "rl/staleness/hist/2") == {1: 0.0, 3: 0.0, 5: 1.0, 7: 1.0}
    assert_logged_histogram(out)
    assert sorted(out["seen"]) == [0, 2] and {s["version"] for s in last} == {2}
    assert all(s["versions"] is None for s in last)
    expected = regenerate(trainer, 3, out["seen"][2])
    assert [s["response_ids"] for s in last] == [r.response_ids for r in expected]
    for sample, rollout in zip(last, expected):
        assert sample["engine_logprobs"] == pytest.approx(rollout.logprobs, abs=1e-5)
    newest = regenerate(trainer, 3, out["seen"][0])  # negative control: the weights one sync before
    gaps = [max(abs(a - b) for a, b in zip(s["engine_logprobs"], r.logprobs))
            for s, r in zip(last, newest) if s["response_ids"] == r.response_ids]  # fmt: skip
    assert len(gaps) < len(last) or max(gaps) > 1e-3


@pytest.mark.slow
def test_partial_rollouts_carry_each_tokens_version_and_logprob(math_demo, tmp_path):
    out = run(async_args(math_demo, tmp_path / "partial", "--rl.partial_rollouts", "true"))
    trainer, last = out["trainer"], out["last"]
    # batch 3: chunk 0 (positions 0-3) by the weights of step 2, chunk 1 (4-7) by those of step 4
    assert chunk_bounds(8, 2) == [0, 4, 8]
    for sample in last:
        n = len(sample["response_ids"])
        assert sample["version"] == 2 and sample["versions"] == [2] * min(n, 4) + [4] * max(n - 4, 0)
    assert series(out["events"], "rl/staleness/max") == {1: 0.0, 3: 2.0, 5: 4.0, 7: 4.0}
    assert_logged_histogram(out)  # batch 1: its first chunk 1 batch behind, the rest by the weights it trains
    assert 0 < series(out["events"], "rl/staleness/hist/0")[3] < 1
    long = [s for s in last if len(s["response_ids"]) > 4]
    assert long, "no response spans the update"
    worst = wrong = 0.0
    for sample in long:
        engine = torch.tensor(sample["engine_logprobs"], dtype=torch.float64)
        by_version = {v: token_logprobs(trainer, out["seen"][v], sample) for v in (2, 4)}
        own = torch.stack([by_version[v][t] for t, v in enumerate(sample["versions"])])
        worst = max(worst, float((engine - own).abs().max()))
        wrong = max(wrong, float((engine[4:] - by_version[2][4:]).abs().max()))  # negative control: one version
    assert worst < 1e-4 and wrong > 1e-3, (worst, wrong)


@pytest.mark.slow
def test_with_unchanged_weights_partial_rollouts_are_the_whole_generations(math_demo, tmp_path):
    frozen = ("--optim.lr", "1e-12", "--train.max_steps", "4")  # steps far below float32 resolution
    whole = run(async_args(math_demo, tmp_path / "whole", *frozen))["last"]
    partial = run(async_args(math_demo, tmp_path / "partial", *frozen, "--rl.partial_rollouts", "true"))["last"]
    assert [s["response_ids"] for s in partial] == [s["response_ids"] for s in whole]
    for a, b in zip(partial, whole):  # a continuation recomputes its KV cache: float32 rounding apart
        assert a["engine_logprobs"] == pytest.approx(b["engine_logprobs"], abs=1e-5)
    assert any(len(set(s["versions"])) == 2 for s in partial)


def assert_trains_like(whole: Mapping[str, Any], resumed: Mapping[str, Any], logprob_abs: float = 0.0) -> None:
    """`resumed` (a run resumed from a checkpoint) trained the last batch's samples of the uninterrupted `whole` run
    and logged its values; `logprob_abs`: the engine log-probabilities' bound (another world size batches the
    engine's requests otherwise, 0: equal)."""
    for key in ("response_ids", "version", "versions", "reward"):
        assert [s[key] for s in resumed["last"]] == [s[key] for s in whole["last"]], key
    for got, expected in zip(resumed["last"], whole["last"]):
        assert got["engine_logprobs"] == pytest.approx(expected["engine_logprobs"], rel=0, abs=logprob_abs)
    rel, abs_ = (1e-6, 1e-9) if logprob_abs == 0 else (1e-5, 1e-6)  # another layout: float32 sums in its own order
    for key in ("train/policy_loss", "rl/reward/mean", "rl/staleness/mean", "rl/staleness/hist/1", "rl/logprob_diff"):
        expected, got = series(whole["events"], key), series(resumed["events"], key)
        # (a batch restored inside it records its engine mismatch again at the resumed step)
        assert {s: got[s] for s in expected} == pytest.approx(expected, rel=rel, abs=abs_), key


@pytest.mark.slow
@pytest.mark.parametrize("stop_after", [2, 5])  # at a batch boundary (the next batch made, not trained); inside
def test_a_resume_trains_the_samples_of_the_uninterrupted_run(math_demo, tmp_path, stop_after):
    extra = ("--rl.partial_rollouts", "true", "--checkpoint.save_interval", "0")
    whole = run(async_args(math_demo, tmp_path / "whole", *extra))
    run(async_args(math_demo, tmp_path / "cut", *extra), stop_after=stop_after)
    resumed = run(async_args(math_demo, tmp_path / "cut", *extra, "--checkpoint.resume", "true"))
    assert_trains_like(whole, resumed)


def drop_saved_queue(out: Path, copy: Path) -> Path:
    """A copy of the run under `out` whose checkpoint lost its queue (the negative control: its blocks ahead are
    generated anew by the resumed weights)."""
    shutil.copytree(out, copy)
    (path,) = copy.glob(f"checkpoints/*/{TRAINER_STATE}")
    state = torch.load(path, weights_only=True)
    del state["loader"]["queue"]
    torch.save(state, path)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize(
    ("partial", "stop_after"),
    [
        (False, 5),  # inside batch 2: block 3 in flight, by the weights of step 2
        (True, 2),  # batch 1 made, not trained; block 2's first chunk in flight, continued by the two ranks' rows
    ],
)
def test_a_checkpoint_of_one_process_resumes_on_two_ranks_to_the_uninterrupted_run(
    math_demo, tmp_path, partial, stop_after
):
    extra = ("--checkpoint.save_interval", "0", *(("--rl.partial_rollouts", "true") if partial else ()))
    resume = ("--checkpoint.resume", "true")
    whole = run(async_args(math_demo, tmp_path / "whole", *extra))
    run(async_args(math_demo, tmp_path / "cut", *extra), stop_after=stop_after)
    dropped = drop_saved_queue(tmp_path / "cut", tmp_path / "dropped")
    ranks = run_distributed(_ranked, 2, async_args(math_demo, tmp_path / "cut", *extra, *resume), timeout_s=600)
    for rank_result in ranks:  # every rank holds every sample
        assert_trains_like(whole, {"last": rank_result["last"], "events": ranks[0]["events"]}, logprob_abs=1e-5)
    (control, _) = run_distributed(_ranked, 2, async_args(math_demo, dropped, *extra, *resume), timeout_s=600)
    # the blocks of the lost queue generated again by the resumed weights: fresher, and caught by the comparison
    fresher = series(control["events"], "rl/staleness/mean")
    assert any(fresher[s] < value for s, value in series(whole["events"], "rl/staleness/mean").items()), fresher
    with pytest.raises(AssertionError):
        assert_trains_like(whole, control, logprob_abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("stop_after", [2, 5])
def test_a_checkpoint_of_two_ranks_resumes_on_one_process_to_the_uninterrupted_run(math_demo, tmp_path, stop_after):
    extra = ("--checkpoint.save_interval", "0", "--rl.partial_rollouts", "true")
    whole = run(async_args(math_demo, tmp_path / "whole", *extra))
    run_distributed(_ranked, 2, async_args(math_demo, tmp_path / "cut", *extra), stop_after, timeout_s=600)
    resumed = run(async_args(math_demo, tmp_path / "cut", *extra, "--checkpoint.resume", "true"))
    assert_trains_like(whole, resumed, logprob_abs=1e-5)


@pytest.mark.slow
def test_dp2_makes_the_rollouts_of_one_process(math_demo, tmp_path):
    extra = ("--rl.partial_rollouts", "true", "--train.max_steps", "6")
    one = run(async_args(math_demo, tmp_path / "one", *extra))
    two = run_distributed(_ranked, 2, async_args(math_demo, tmp_path / "two", *extra), timeout_s=900)
    for rank_result in two:
        assert [s["response_ids"] for s in rank_result["last"]] == [s["response_ids"] for s in one["last"]]
        assert [s["versions"] for s in rank_result["last"]] == [s["versions"] for s in one["last"]]
    for key in ("rl/staleness/max", "rl/staleness/hist/0", "rl/staleness/hist/1", "rl/staleness/hist/2"):
        assert series(two[0]["events"], key) == series(one["events"], key), key  # the world's tokens: exact
    assert_logged_histogram(one)


@pytest.mark.slow
def test_a_block_older_than_the_bound_is_dropped_and_generated_again(math_demo, tmp_path):
    run(async_args(math_demo, tmp_path / "run"), stop_after=2)  # blocks 1, 2 in flight, by the weights of step 0
    resumed = run(async_args(math_demo, tmp_path / "run", "--rl.async_steps", "1", "--checkpoint.resume", "true"))
    # bound 1 batch = 2 steps: block 1 (taken at step 2) is kept, block 2 (taken at step 4, 4 steps old) is not
    # (step 1's record is the interrupted run's, kept in the run's metrics)
    assert series(resumed["events"], "rl/staleness/dropped") == {1: 0.0, 3: 0.0, 5: float(P * G), 7: 0.0}
    assert series(resumed["events"], "rl/staleness/max") == {1: 0.0, 3: 2.0, 5: 0.0, 7: 2.0}


class FailingOnRankOne(RolloutEngine):
    """The embedded engine whose third generation raises on rank 1."""

    def __init__(self, engine: RolloutEngine, rank: int) -> None:
        self.engine, self.rank, self.calls, self.name = engine, rank, 0, engine.name

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.sync_weights(state_dict, version)

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[list[Rollout]]:
        self.calls += 1
        if self.rank == 1 and self.calls == 3:
            raise RuntimeError("out of memory while generating")
        return self.engine.generate(requests, settings)


def _failing(rank: int, world: int, args: list[str]) -> str:
    trainer = build(args, world)
    trainer.engine.engine = FailingOnRankOne(trainer.engine.engine, rank)
    try:
        train_built(trainer)
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "trained"


@pytest.mark.slow
def test_a_generation_failing_on_one_rank_is_the_same_named_error_on_every_rank(math_demo, tmp_path):
    outcomes = run_ranks(_failing, 2, async_args(math_demo, tmp_path / "run"), timeout_s=600)
    messages = [value for status, value in outcomes.values()]
    assert all(status == "ok" for status, _ in outcomes.values()), outcomes
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("GenerationError: prompt block 2: generation: rank 1: out of memory"), messages


class Recorder(RolloutEngine):
    """Answers each request with [version of the weights, the first seed]; a gate holds its first generation."""

    name = "recorder"

    def __init__(self) -> None:
        self.weights, self.gate = -1, threading.Event()

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        if "bad" in state_dict:
            raise ValueError("unexpected keys ['bad']")
        self.weights = version

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[list[Rollout]]:
        self.gate.wait()
        return [[Rollout([self.weights, r.seeds[0]], [0.0, 0.0], "stop")] for r in requests]


def test_the_background_engine_runs_its_jobs_in_the_order_given():
    inner = Recorder()
    engine = BackgroundEngine(inner, rank=1)
    engine.sync_weights({}, 0)
    mine_, other = [RolloutRequest([1], [7])], [RolloutRequest([1], [9])]
    engine.start_generate([other, mine_], SamplingSettings(4))  # held at the gate while newer weights arrive
    engine.sync_weights({}, 5)
    engine.start_generate([other, [RolloutRequest([1], [8])]], SamplingSettings(4))
    assert engine.version == 5 and engine.pending == 2
    inner.gate.set()
    assert engine.finish_generate()[0][0].response_ids == [0, 7]  # this rank's request, by the weights before
    assert engine.finish_generate()[0][0].response_ids == [5, 8]
    assert engine.generate([RolloutRequest([1], [3])], SamplingSettings(4))[0][0].response_ids == [5, 3]
    engine.sync_weights({"bad": torch.zeros(1)}, 6)  # a sync's error is the next generation's
    with pytest.raises(ValueError, match="unexpected keys"):
        engine.generate([RolloutRequest([1], [3])], SamplingSettings(4))
    engine.close()


@pytest.mark.slow  # the demo's model directory (written once for the module: ~10 s)
def test_async_configs_are_checked(math_demo, tmp_path):
    cases = {
        ("--rl.async_steps", "-1"): r"rl.async_steps: the staleness bound in rollout batches, >= 0; got -1",
        ("--rl.partial_rollouts", "true", "--rl.async_steps", "1"): r"rl.partial_rollouts: needs rl.async_steps >= 2",
        ("--rl.partial_rollouts", "true", "--rl.max_new_tokens", "1"): r"rl.max_new_tokens \(1\) must be >= rl.asy",
        ("--rl.dynamic_sampling", "{metric: correct}"): r"rl.async_steps: 2 with rl.dynamic_sampling",
        ("--rl.importance_sampling", "none"): r"rl.async_steps: 2 samples with weights up to that many rollout",
    }
    for extra, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, async_args(math_demo, tmp_path / "bad", *extra), sections={"rl": RLConfig})


VARIED = """
def score(prompts, completions, answers, **columns):
    return [float(sum(map(ord, c)) % 7) for c in completions]
"""


def first_step_reference(samples: list[Mapping[str, Any]], is_cap: float, flip: bool = False) -> float:
    """Float64: the policy loss of a rollout batch's first optimizer step (mini-batch 0, the first `P * G // S`
    samples), where the training forward's weights are the old pass's (ratio 1, no clip): the token-mean over its
    response tokens of -A min(exp(old_t - engine_t), is_cap), each token against its own behaviour log-probability
    (`flip`: each response's behaviour log-probabilities reversed, the negative control)."""
    total, count = 0.0, 0
    for sample in samples[: P * G // S]:
        engine = sample["engine_logprobs"][::-1] if flip else sample["engine_logprobs"]
        for old, behaviour in zip(sample["old_logprobs"], engine):
            total += -sample["advantage"] * min(math.exp(old - behaviour), is_cap)
            count += 1
    return total / count


@pytest.mark.slow
def test_the_correction_weighs_each_token_by_its_own_versions_behaviour_logprob_at_ga_and_dp2(math_demo, tmp_path):
    reward = tmp_path / "varied.py"
    reward.write_text(VARIED)
    extra = ("--rl.partial_rollouts", "true", "--rl.entropy_coef", "0", "--rl.is_cap", "1.5",
             "--rl.rewards", f"[{{name: varied, function: '{reward}:score'}}]")  # fmt: skip
    one = run(async_args(math_demo, tmp_path / "one", *extra))  # GA 4
    two = run_distributed(_ranked, 2, async_args(math_demo, tmp_path / "two", *extra), timeout_s=900)[0]  # DP 2 x GA 2
    for result in (one, two):
        last = result["last"]
        assert any(len(set(s["versions"])) == 2 for s in last[: P * G // S])  # tokens of two versions
        assert any(s["advantage"] != 0 for s in last[: P * G // S])
        logged = series(result["events"], "train/policy_loss")[7]  # batch 3's first step
        assert logged == pytest.approx(first_step_reference(last, 1.5), abs=1e-6)
        assert abs(logged - first_step_reference(last, 1.5, flip=True)) > 1e-4
