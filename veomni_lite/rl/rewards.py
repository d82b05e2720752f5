"""Reward functions for online RL: the built-ins and the user's own, loaded from `rl.rewards`, checked and summed.

Contract:
- `load_rewards(specs, base_dir)` returns one `RewardFunction` per spec `{name, function, weight: 1.0, **options}`,
  in order. `name` (letters, digits, `_ . -`; unique) names the metric `rl/rewards/<name>`; `weight` is a finite
  number (0 logs a reward without training on it; negative is a penalty). `function` is a built-in or
  `path/to/file.py:function`: a relative path resolves against `base_dir` (the trainer passes the config file's
  directory, so a config and its reward file travel together), an absolute one is used as given. That file, and only
  that file, is executed with importlib (its directory is not put on `sys.path`), because the user's config names it;
  nothing from a dataset or a model directory runs. A bad spec (not a mapping, a missing or unknown key, a duplicate
  name, an unknown built-in, a missing file or function, a file that fails to import, a bad `pattern`) is a
  `ConfigError` (a ValueError) naming `rl.rewards[i].<key>`; an unknown key comes first, with the closest known one
  (`fuction`: "unknown key (did you mean `function`?)").
- Built-ins score each row alone (`answers[i]` is row i's reference answer text, None when it has none):
  `exact_match`: 1.0 when `normalize(completion) == normalize(answer)`, else 0.0; `normalize` strips, removes a
  trailing end-of-turn text (option `end_of_turn`: a string or a list of them, e.g. "<|im_end|>"), strips trailing
  `TRAILING_PUNCTUATION`, collapses whitespace runs to one space and casefolds. A missing answer is an error.
  `math`: 1.0 when math-verify finds the completion's answer equivalent to the reference
  (`verify(parse(answer), parse(completion))`: the last number, expression or `\\boxed{}` of the completion, compared
  symbolically) and the answer is worked out as far as the reference is, else 0.0. Worked out: arithmetic on numbers
  left undone (`4 + 6`, `2^3`, `12 - 8 + 1`: an expression that sympy's `doit()` changes; a fraction `p/q` is
  an answer) scores 0 against a reference that is not itself undone (`10`), because math-verify alone finds `4 + 6`
  equal to `10` and a policy learns to restate the question's operands instead of answering. `10`, `\\boxed{10}`,
  `10.0`, `4 + 6 = 10` and `1/2` against `0.5` still score 1; a reference such as `2^10` accepts `2^10`. A missing
  answer, or one math-verify cannot parse, is an error.
  `regex`: 1.0 when `re.search(pattern, completion)` matches (option `pattern`, required; anchor it with `^...$`, or
  `\\A...\\Z`, to require the whole completion), else 0.0.
  `reward_model` (a sequence-classification reward model directory's score of the rendered prompt + completion, in
  batches, on a device of its own) and `judge` (an LLM judge behind an OpenAI-compatible URL with a rubric and a
  parser, its requests concurrent and retried) score the batch at once: `veomni_lite.rl.model_rewards`.
  `reasoning_gym`: the row's reasoning-gym task's own `score_answer` (rows of a `reasoning_gym:` prompt source, whose
  `metadata` column names the task; `veomni_lite.rl.hubs`).
- A user function is called once per batch as `f(prompts, completions, answers, **columns)`, columns being
  {column name: list of the rows' values} (a row without a column gives None), and returns one real number per row
  (a list, a tuple, or a 1-D tensor or array). A column named `prompts`, `completions` or `answers` is an error.
- `RewardFunction.__call__` returns the rows' values as Python floats, or raises `RewardError` naming the reward, its
  `where` and the row: when the function raises (a user function that raises on the batch is called again row by
  row, and the first row that raises alone is named; rewards should be pure functions), returns a value that is not
  a real number or not finite, or returns the wrong number of values (the message then names the batch's rows).
- `score` gives (total float64 [N] = sum over rewards of weight * value, {name: float64 [N] unweighted}).
- `overlong_penalty(lengths, max_new_tokens, length, penalty)` is DAPO's soft overlong punishment (`rl.overlong_buffer`,
  verl's `overlong_buffer`): a response of L tokens gets min(0, -(L - (max_new_tokens - length)) / length * penalty):
  0 up to max_new_tokens - length tokens, then linearly down to -penalty at max_new_tokens; the trainer adds it to the
  total (weight 1) and logs it as `rl/rewards/overlong`.
- `check_answers(rewards, answers, rows)` raises, before any rollout, the RewardError scoring would raise on the first
  row whose reference answer a reward that needs one cannot use (`exact_match`: a missing or non-text answer; `math`:
  also one math-verify cannot parse); the trainer calls it on every prompt row at start. A user's function is not
  checked (whether it needs the answer is its own).
Each rank scores the rollouts it generated; the trainer then calls `agree(problem, RewardError, group)`, so a
reward that fails on one rank's row is the same named error on every rank.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import numbers
import re
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from veomni_lite.config import ConfigError, unknown_key
from veomni_lite.data.checks import DataError
from veomni_lite.rl.model_rewards import JUDGE_OPTIONS, REWARD_MODEL_OPTIONS, RowFailure, load_model_reward

BUILT_INS: dict[str, tuple[str, ...]] = {
    "exact_match": ("end_of_turn",),
    "math": (),
    "regex": ("pattern",),
    "reward_model": REWARD_MODEL_OPTIONS,
    "judge": JUDGE_OPTIONS,
    "reasoning_gym": (),
}
"""Each built-in and the options it takes."""
TRAILING_PUNCTUATION = ".,!?;:。，！？；："
RESERVED_COLUMNS = ("prompts", "completions", "answers")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_SPEC_KEYS = ("name", "function", "weight")
MATH_TIMEOUT_S = 5
"""math-verify's own per-call timeout (signal.alarm: only in the main thread; elsewhere it runs without one)."""


class RewardError(DataError):
    """A reward function that raised or returned something other than one finite number per row; the message names
    the reward, its function (the file for a user's) and the row."""


class _RowProblem(Exception):
    """A built-in's complaint about one row (reported as a RewardError naming the row)."""


@dataclass(frozen=True)
class RewardFunction:
    """One loaded reward: `name` (the metric `rl/rewards/<name>`), `weight` in the total, `where` ("built-in
    exact_match" or "/abs/path/file.py:function"). `fn` is a built-in's per-row `(prompt, completion, answer) ->
    float` when `per_row`, else the user's batch function."""

    name: str
    weight: float
    where: str
    fn: Callable[..., Any] = field(repr=False, compare=False)
    per_row: bool = field(default=False, repr=False)
    answer_check: Callable[[Any], Any] | None = field(default=None, repr=False, compare=False)
    """A built-in's check of one reference answer (raises `_RowProblem`), None when the reward needs no answer."""

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        answers: Sequence[str | None],
        columns: Sequence[Mapping[str, Any]],
        rows: Sequence[str] | None = None,
    ) -> list[float]:
        """The rows' rewards (see the module docstring); `rows[i]` names row i in errors (default "batch row i")."""
        rows = _check_lengths(prompts, completions, answers, columns, rows)
        return self.evaluate(list(prompts), list(completions), list(answers), _by_column(columns), rows)

    def evaluate(
        self,
        prompts: list[str],
        completions: list[str],
        answers: list[str | None],
        columns: dict[str, list[Any]],
        rows: list[str],
    ) -> list[float]:
        """`__call__` on columns already gathered as {name: values over the rows} (what `score` passes)."""
        if self.per_row:
            values = []
            for index, (prompt, completion, answer) in enumerate(zip(prompts, completions, answers)):
                try:
                    values.append(self.fn(prompt, completion, answer))
                except Exception as exc:  # noqa: BLE001 - any failure becomes the row's named error
                    raise self._error(rows[index], _describe(exc)) from exc
            return self._check(values, rows)
        clash = [name for name in RESERVED_COLUMNS if name in columns]
        if clash:
            problem = f"the data has a column named {clash[0]!r}, which the call f(prompts, completions, answers, "
            raise self._error(_batch(rows), problem + "**columns) already passes; rename the column")
        try:
            out = self.fn(list(prompts), list(completions), list(answers), **{k: list(v) for k, v in columns.items()})
        except RowFailure as exc:  # a model-based reward names its row itself
            raise self._error(rows[exc.index], str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - find the row, then name it
            raise self._row_that_raises(prompts, completions, answers, columns, rows, exc) from exc
        return self._check(out, rows)

    def check_answers(self, answers: Sequence[Any], rows: Sequence[str]) -> None:
        """Raise the RewardError scoring would raise on the first row (`rows[i]` names row i) whose reference answer
        this reward cannot use; a reward that needs no answer (`answer_check` None) checks nothing."""
        if self.answer_check is None:
            return
        for answer, row in zip(answers, rows, strict=True):
            try:
                self.answer_check(answer)
            except Exception as exc:  # noqa: BLE001 - the same named error as the row's scoring
                raise self._error(row, _describe(exc)) from exc

    def _row_that_raises(
        self,
        prompts: list[str],
        completions: list[str],
        answers: list[str | None],
        columns: dict[str, list[Any]],
        rows: list[str],
        exc: Exception,
    ) -> RewardError:
        if len(rows) == 1:
            return self._error(rows[0], _describe(exc))
        for index, row in enumerate(rows):
            one = {name: [values[index]] for name, values in columns.items()}
            try:
                self.fn([prompts[index]], [completions[index]], [answers[index]], **one)
            except Exception as alone:  # noqa: BLE001
                return self._error(row, f"{_describe(alone)} (called row by row after the batch raised)")
        return self._error(_batch(rows), f"{_describe(exc)} (on the batch; no row raises alone)")

    def _check(self, out: Any, rows: list[str]) -> list[float]:
        if isinstance(out, torch.Tensor) or (hasattr(out, "ndim") and hasattr(out, "tolist")):
            if out.ndim != 1:
                shape = f"returned an array of shape {tuple(out.shape)}, expected ({len(rows)},)"
                raise self._error(_batch(rows), shape)
            out = out.tolist()
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise self._error(_batch(rows), f"returned {type(out).__name__}, expected a list of {len(rows)} numbers")
        if len(out) != len(rows):
            raise self._error(_batch(rows), f"returned {len(out)} values for {len(rows)} rows")
        values = []
        for row, value in zip(rows, out):
            if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
                value = value.item()
            if not isinstance(value, numbers.Real):
                raise self._error(row, f"returned {value!r} ({type(value).__name__}), not a real number")
            if not math.isfinite(float(value)):
                raise self._error(row, f"returned {float(value)}, not a finite number")
            values.append(float(value))
        return values

    def _error(self, row: str, problem: str) -> RewardError:
        return RewardError(f"reward {self.name!r} ({self.where}), {row}: {problem}")


def _describe(exc: BaseException) -> str:
    """The exception as "raised Type: message", with the innermost frame outside this module (the user's line);
    a built-in's complaint about the row as it is."""
    if isinstance(exc, _RowProblem):
        return str(exc)
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename != __file__]
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"raised {type(exc).__name__}: {exc}{at}"


def _batch(rows: Sequence[str]) -> str:
    return rows[0] if len(rows) == 1 else f"the batch of {len(rows)} rows from {rows[0]} to {rows[-1]}"


def _check_lengths(
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
    columns: Sequence[Mapping[str, Any]],
    rows: Sequence[str] | None,
) -> list[str]:
    """The row names (default "batch row i"), once every argument has one entry per row (else ValueError)."""
    rows = [f"batch row {i}" for i in range(len(completions))] if rows is None else list(rows)
    sizes = {"prompts": len(prompts), "completions": len(completions), "answers": len(answers)}
    sizes |= {"columns": len(columns), "rows": len(rows)}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"rewards: every argument needs one entry per row, got lengths {sizes}")
    return rows


def _by_column(columns: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Rows' {column: value} as {column: [value per row]}: every column any row has, in first-seen order, None where
    a row lacks it."""
    names = list(dict.fromkeys(name for row in columns for name in row))
    return {name: [row.get(name) for row in columns] for name in names}


def score(
    rewards: Sequence[RewardFunction],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str | None],
    columns: Sequence[Mapping[str, Any]],
    rows: Sequence[str],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every reward on the N rows: (total float64 [N] = sum of weight * value, {name: float64 [N] unweighted}).
    Raises the first RewardError met (rewards in order); `rows[i]` names row i (e.g. `row_name(path, index)`)."""
    rows = _check_lengths(prompts, completions, answers, columns, rows)
    by_column = _by_column(columns)
    total = torch.zeros(len(rows), dtype=torch.float64)
    each: dict[str, torch.Tensor] = {}
    for reward in rewards:
        values = reward.evaluate(list(prompts), list(completions), list(answers), by_column, rows)
        each[reward.name] = torch.tensor(values, dtype=torch.float64).reshape(len(rows))
        total = total + reward.weight * each[reward.name]
    return total, each


OVERLONG = "overlong"  # the overlong buffer's reward name: `rl/rewards/overlong`


def overlong_penalty(lengths: Sequence[int], max_new_tokens: int, length: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment of responses of `lengths` tokens, float64 [N] in [-penalty, 0] (module
    docstring); `0 < length <= max_new_tokens`."""
    if not 0 < length <= max_new_tokens:
        raise ValueError(f"overlong_penalty: length must be in (0, max_new_tokens={max_new_tokens}], got {length}")
    tokens = torch.tensor(list(lengths), dtype=torch.float64)
    exceed = tokens - (max_new_tokens - length)
    return torch.clamp(-exceed / length * penalty, max=0.0) + 0.0  # + 0.0: no -0.0


def check_answers(rewards: Sequence[RewardFunction], answers: Sequence[Any], rows: Sequence[str]) -> None:
    """Every reward's `check_answers` on the rows' reference answers, rewards in order (the first RewardError, as
    `score` would raise it on that row)."""
    for reward in rewards:
        reward.check_answers(answers, rows)


# ---- built-ins ----


def normalize(text: str, end_of_turn: Sequence[str] = ()) -> str:
    """`exact_match`'s normal form: stripped, a trailing end-of-turn text removed (repeatedly), trailing
    `TRAILING_PUNCTUATION` removed, whitespace runs made one space, casefolded."""
    text = text.strip()
    while True:
        marker = next((m for m in end_of_turn if m and text.endswith(m)), None)
        if marker is None:
            break
        text = text[: -len(marker)].rstrip()
    text = text.rstrip(TRAILING_PUNCTUATION + " \t\r\n")
    return " ".join(text.split()).casefold()


def _answer_text(answer: Any) -> str:
    if answer is None:
        raise _RowProblem("the row has no reference answer (its answer column is missing or null)")
    if isinstance(answer, int) and not isinstance(answer, bool):
        return str(answer)
    if not isinstance(answer, str):
        raise _RowProblem(f"the reference answer is {type(answer).__name__} {answer!r}, expected text")
    return answer


def _exact_match(end_of_turn: tuple[str, ...]) -> Callable[[str, str, Any], float]:
    def exact_match(prompt: str, completion: str, answer: Any) -> float:
        reference = normalize(_answer_text(answer), end_of_turn)
        return float(normalize(completion, end_of_turn) == reference)

    return exact_match


def _math_timeout() -> int | None:
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_reference(answer: str, timeout: int | None) -> list[Any]:
    from math_verify import parse

    return parse(answer, parsing_timeout=timeout)


def _math_reference(answer: Any, timeout: int | None = None) -> list[Any]:
    """math-verify's parse of a reference answer (a `_RowProblem` when there is none, or it finds nothing)."""
    reference = _parse_reference(_answer_text(answer), timeout)
    if not reference:
        raise _RowProblem(f"math-verify finds no answer it can parse in the reference {answer!r}")
    return reference


def _math(prompt: str, completion: str, answer: Any) -> float:
    from math_verify import parse, verify

    timeout = _math_timeout()
    reference = _math_reference(answer, timeout)
    predicted = parse(completion, parsing_timeout=timeout)
    if not predicted or (_undone(predicted[0]) and not _undone(reference[0])):
        return 0.0
    return float(verify(reference, predicted, timeout_seconds=timeout))


def _undone(expr: Any) -> bool:
    """Whether math-verify's parse `expr` is arithmetic on numbers left undone (`4 + 6`, `2^3`; module docstring):
    a number-valued sympy expression that `doit()` changes, other than a fraction `p/q` (or `-p/q`)."""
    import sympy

    if not isinstance(expr, sympy.Basic) or not expr.is_number:
        return False
    if isinstance(expr, sympy.Mul) and all(
        arg.is_Rational or (arg.is_Pow and arg.base.is_Integer and arg.exp == -1) for arg in expr.args
    ):
        return False
    return expr.doit() != expr


def _regex(pattern: re.Pattern[str]) -> Callable[[str, str, Any], float]:
    def regex(prompt: str, completion: str, answer: Any) -> float:
        return float(pattern.search(completion) is not None)

    return regex


def _reasoning_gym(prompts: list[str], completions: list[str], answers: list[Any], **columns: Any) -> list[float]:
    """The built-in `reasoning_gym`: each completion scored by its row's task (`metadata.source_dataset`) with the
    task's own `score_answer(completion, {question, answer, metadata})`."""
    import reasoning_gym

    values = []
    questions = columns.get("question") or [None] * len(completions)
    metadatas = columns.get("metadata") or [None] * len(completions)
    for index, (completion, answer, metadata) in enumerate(zip(completions, answers, metadatas)):
        if not isinstance(metadata, Mapping) or "source_dataset" not in metadata:
            raise RowFailure(index, "the row has no reasoning-gym `metadata` (not from a reasoning_gym: source)")
        entry = {"question": questions[index], "answer": answer, "metadata": metadata}
        values.append(float(reasoning_gym.get_score_answer_fn(metadata["source_dataset"])(completion, entry)))
    return values


_ANSWER_CHECKS: dict[str, Callable[[Any], Any]] = {
    "exact_match": _answer_text,
    "math": lambda answer: _math_reference(answer, _math_timeout()),
}
"""The built-ins that need a reference answer: each one's check of it (what its scoring of the row would raise)."""


# ---- loading ----


def load_rewards(
    specs: Sequence[Mapping[str, Any]], base_dir: str | Path = ".", key: str = "rl.rewards"
) -> list[RewardFunction]:
    """One RewardFunction per spec, in order (see the module docstring); `key` prefixes the ConfigError messages."""
    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
        raise ConfigError(f"{key}: expected a list of {{name, function, weight}} mappings, got {type(specs).__name__}")
    modules: dict[Path, ModuleType] = {}
    names: dict[str, int] = {}
    loaded = []
    for index, spec in enumerate(specs):
        at = f"{key}[{index}]"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{at}: expected a mapping {{name, function, weight}}, got {type(spec).__name__}")
        _check_keys(at, spec)
        for required in ("name", "function"):
            if not isinstance(spec.get(required), str) or not spec[required]:
                raise ConfigError(f"{at}.{required}: required, a non-empty string (got {spec.get(required)!r})")
        name, target = spec["name"], spec["function"]
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{at}.name: {name!r} may hold only letters, digits, '_', '.' and '-' (a metric name)")
        if name in names:
            raise ConfigError(f"{at}.name: {name!r} is also {key}[{names[name]}].name; reward names must be unique")
        names[name] = index
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ConfigError(f"{at}.weight: expected a finite number, got {weight!r}")
        options = {k: v for k, v in spec.items() if k not in _SPEC_KEYS}
        if target in ("reward_model", "judge"):  # batch functions of their own (`veomni_lite.rl.model_rewards`)

            def parser(target: str, at: str = at) -> Callable[..., Any]:
                return user_object(f"{at}.parser", target, Path(base_dir), modules)[0]

            fn, where = load_model_reward(at, target, options, Path(base_dir), parser)
            loaded.append(RewardFunction(name, float(weight), where, fn))
        elif target == "reasoning_gym":  # a batch function reading the rows' `metadata` column
            if importlib.util.find_spec("reasoning_gym") is None:
                raise ConfigError(f"{at}.function: the built-in 'reasoning_gym' needs reasoning-gym (pip install -e "
                                  "'.[envs]')")  # fmt: skip
            loaded.append(RewardFunction(name, float(weight), "built-in reasoning_gym", _reasoning_gym))
        elif target in BUILT_INS:
            fn = _built_in(at, target, options)
            check = _ANSWER_CHECKS.get(target)
            loaded.append(RewardFunction(name, float(weight), f"built-in {target}", fn, True, check))
        else:
            fn, where = user_object(at, target, Path(base_dir), modules)
            loaded.append(RewardFunction(name, float(weight), where, fn))
    return loaded


def _check_keys(at: str, spec: Mapping[str, Any]) -> None:
    """A ConfigError naming the entry's first unknown key, with the closest known one (`config.unknown_key`): known are
    name, function, weight and the options of the entry's built-in (none for a function of your own; any built-in's
    while `function` is missing, so that a mistyped `function` is named as such)."""
    target = spec.get("function")
    if isinstance(target, str) and target in BUILT_INS:
        known, takes = _SPEC_KEYS + BUILT_INS[target], f"the built-in {target!r} takes"
    elif isinstance(target, str) and target:
        known, takes = _SPEC_KEYS, "a function of your own takes no options:"
    else:
        options = tuple(dict.fromkeys(option for built_in in BUILT_INS.values() for option in built_in))
        known, takes = _SPEC_KEYS + options, "a reward entry takes"
    for key in spec:
        if key not in known:
            raise unknown_key(at, str(key), known, f"{takes} {', '.join(known)}")


def _built_in(at: str, target: str, options: dict[str, Any]) -> Callable[[str, str, Any], float]:
    if target == "exact_match":
        end_of_turn = options.get("end_of_turn", ())
        end_of_turn = (end_of_turn,) if isinstance(end_of_turn, str) else end_of_turn
        if not isinstance(end_of_turn, Sequence) or not all(isinstance(m, str) for m in end_of_turn):
            raise ConfigError(f"{at}.end_of_turn: expected a string or a list of strings, got {end_of_turn!r}")
        return _exact_match(tuple(end_of_turn))
    if target == "regex":
        pattern = options.get("pattern")
        if not isinstance(pattern, str):
            raise ConfigError(f"{at}.pattern: the built-in 'regex' needs a pattern string, got {pattern!r}")
        try:
            return _regex(re.compile(pattern))
        except re.error as exc:
            raise ConfigError(f"{at}.pattern: {pattern!r} is not a valid regular expression: {exc}") from exc
    try:
        import math_verify  # noqa: F401 - fail at load, not at the first rollout
    except ImportError as exc:
        raise ConfigError(f"{at}.function: the built-in 'math' needs math-verify (pip install math-verify)") from exc
    return _math


def user_object(
    at: str, target: str, base_dir: Path, modules: dict[Path, ModuleType]
) -> tuple[Callable[..., Any], str]:
    """The object `target` ('path/to/file.py:name', a relative path against `base_dir`) names, and where it was
    found; each file imported once into `modules` (it runs because the config names it). ConfigError naming `at`."""
    path_text, _, function = target.rpartition(":")
    if not path_text.endswith(".py") or not function.isidentifier():
        raise ConfigError(
            f"{at}.function: {target!r} is neither a built-in ({', '.join(BUILT_INS)}) nor 'path/to/file.py:function'"
        )
    path = Path(path_text).expanduser()
    path = (path if path.is_absolute() else base_dir / path).resolve()
    if not path.is_file():
        raise ConfigError(f"{at}.function: {path} does not exist (a relative path resolves against {base_dir})")
    if path not in modules:
        modules[path] = _import_file(at, path)
    fn = getattr(modules[path], function, None)
    if fn is None:
        raise ConfigError(f"{at}.function: {path} defines no {function!r}")
    if not callable(fn):
        raise ConfigError(f"{at}.function: {path}:{function} is a {type(fn).__name__}, not a function")
    return fn, f"{path}:{function}"


def _import_file(at: str, path: Path) -> ModuleType:
    """Execute the file at `path` as a module of its own (registered in sys.modules under a name derived from the
    path, so pickling and dataclasses inside it work); nothing else is put on the import path."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"veomni_lite_user_rewards_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{at}.function: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - a user file that fails to import is a config error
        del sys.modules[name]
        raise ConfigError(f"{at}.function: importing {path} raised {type(exc).__name__}: {exc}") from exc
    return module
