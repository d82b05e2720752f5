"""Every RL prompt row is checked before the first rollout, on every rank alike: a row whose answer a configured
reward needs but cannot use is the error its rollout batch would raise, at start, whichever row it is (a run used to
stop only when a rollout batch drew the row, or end 0 when none did)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_helpers import run_ranks
from tests.rl.test_rl_generation import math_args
from veomni_lite.config import load_config
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import row_name
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.rewards import RewardError, load_rewards, score
from veomni_lite.rl.trainer import RLTrainer

ROWS, BAD = 2000, 123
NO_ANSWER = "the row has no reference answer (its answer column is missing or null)"


@pytest.fixture(scope="module")
def math_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.rl_math import write_demo

    return write_demo(tmp_path_factory.mktemp("rl_math"), sft_rows=16, rl_rows=64, eval_rows=8)


def prompt_file(demo: Path, path: Path, bad: dict[int, object] | None = None) -> Path:
    """ROWS prompt rows cycled from the demo's `rl_train.jsonl`, row i's answer replaced by `bad[i]` (None: removed)."""
    source = [json.loads(line) for line in (demo / "rl_train.jsonl").read_text().splitlines()]
    rows = [dict(source[i % len(source)]) for i in range(ROWS)]
    for index, answer in (bad or {}).items():
        if answer is None:
            del rows[index]["answer"]
        else:
            rows[index]["answer"] = answer
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def build(args: list[str], world_size: int = 1) -> RLTrainer:
    """An RLTrainer of `args`, built (nothing trained), its metrics closed."""
    trainer = RLTrainer(load_config(None, args, world_size=world_size, sections={"rl": RLConfig}))
    trainer.metrics.close()
    return trainer


def rows_args(demo: Path, train: Path, out: Path, reward: str = "{name: correct, function: math}") -> list[str]:
    return math_args(demo, out, "--data.train_path", str(train), "--rl.rewards", f"[{reward}]")


def batch_error(reward: str, row: int, answer: object) -> str:
    """What scoring the rollout that drew `row` raises."""
    (loaded,) = load_rewards([json.loads(reward)])
    with pytest.raises(RewardError) as caught:
        score([loaded], ["q"], ["3 + 4 = 7"], [answer], [{}], [row])
    return str(caught.value)


@pytest.mark.parametrize(
    ("reward", "answer", "problem"),
    [
        ('{"name": "correct", "function": "math"}', None, NO_ANSWER),
        ('{"name": "correct", "function": "exact_match"}', None, NO_ANSWER),
        ('{"name": "correct", "function": "math"}', "seven", "math-verify finds no answer it can parse"),
    ],
)
def test_a_bad_answer_in_any_row_stops_the_run_at_start_with_the_batchs_error(math_demo, tmp_path, reward, answer,
                                                                               problem):  # fmt: skip
    train = prompt_file(math_demo, tmp_path / "prompts.jsonl", {BAD: answer})
    where = row_name(train, BAD)
    with pytest.raises(DataError) as caught:
        build(rows_args(math_demo, train, tmp_path / "run", reward))
    message = str(caught.value)
    assert message == f"RL data: rank 0: {batch_error(reward, where, answer)}"
    assert f"row {BAD} (0-based)" in message and problem in message
    # a reward that needs no answer checks none: the same rows build
    assert len(build(rows_args(math_demo, train, tmp_path / "regex", "{name: f, function: regex, pattern: '='}"))
               .train_dataset) == ROWS  # fmt: skip


def test_a_bad_answer_in_the_held_out_prompts_is_found_at_start_too(math_demo, tmp_path):
    evaluation = prompt_file(math_demo, tmp_path / "eval.jsonl", {7: None})
    args = math_args(math_demo, tmp_path / "run", "--data.eval_path", str(evaluation), "--train.eval_interval", "1")
    with pytest.raises(DataError, match=rf"RL data: rank 0: reward 'correct' \(built-in math\), {evaluation}, row 7 "):
        build(args)


def _build_on_rank(rank: int, world: int, demo: Path, files: list[Path], out: Path) -> str:
    """Build the trainer on this rank's prompt file; the message of what it raises (the rollout engine untouched)."""
    from veomni_lite.engines.embedded import TransformersEngine

    def no_generation(*args, **kwargs):
        raise AssertionError("a rollout was generated")

    TransformersEngine.generate = no_generation
    try:
        build(rows_args(demo, files[rank], out), world)
    except DataError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "built"


@pytest.mark.slow
def test_a_bad_row_on_one_rank_is_the_same_error_on_every_rank_before_the_first_step(math_demo, tmp_path):
    """Rank 1 reads a file whose row 123 of 2000 has no answer (a file changed under one rank), rank 0 a good one:
    both raise at start, naming rank 1 and the row, before any rollout or step."""
    good = prompt_file(math_demo, tmp_path / "good.jsonl")
    bad = prompt_file(math_demo, tmp_path / "bad.jsonl", {BAD: None})
    outcomes = run_ranks(_build_on_rank, 2, math_demo, [good, bad], tmp_path / "run", timeout_s=600)
    messages = [value for status, value in (outcomes[0], outcomes[1]) if status == "ok"]
    assert len(messages) == 2, outcomes
    expected = batch_error('{"name": "correct", "function": "math"}', row_name(bad, BAD), None)
    assert messages == [f"DataError: RL data: rank 1: {expected}"] * 2
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # control: the good file on both ranks builds on both
    outcomes = run_ranks(_build_on_rank, 2, math_demo, [good, good], tmp_path / "run", timeout_s=600)
    assert [value for _, value in outcomes.values()] == ["built", "built"]
