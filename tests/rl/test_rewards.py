"""Reward functions: the built-ins against hand-written expectations, a user's function loaded from its file only,
every way a reward can fail named (function, file, row), the weighted total in float64, and one rank's failure
becoming the same named error on every rank (real gloo processes)."""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from veomni_lite.config import ConfigError
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import row_name
from veomni_lite.rl.rewards import RewardError, RewardFunction, check_answers, load_rewards, normalize, score

EOT = "<|im_end|>"


def one(spec: dict, base_dir: Path | str = ".") -> RewardFunction:
    (reward,) = load_rewards([spec], base_dir)
    return reward


def run(reward: RewardFunction, completions: list[str], answers: list[str | None], **kwargs) -> list[float]:
    n = len(completions)
    return reward(["q"] * n, completions, answers, kwargs.pop("columns", [{}] * n), **kwargs)


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


# ---- built-ins ----


def test_normalize_strips_casefolds_collapses_and_drops_trailing_punctuation_and_end_of_turn():
    assert normalize("  A  handwritten\n\tSEVEN.  ") == "a handwritten seven"
    assert normalize("seven!?<|im_end|>", (EOT,)) == "seven"
    assert normalize("seven <|im_end|><|im_end|>\n", (EOT,)) == "seven"
    assert normalize("Straße") == normalize("STRASSE")  # casefold, not lower
    # negative controls: without the marker the end-of-turn text stays; inner punctuation and other trailing
    # characters (%, parentheses) are part of the answer
    assert normalize("seven<|im_end|>") == "seven<|im_end|>"
    assert normalize("3.5") == "3.5" and normalize("50%") == "50%" and normalize("f(x)") == "f(x)"


def test_exact_match_scores_each_row_against_its_answer():
    reward = one({"name": "correct", "function": "exact_match", "end_of_turn": EOT})
    assert (reward.name, reward.weight, reward.where) == ("correct", 1.0, "built-in exact_match")
    completions = ["a handwritten seven", " A handwritten  Seven.<|im_end|>", "a handwritten one", "seven", "7"]
    answers = ["a handwritten seven", "a handwritten seven", "a handwritten seven", "a handwritten seven", 7]
    assert run(reward, completions, answers) == [1.0, 1.0, 0.0, 0.0, 1.0]
    plain = one({"name": "correct", "function": "exact_match"})
    assert run(plain, ["seven<|im_end|>"], ["seven"]) == [0.0]  # negative control: no end_of_turn option
    assert run(one({"name": "m", "function": "exact_match", "end_of_turn": ["</s>", EOT]}), ["7</s>"], ["7"]) == [1.0]


def test_math_scores_the_solution_the_demo_model_writes_and_the_boxed_form():
    reward = one({"name": "correct", "function": "math"})
    completions = ["3 + 4 = 7", "3 + 4 = 8", "\\boxed{7}", "The answer is $\\boxed{8}$.", "3 + 4 = 7<|im_end|>"]
    assert run(reward, completions, ["7"] * 5) == [1.0, 0.0, 1.0, 0.0, 1.0]
    # equivalence, not string equality; an answer given as a number; no number at all scores 0
    assert run(reward, ["so x = 0.5", "1/2", "It is 12 - 5 = 7", "seven", ""], ["1/2", "0.5", 7, "7", "7"]) == [
        1.0,
        1.0,
        1.0,
        0.0,
        0.0,
    ]


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("10", "10", 1.0),
        ("\\boxed{10}", "10", 1.0),
        ("10.0", "10", 1.0),
        ("4 + 6 = 10", "10", 1.0),
        ("1/2", "0.5", 1.0),  # a fraction is an answer
        ("-3/4", "-0.75", 1.0),
        ("2^10", "2^10", 1.0),  # a reference left undone accepts the same form
        ("1024", "2^10", 1.0),
        ("4 + 6", "10", 0.0),  # the question's operands restated, not the answer
        ("12 + 8", "20", 0.0),
        ("\\boxed{4+6}", "10", 0.0),
        ("12 - 8 + 1", "5", 0.0),
        ("2^3", "8", 0.0),
        ("4 + 6 = 11", "10", 0.0),
    ],
)
def test_math_accepts_a_worked_out_answer_and_rejects_the_arithmetic_left_undone(completion, answer, expected):
    reward = one({"name": "correct", "function": "math"})
    assert run(reward, [completion], [answer]) == [expected]


def test_math_verify_alone_finds_the_undone_sum_equal_to_the_answer():
    """The negative control: without the worked-out check math-verify scores '4 + 6' as '10' (what the demo's policy
    learned to exploit), so the rejection above comes from `_undone`, not from math-verify."""
    from math_verify import parse, verify

    from veomni_lite.rl.rewards import _undone

    predicted, reference = parse("4 + 6"), parse("10")
    assert verify(reference, predicted)
    assert _undone(predicted[0]) and not _undone(reference[0])


def test_math_missing_or_unparseable_answer_is_an_error_naming_the_row():
    reward = one({"name": "correct", "function": "math"})
    rows = [row_name("data/rl.jsonl", 4), row_name("data/rl.jsonl", 5)]
    with pytest.raises(RewardError, match=r"reward 'correct' \(built-in math\), data/rl.jsonl, row 5 \(0-based\): .*"):
        run(reward, ["7", "7"], ["7", None], rows=rows)
    with pytest.raises(RewardError, match=r"data/rl.jsonl, row 4 \(0-based\): math-verify finds no answer .*'seven'"):
        run(reward, ["7", "7"], ["seven", "7"], rows=rows)
    exact = one({"name": "e", "function": "exact_match"})
    with pytest.raises(
        RewardError, match=r"reward 'e' \(built-in exact_match\), batch row 1: the row has no reference"
    ):
        run(exact, ["7", "7"], ["7", None])
    assert issubclass(RewardError, DataError)


def test_check_answers_raises_at_start_what_scoring_the_row_would_raise(tmp_path):
    write(tmp_path / "mine.py", USER_REWARDS)
    rewards = load_rewards(
        [{"name": "fmt", "function": "regex", "pattern": "="}, {"name": "mine", "function": "mine.py:score"},
         {"name": "correct", "function": "math"}], tmp_path
    )  # fmt: skip
    rows = [row_name("data/rl.jsonl", i) for i in range(3)]
    for answers in (["7", None, "4"], ["7", "seven", "4"], ["7", 4.5, "4"]):
        with pytest.raises(RewardError) as scored:
            score(rewards, ["q"] * 3, ["7"] * 3, answers, [{}] * 3, rows)
        with pytest.raises(RewardError) as checked:
            check_answers(rewards, answers, rows)
        assert str(checked.value) == str(scored.value)
        assert "reward 'correct' (built-in math), data/rl.jsonl, row 1 (0-based)" in str(checked.value)
    check_answers(rewards, ["7", "1/2", 4], rows)  # usable answers pass
    # regex and a user's function are not checked (a user's function decides for itself what a missing answer means)
    check_answers(rewards[:2], [None] * 3, rows)


def test_regex_searches_the_completion():
    anchored = one({"name": "fmt", "function": "regex", "pattern": "^a handwritten \\w+$"})
    completions = ["a handwritten seven", "I see a handwritten seven", "a handwritten seven!", "a handwritten seven\n"]
    assert run(anchored, completions, [None] * 4) == [1.0, 0.0, 0.0, 1.0]  # `$` also matches before a final newline
    # re.search, not fullmatch: an unanchored pattern matches anywhere in the completion
    anywhere = one({"name": "fmt", "function": "regex", "pattern": "= \\d+"})
    assert run(anywhere, ["3 + 4 = 7 apples", "seven"], [None, None]) == [1.0, 0.0]


# ---- a user's own function ----

USER_REWARDS = """
    import torch

    CALLS = []

    def score(prompts, completions, answers, **columns):
        CALLS.append((prompts, completions, answers, columns))
        return [len(c) + (0.5 if a is None else 0.0) for c, a in zip(completions, answers)]

    def as_tensor(prompts, completions, answers, **columns):
        return torch.tensor([float(len(c)) for c in completions])

    NOT_A_FUNCTION = 3
"""


def test_user_function_resolves_against_base_dir_and_gets_the_columns(tmp_path):
    write(tmp_path / "conf" / "rewards" / "mine.py", USER_REWARDS)
    specs = [{"name": "mine", "function": "rewards/mine.py:score", "weight": 0.5}]
    (reward,) = load_rewards(specs, tmp_path / "conf")
    path = (tmp_path / "conf" / "rewards" / "mine.py").resolve()
    assert (reward.name, reward.weight, reward.where) == ("mine", 0.5, f"{path}:score")
    columns = [{"level": 1, "topic": "add"}, {"level": 2}, {"topic": "sub", "level": 3}]
    values = reward(["p0", "p1", "p2"], ["a", "bbb", "cc"], ["1", None, "3"], columns)
    assert values == [1.0, 3.5, 2.0] and all(type(v) is float for v in values)
    module = sys.modules[reward.fn.__module__]
    assert module.CALLS == [
        (["p0", "p1", "p2"], ["a", "bbb", "cc"], ["1", None, "3"], {"level": [1, 2, 3], "topic": ["add", None, "sub"]})
    ]
    # an absolute path is used as given, whatever base_dir says
    (tensor_reward,) = load_rewards([{"name": "t", "function": f"{path}:as_tensor"}], tmp_path / "elsewhere")
    assert run(tensor_reward, ["ab", ""], [None, None]) == [2.0, 0.0]


def test_user_file_runs_alone_its_directory_is_not_put_on_the_import_path(tmp_path):
    write(tmp_path / "helper_for_rewards_test.py", "VALUE = 1\n")
    write(tmp_path / "uses_helper.py", "import helper_for_rewards_test\n\ndef f(p, c, a):\n    return [1.0] * len(c)\n")
    path_before = list(sys.path)
    with pytest.raises(ConfigError, match=r"rl.rewards\[0\].function: importing .*uses_helper.py raised Module"):
        load_rewards([{"name": "h", "function": "uses_helper.py:f"}], tmp_path)
    assert sys.path == path_before and "helper_for_rewards_test" not in sys.modules
    # control: with its directory on the path the same file imports fine, so the failure above was the isolation
    sys.path.insert(0, str(tmp_path))
    try:
        assert run(one({"name": "h", "function": "uses_helper.py:f"}, tmp_path), ["x"], [None]) == [1.0]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("helper_for_rewards_test", None)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ({"name": "x", "function": "math"}, r"rl.rewards: expected a list .* got dict"),
        (["math"], r"rl.rewards\[0\]: expected a mapping .* got str"),
        ([{"function": "math"}], r"rl.rewards\[0\].name: required"),
        ([{"name": "x"}], r"rl.rewards\[0\].function: required"),
        ([{"name": "rl/x", "function": "math"}], r"rl.rewards\[0\].name: 'rl/x' may hold only"),
        ([{"name": "x", "function": "math"}, {"name": "x", "function": "math"}], r"rl.rewards\[1\].name: 'x' is also"),
        ([{"name": "x", "function": "math", "weight": "1"}], r"rl.rewards\[0\].weight: expected a finite number"),
        ([{"name": "x", "function": "math", "weight": math.inf}], r"rl.rewards\[0\].weight: expected a finite"),
        ([{"name": "x", "function": "math", "weight": True}], r"rl.rewards\[0\].weight: expected a finite number"),
        ([{"name": "x", "function": "math", "pattern": "7"}], r"rl.rewards\[0\].pattern: unknown key; the built-in 'm"),
        ([{"name": "x", "fuction": "math"}], r"rl.rewards\[0\].fuction: unknown key \(did you mean `function`\?\); a"),
        ([{"nmae": "x", "function": "math"}], r"rl.rewards\[0\].nmae: unknown key \(did you mean `name`\?\); the b"),
        ([{"name": "x", "function": "regex", "patern": "7"}], r"\[0\].patern: unknown key \(did you mean `pattern`\?"),
        ([{"name": "x", "function": "mine.py:score", "wieght": 2}], r"\[0\].wieght: unknown key \(did you mean `weig"),
        ([{"name": "x", "function": "regex"}], r"rl.rewards\[0\].pattern: the built-in 'regex' needs a pattern"),
        ([{"name": "x", "function": "regex", "pattern": "(7"}], r"rl.rewards\[0\].pattern: '\(7' is not a valid"),
        ([{"name": "x", "function": "exact_match", "end_of_turn": 3}], r"rl.rewards\[0\].end_of_turn: expected a"),
        ([{"name": "x", "function": "exactmatch"}], r"rl.rewards\[0\].function: 'exactmatch' is neither a built-in"),
        ([{"name": "x", "function": "mine.py"}], r"rl.rewards\[0\].function: 'mine.py' is neither a built-in"),
        ([{"name": "x", "function": "absent.py:score"}], r"rl.rewards\[0\].function: .*absent.py does not exist"),
        ([{"name": "x", "function": "mine.py:nothing"}], r"rl.rewards\[0\].function: .*mine.py defines no 'nothing'"),
        ([{"name": "x", "function": "mine.py:NOT_A_FUNCTION"}], r"rl.rewards\[0\].function: .* is a int, not a"),
        ([{"name": "x", "function": "mine.py:score", "scale": 2}], r"rl.rewards\[0\].scale: unknown key; a function"),
        ([{"name": "x", "function": "math", "zzz": 2}], r"rl.rewards\[0\].zzz: unknown key; the built-in 'math' takes"),
        (
            [{"name": "x", "function": "broken.py:score"}],
            r"rl.rewards\[0\].function: importing .*broken.py raised Zero",
        ),
    ],
)
def test_bad_specs_are_config_errors_naming_index_and_key(tmp_path, specs, message):
    write(tmp_path / "mine.py", USER_REWARDS)
    write(tmp_path / "broken.py", "1 / 0\n")
    with pytest.raises(ConfigError, match=message):
        load_rewards(specs, tmp_path)


def test_defaults_and_the_same_file_is_imported_once(tmp_path):
    write(tmp_path / "mine.py", USER_REWARDS)
    specs = [{"name": "a", "function": "mine.py:score"}, {"name": "b", "function": "mine.py:as_tensor", "weight": -2}]
    first, second = load_rewards(specs, tmp_path)
    assert (first.weight, second.weight) == (1.0, -2.0) and type(second.weight) is float
    assert first.fn.__module__ == second.fn.__module__
    assert load_rewards([], tmp_path) == []


# ---- every way a reward can fail names the function, the file and the row ----

FAULTY = """
    import math

    def raises_on_boom(prompts, completions, answers, **columns):
        return [1.0 / (c != "boom") for c in completions]

    def raises_on_pairs(prompts, completions, answers, **columns):
        if len(completions) > 1:
            raise RuntimeError("batches of two are not allowed")
        return [1.0]

    def short(prompts, completions, answers, **columns):
        return [1.0] * (len(completions) - 1)

    def text(prompts, completions, answers, **columns):
        return ["1.0" if c == "bad" else 1.0 for c in completions]

    def none(prompts, completions, answers, **columns):
        return [None if c == "bad" else 1.0 for c in completions]

    def nan(prompts, completions, answers, **columns):
        return [math.nan if c == "bad" else 1.0 for c in completions]

    def inf(prompts, completions, answers, **columns):
        return [-math.inf if c == "bad" else 1.0 for c in completions]

    def scalar(prompts, completions, answers, **columns):
        return 1.0

    def matrix(prompts, completions, answers, **columns):
        import numpy
        return numpy.ones((len(completions), 1))

    def numbers(prompts, completions, answers, **columns):
        import numpy, torch
        return [True, numpy.float32(0.5), torch.tensor(2.0)]
"""
ROWS = [row_name("data/train.jsonl", 3), row_name("data/train.jsonl", 4), row_name("data/more.jsonl", 0)]


@pytest.fixture()
def faulty(tmp_path):
    write(tmp_path / "faulty.py", FAULTY)
    return lambda function: one({"name": "mine", "function": f"faulty.py:{function}"}, tmp_path)


def named(function: str, row: str, problem: str) -> str:
    return rf"reward 'mine' \(/.*/faulty\.py:{function}\), {row}: {problem}"


@pytest.mark.parametrize(
    ("function", "row", "problem"),
    [
        (
            "raises_on_boom",
            r"data/train\.jsonl, row 4 \(0-based\)",
            r"raised ZeroDivisionError: .* at /.*/faulty.py:5 ",
        ),
        ("raises_on_pairs", "the batch of 3 rows from .* to .*more.jsonl, row 0 .*", r"raised RuntimeError: batches"),
        ("short", "the batch of 3 rows from .*", "returned 2 values for 3 rows"),
        ("text", r"data/train\.jsonl, row 4 \(0-based\)", r"returned '1.0' \(str\), not a real number"),
        ("none", r"data/train\.jsonl, row 4 \(0-based\)", r"returned None \(NoneType\), not a real number"),
        ("nan", r"data/train\.jsonl, row 4 \(0-based\)", "returned nan, not a finite number"),
        ("inf", r"data/train\.jsonl, row 4 \(0-based\)", "returned -inf, not a finite number"),
        ("scalar", "the batch of 3 rows .*", "returned float, expected a list of 3 numbers"),
        ("matrix", "the batch of 3 rows .*", r"returned an array of shape \(3, 1\), expected \(3,\)"),
    ],
)
def test_a_failing_reward_names_function_file_and_row(faulty, function, row, problem):
    completions = ["fine", "boom" if function == "raises_on_boom" else "bad", "fine"]
    with pytest.raises(RewardError, match=named(function, row, problem)):
        faulty(function)(["q"] * 3, completions, [None] * 3, [{}] * 3, rows=ROWS)


def test_numbers_of_any_real_type_are_accepted_and_columns_may_not_shadow_the_arguments(faulty):
    assert faulty("numbers")(["q"] * 3, ["a", "b", "c"], [None] * 3, [{}] * 3) == [1.0, 0.5, 2.0]
    with pytest.raises(RewardError, match=r"the batch of 2 rows .*: the data has a column named 'answers'"):
        faulty("scalar")(["q"] * 2, ["a", "b"], [None] * 2, [{"answers": 1}, {}], rows=ROWS[:2])


def test_score_sums_weighted_rewards_in_float64(tmp_path):
    write(tmp_path / "mine.py", USER_REWARDS)
    specs = [
        {"name": "correct", "function": "math"},
        {"name": "fmt", "function": "regex", "pattern": "^\\d+ [+-] \\d+ = \\d+$", "weight": 0.1},
        {"name": "length", "function": "mine.py:score", "weight": -0.01},
    ]
    rewards = load_rewards(specs, tmp_path)
    completions = ["3 + 4 = 7", "3 + 4 = 8", "I think 7", "\\boxed{7}"]
    answers = ["7", "7", "7", "7"]
    total, each = score(rewards, ["q"] * 4, completions, answers, [{}] * 4, ROWS + ["x"])
    correct, fmt, length = [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]
    expected = [c + 0.1 * f - 0.01 * n for c, f, n in zip(correct, fmt, length)]
    assert total.dtype == torch.float64 and total.tolist() == expected  # same operations, same order: bit-equal
    assert {name: t.tolist() for name, t in each.items()} == {"correct": correct, "fmt": fmt, "length": length}
    assert all(t.dtype == torch.float64 for t in each.values())
    empty_total, empty_each = score([], ["q"], ["a"], [None], [{}], ["r"])
    assert empty_total.tolist() == [0.0] and empty_each == {}
    with pytest.raises(ValueError, match="one entry per row"):
        score(rewards, ["q"] * 4, completions, answers, [{}] * 4, ROWS)


# ---- a fault on one rank is the same named error on every rank ----


def _score_then_agree(rank: int, world_size: int, base_dir: str) -> str:
    from veomni_lite.distributed.collectives import agree

    rewards = load_rewards(
        [{"name": "correct", "function": "math"}, {"name": "mine", "function": "faulty.py:raises_on_boom"}], base_dir
    )
    completions = ["3 + 4 = 7", "boom"] if rank == 1 else ["3 + 4 = 7", "2 + 2 = 4"]
    rows = [row_name("data/rl.jsonl", 2 * rank + i) for i in range(2)]
    problem = None
    try:
        total, _ = score(rewards, ["q", "q"], completions, ["7", "4"], [{}, {}], rows)
    except RewardError as exc:
        problem = exc
    try:
        agree(problem, RewardError)
    except RewardError as exc:
        return str(exc)
    return f"no error; totals {total.tolist()}"


@pytest.mark.slow
def test_a_reward_failing_on_one_ranks_row_is_the_same_named_error_on_every_rank(tmp_path):
    from tests.dist_helpers import run_distributed

    write(tmp_path / "faulty.py", FAULTY)
    messages = run_distributed(_score_then_agree, 2, str(tmp_path), timeout_s=120, pg_timeout_s=30)
    path = (tmp_path / "faulty.py").resolve()
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        f"rank 1: reward 'mine' ({path}:raises_on_boom), data/rl.jsonl, row 3 (0-based): raised ZeroDivisionError"
    )
    # control: the same call with no fault on any rank returns the totals on both ranks
    write(tmp_path / "faulty.py", FAULTY.replace('c != "boom"', "True"))
    assert run_distributed(_score_then_agree, 2, str(tmp_path), timeout_s=120, pg_timeout_s=30) == [
        "no error; totals [2.0, 2.0]",
        "no error; totals [2.0, 1.0]",  # "boom" holds no number: math gives 0
    ]


def test_a_mistyped_key_of_a_reward_entry_is_named_with_the_key_it_resembles_through_the_config():
    from veomni_lite.config import load_config
    from veomni_lite.rl.config import RLConfig

    with pytest.raises(ConfigError) as caught:
        load_config(None, ["--rl.rewards", "[{name: correct, fuction: math}]"], sections={"rl": RLConfig})
    assert str(caught.value).endswith(
        "rl.rewards[0].fuction: unknown key (did you mean `function`?); a reward entry takes name, function, weight, "
        "end_of_turn, pattern, path, suffix, batch_size, device, dtype, url, model, rubric, parser, max_score, "
        "max_tokens, max_concurrency, retries, timeout_s, api_key_env"
    )


# ---- rl.overlong_buffer: DAPO's soft overlong punishment ----


def test_overlong_penalty_follows_dapos_formula():
    from veomni_lite.rl.rewards import overlong_penalty

    max_new, length, penalty = 20, 8, 0.5
    lengths = list(range(0, 21))
    got = overlong_penalty(lengths, max_new, length, penalty)
    expected = [min(-(n - (max_new - length)) / length * penalty, 0.0) for n in lengths]  # verl's dapo reward
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx(expected, abs=1e-15)
    assert got[:13].tolist() == [0.0] * 13 and not torch.signbit(got[:13]).any()  # no penalty, no -0.0, up to 12
    assert got[16].item() == -0.25 and got[20].item() == -0.5  # halfway through the buffer, and at max_new_tokens
    # negative control: a penalty from the first token of the buffer's start (off by one) is not the formula
    assert overlong_penalty([13], max_new, length, penalty).item() == -0.0625
    with pytest.raises(ValueError, match="length must be in"):
        overlong_penalty([1], 20, 21, 1.0)


def test_overlong_buffer_config_is_checked():
    from veomni_lite.rl.config import OverlongBuffer

    assert OverlongBuffer.parse({"length": 4, "penalty": 2}, 16) == OverlongBuffer(4, 2.0)
    assert OverlongBuffer.parse({"length": 4}, 16).penalty == 1.0
    for entry, match in (
        ({"length": 17}, r"rl.overlong_buffer.length: must be in \(0, rl.max_new_tokens=16\]"),
        ({"penalty": 1.0}, "rl.overlong_buffer.length: required"),
        ({"length": 4, "penalty": -1}, "rl.overlong_buffer.penalty: must be >= 0"),
        ({"length": 4, "factor": 1}, "unknown config key 'rl.overlong_buffer.factor'"),
        ({"length": "four"}, "rl.overlong_buffer.length: expected int, got 'four'"),
    ):
        with pytest.raises(ConfigError, match=match):
            OverlongBuffer.parse(entry, 16)
