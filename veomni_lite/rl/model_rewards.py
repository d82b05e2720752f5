"""Model-based rewards, the built-ins `reward_model` and `judge` of `rl.rewards` (loaded by `veomni_lite.rl.rewards`).

Both are batch functions `f(prompts, completions, answers, **columns) -> list[float]`; a failure of one row is a
`RowFailure` naming the row's index, which the reward reports as a `RewardError` naming the reward, its `where` (the
reward model's directory, or the judge's model and URL) and the row. Each rank scores its own rollouts, as every reward.

`reward_model` {path, suffix, batch_size: 8, device: auto, dtype: float32}: the score of a sequence-classification
reward model directory (`make train-rm`'s export, or any transformers `...ForSequenceClassification` directory with
one label; local files only, no code from it runs), on the text the reward model was trained on: the prompt as the
policy saw it (rendered by the run's chat template with the generation prompt), then the completion and `suffix`,
tokenized as the preference data path tokenizes a pair's side (the rendered prompt alone, then the response with its
end of turn; `add_special_tokens` off). `suffix` defaults to what the directory's chat template writes after an
assistant's content (ChatML: "<|im_end|>\\n"; "" without a template), so a reward model trained on the policy's chat
template scores exactly the sequence it saw in training: a rollout's reward equals the model's own score of
prompt + completion + suffix, the score head on the last token's hidden state (transformers pools there too, at the
last token that is not its `pad_token_id`). The rows go through the model `batch_size` at a time, right-padded under an
attention mask, each row's score read at its own last token. The model and tokenizer are loaded at the first call,
once per process (per rank) and kept (the reward model's weights in memory for the whole run), on `device`: `auto`
is this rank's training device (`cuda:<current device>` when CUDA is available, else `cpu`); `cpu` keeps it off the
accelerator; or any torch device (`cuda:1`). `dtype`: float32 | bfloat16 | float16 | auto (the directory's own).

`judge` {url, model, rubric, pattern, parser, max_score: 10, max_tokens: 512, max_concurrency: 8, retries: 3,
timeout_s: 60, api_key_env}: an LLM judge behind an OpenAI-compatible server (`url` its base, e.g.
http://127.0.0.1:8001/v1; one `POST {url}/chat/completions` per row, temperature 0, the `rubric` as the user
message, `model` the served name). The rubric is a `str.format` template of the row: `{prompt}` (the prompt as the
policy saw it), `{response}`, `{answer}` (the reference answer, "" when none) and `{COLUMN}` for any other column of
the row (a row without it is its error); a literal brace is doubled. The judge's answer is read by `parser`, a user's
`path/to/file.py:function` (text -> number), or by default by `pattern` (a regex; its last match's first group, or
the whole match without groups, as a number; default `DEFAULT_PATTERN`, "Score: 7"); the reward is that number /
`max_score`. Requests run `max_concurrency` at a time (threads), each within `timeout_s`; a failed request (refused,
timed out, an HTTP error, an answer that is not a chat completion) is retried `retries` times after
`RETRY_BACKOFF_S * 2**attempt` seconds; a row still failing, or an answer the parser cannot read (not retried: the
judge answers at temperature 0), is its error naming the URL. The first failure stops the requests not yet sent.
`api_key_env` names an environment variable whose value is sent as `Authorization: Bearer ...`.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import re
import string
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from veomni_lite.config import ConfigError

__all__ = ["JUDGE_OPTIONS", "REWARD_MODEL_OPTIONS", "Judge", "RewardModelScorer", "RowFailure", "load_model_reward"]

REWARD_MODEL_OPTIONS = ("path", "suffix", "batch_size", "device", "dtype")
JUDGE_OPTIONS = ("url", "model", "rubric", "pattern", "parser", "max_score", "max_tokens", "max_concurrency",
                 "retries", "timeout_s", "api_key_env")  # fmt: skip
DEFAULT_PATTERN = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
"""The judge's default parser: "Score: 7", "score=7.5" (the last such match in the answer)."""
RETRY_BACKOFF_S = 1.0
"""A failed judge request's n-th retry waits RETRY_BACKOFF_S * 2**(n-1) seconds."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


class RowFailure(Exception):
    """Row `index` of the batch failed; the message says why (the reward names the row)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


# ---- reward model ----


@functools.lru_cache(maxsize=4)
def _load(directory: str, device: str, dtype: str) -> tuple[Any, Any, torch.device]:
    """(tokenizer, model, device) of a reward model directory, once per process."""
    from transformers import AutoModelForSequenceClassification

    from veomni_lite.models.pretrained import LOCAL_ONLY, load_tokenizer  # the tokenizer as training reads it

    place = torch.device(device if device != "auto" else _training_device())
    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=_DTYPES[dtype], **LOCAL_ONLY)
    return load_tokenizer(directory), model.to(place).eval(), place


def _training_device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def end_of_turn_text(tokenizer: Any) -> str:
    """What the tokenizer's chat template writes after an assistant's content ("" without a template)."""
    from veomni_lite.data.sft import PROBE_ANSWER

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE_ANSWER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - no template, or one that refuses the probe: no suffix
        return ""
    at = text.rfind(PROBE_ANSWER) if isinstance(text, str) else -1
    return text[at + len(PROBE_ANSWER) :] if at >= 0 else ""


class RewardModelScorer:
    """The `reward_model` built-in (module docstring); `suffix` None: the directory's chat template's end of turn."""

    def __init__(self, directory: str, suffix: str | None, batch_size: int, device: str, dtype: str) -> None:
        self.directory, self.suffix, self.batch_size = directory, suffix, batch_size
        self.device, self.dtype = device, dtype

    def sequences(self, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
        """Each row's token ids as the reward model reads them: the prompt's, then the completion + suffix's."""
        tokenizer = _load(self.directory, self.device, self.dtype)[0]
        suffix = end_of_turn_text(tokenizer) if self.suffix is None else self.suffix
        ids = [self._ids(tokenizer, p) + self._ids(tokenizer, c + suffix) for p, c in zip(prompts, completions)]
        empty = next((i for i, row in enumerate(ids) if not row), None)
        if empty is not None:
            raise RowFailure(empty, "the prompt, completion and suffix are empty: no token to score")
        return ids

    @staticmethod
    def _ids(tokenizer: Any, text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], answers: list[Any], **_: Any) -> list[float]:
        _, model, device = _load(self.directory, self.device, self.dtype)
        if not isinstance(getattr(model, "score", None), torch.nn.Module):
            name = type(model).__name__
            raise RowFailure(0, f"{name} has no `score` head over its base model (what a decoder's ...ForSequence"
                                "Classification has; the reward is read from it at the last token)")  # fmt: skip
        sequences = self.sequences(prompts, completions)
        scores: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            scores += score_batch(model, sequences[start : start + self.batch_size], device)
        return scores


def score_batch(model: Any, sequences: list[list[int]], device: torch.device) -> list[float]:
    """The score head on each sequence's last token, the sequences right-padded into one forward."""
    lengths = torch.tensor([len(ids) for ids in sequences])
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
    ids[mask] = torch.tensor([token for row in sequences for token in row])
    hidden = model.base_model(input_ids=ids.to(device), attention_mask=mask.long().to(device)).last_hidden_state
    last = hidden[torch.arange(len(sequences), device=device), lengths.to(device) - 1]
    return model.score(last)[:, 0].double().tolist()


# ---- judge ----


class Judge:
    """The `judge` built-in (module docstring); `parse(text) -> number` reads an answer (raises or returns None when it
    cannot)."""

    def __init__(
        self,
        url: str,
        model: str,
        rubric: str,
        parse: Callable[[str], Any],
        max_score: float,
        max_tokens: int,
        max_concurrency: int,
        retries: int,
        timeout_s: float,
        api_key: str,
    ) -> None:
        from veomni_lite.engines.vllm.client import Client, Endpoint
        from veomni_lite.engines.vllm.settings import VLLMSettings

        self.url, self.model, self.rubric, self.parse = url, model, rubric, parse
        self.max_score, self.max_tokens, self.max_concurrency, self.retries = (
            max_score,
            max_tokens,
            max_concurrency,
            retries,
        )
        self.client = Client(VLLMSettings(request_timeout_s=timeout_s), api_key)  # its errors name the URL
        self.endpoint = Endpoint(url, None, None)  # type: ignore[arg-type] - no weight sync: no SyncCheck

    def __call__(self, prompts: list[str], completions: list[str], answers: list[Any], **columns: Any) -> list[float]:
        texts = [self._message(i, prompts, completions, answers, columns) for i in range(len(prompts))]
        out: list[float | None] = [None] * len(texts)
        failures: dict[int, RowFailure] = {}
        stop = threading.Event()

        def one(index: int) -> None:
            if stop.is_set():
                return
            try:
                out[index] = self._score(index, texts[index])
            except RowFailure as failure:
                failures[index] = failure
                stop.set()

        with ThreadPoolExecutor(min(self.max_concurrency, max(len(texts), 1)), "judge") as pool:
            list(pool.map(one, range(len(texts))))
        if failures:
            raise failures[min(failures)]
        return [float(value) for value in out]  # type: ignore[arg-type] - every row answered

    def _message(self, index: int, prompts: list[str], completions: list[str], answers: list[Any],
                 columns: Mapping[str, list[Any]]) -> str:  # fmt: skip
        row = {name: values[index] for name, values in columns.items() if values[index] is not None}
        answer = answers[index]
        row |= {"prompt": prompts[index], "response": completions[index], "answer": "" if answer is None else answer}
        try:
            return self.rubric.format_map(row)
        except KeyError as exc:
            raise RowFailure(index, f"the rubric's {{{exc.args[0]}}} is no column of the row") from None

    def _score(self, index: int, text: str) -> float:
        from veomni_lite.engines.vllm.settings import NAME as ENGINE
        from veomni_lite.engines.vllm.settings import EngineError

        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                "max_tokens": self.max_tokens}  # fmt: skip
        what = "the judge's request"
        problem, answer = "", None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
            try:
                answer = self.client.call(self.endpoint, "POST", "/chat/completions", body, what)
                content = answer["choices"][0]["message"]["content"]
                if not isinstance(content, str):
                    raise TypeError(f"content is {type(content).__name__}")
                break
            except (EngineError, KeyError, IndexError, TypeError) as exc:
                problem = f"not a chat completion ({exc!r}): {answer!r}"
                if isinstance(exc, EngineError):  # the client's message, less its "vLLM engine at URL: "
                    problem = str(exc).removeprefix(f"{ENGINE} at {self.url}: ")
        else:
            raise RowFailure(index, f"the judge at {self.url} failed {self.retries + 1} times (retries "
                                    f"{self.retries}); the last: {problem[:600]}")  # fmt: skip
        try:
            value = self.parse(content)
        except Exception as exc:  # noqa: BLE001 - a parser that raises cannot read the answer
            value, why = None, f" ({type(exc).__name__}: {exc})"
        else:
            why = ""
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RowFailure(index, f"the judge at {self.url} answered {content[:300]!r}, which the parser reads as "
                                    f"{value!r}{why}, not a finite number")  # fmt: skip
        return float(value) / self.max_score


def pattern_parser(pattern: re.Pattern[str]) -> Callable[[str], float | None]:
    """The default parser: the last match's first group (the whole match without groups) as a float; None when none."""

    def parse(text: str) -> float | None:
        matches = list(pattern.finditer(text))
        if not matches:
            return None
        last = matches[-1]
        return float(last.group(1) if pattern.groups else last.group(0))

    return parse


# ---- loading ----


def load_model_reward(
    at: str, target: str, options: Mapping[str, Any], base_dir: Path, load_parser: Callable[[str], Callable[..., Any]]
) -> tuple[Callable[..., list[float]], str]:
    """(the batch function, its `where`) of the built-in `target` (`reward_model` or `judge`) from an entry's options;
    a ConfigError naming `at`.<key>. `load_parser` loads a user's 'file.py:function' parser."""
    if target == "reward_model":
        return _reward_model(at, options, base_dir)
    return _judge(at, options, load_parser)


def _reward_model(at: str, options: Mapping[str, Any], base_dir: Path) -> tuple[RewardModelScorer, str]:
    import json

    path, suffix = options.get("path"), options.get("suffix")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{at}.path: the built-in 'reward_model' needs the reward model's directory, got {path!r}")
    if suffix is not None and not isinstance(suffix, str):
        raise ConfigError(f"{at}.suffix: expected a string, got {suffix!r}")
    directory = Path(path).expanduser()
    directory = directory if directory.is_absolute() else base_dir / directory
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{at}.path: {directory} is not a model directory (no config.json)")
    config = json.loads((directory / "config.json").read_text())
    architectures = config.get("architectures") or []
    labels = len(config["id2label"]) if config.get("id2label") else 2  # transformers' default is 2, then not written
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures) or labels != 1:
        raise ConfigError(
            f"{at}.path: {directory} is not a reward model (architectures {architectures}, {labels} labels); expected "
            "a ...ForSequenceClassification with one label (a `pref.loss: bradley_terry` run's export)"
        )
    batch_size = _positive_int(at, "batch_size", options.get("batch_size", 8))
    device, dtype = options.get("device", "auto"), options.get("dtype", "float32")
    try:
        if device != "auto":
            torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{at}.device: {device!r} is not a device (auto, cpu, cuda, cuda:N): {exc}") from exc
    if dtype not in _DTYPES:
        raise ConfigError(f"{at}.dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
    return RewardModelScorer(str(directory), suffix, batch_size, str(device), dtype), f"reward model {directory}"


def _judge(at: str, options: Mapping[str, Any], load_parser: Callable[[str], Callable[..., Any]]) -> tuple[Judge, str]:
    for required in ("url", "model", "rubric"):
        if not isinstance(options.get(required), str) or not options[required]:
            raise ConfigError(f"{at}.{required}: the built-in 'judge' needs it, a non-empty string "
                              f"(got {options.get(required)!r})")  # fmt: skip
    url, rubric = options["url"].rstrip("/"), options["rubric"]
    if not re.match(r"https?://", url):
        raise ConfigError(
            f"{at}.url: {url!r} is not an http(s) URL (the server's OpenAI base, e.g. http://host:8000/v1)"
        )
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(rubric) if name is not None}
    except ValueError as exc:
        raise ConfigError(f"{at}.rubric: not a format template ({exc}); double a literal brace: {{{{ }}}}") from exc
    if not fields & {"response"}:
        raise ConfigError(f"{at}.rubric: the rubric never shows the judge the {{response}}")
    bad = sorted(name for name in fields if not name.isidentifier())
    if bad:
        raise ConfigError(f"{at}.rubric: {{{bad[0]}}} is not a field: use {{prompt}}, {{response}}, {{answer}} or a "
                          "column name (a literal brace doubled)")  # fmt: skip
    if "parser" in options and "pattern" in options:
        raise ConfigError(f"{at}.parser: give a parser or a pattern, not both")
    if "parser" in options:
        if not isinstance(options["parser"], str):
            raise ConfigError(f"{at}.parser: expected 'path/to/file.py:function', got {options['parser']!r}")
        parse = load_parser(options["parser"])
    else:
        pattern = options.get("pattern", DEFAULT_PATTERN)
        try:
            parse = pattern_parser(re.compile(pattern))
        except (re.error, TypeError) as exc:
            raise ConfigError(f"{at}.pattern: {pattern!r} is not a valid regular expression: {exc}") from exc
    max_score = options.get("max_score", 10)
    if isinstance(max_score, bool) or not isinstance(max_score, numbers.Real) or not 0 < max_score < math.inf:
        raise ConfigError(f"{at}.max_score: expected a positive number, got {max_score!r}")
    timeout_s = options.get("timeout_s", 60)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf:
        raise ConfigError(f"{at}.timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    retries = options.get("retries", 3)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"{at}.retries: expected a whole number >= 0, got {retries!r}")
    key_env, api_key = options.get("api_key_env", ""), ""
    if key_env:
        if not isinstance(key_env, str) or not os.environ.get(key_env):
            raise ConfigError(f"{at}.api_key_env: the environment variable {key_env!r} is not set")
        api_key = os.environ[key_env]
    max_tokens = _positive_int(at, "max_tokens", options.get("max_tokens", 512))
    concurrency = _positive_int(at, "max_concurrency", options.get("max_concurrency", 8))
    judge = Judge(url, options["model"], rubric, parse, float(max_score), max_tokens, concurrency, retries,
                  float(timeout_s), api_key)  # fmt: skip
    return judge, f"judge {options['model']!r} at {url}"


def _positive_int(at: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{at}.{key}: expected a whole number >= 1, got {value!r}")
    return value
