"""Model-based rewards (`veomni_lite.rl.model_rewards`): a reward model's reward is transformers' own score of the
sequence the preference data path encodes for the same prompt and response (batched over rows of different lengths;
a different rendering, or a score read at the padded end, is not); an LLM judge behind a local OpenAI-compatible
server is parsed, concurrent up to its limit, retried, and a judge failing after its retries is a RewardError naming
the reward, the URL and the row, the same on every rank; bad entries are config errors naming the key."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from veomni_lite.config import ConfigError
from veomni_lite.rl import model_rewards
from veomni_lite.rl.rewards import RewardError, load_rewards, score

QUESTIONS = [
    "What is 2 + 3?",
    "Name a colour.",
    "Say hello in a long and very polite sentence, please.",
    "Hi",
    "7 * 6?",
]
ANSWERS = ["5", "The colour of the sky is blue.", "Good day to you, dear friend, and hello.", "Hello there", "42"]


# ---- reward model ----


def write_reward_model(directory: Path, tokenizer: Any) -> Path:
    """A tiny Qwen2 reward model as `make train-rm` exports it (`HFRewardModel`'s `...ForSequenceClassification`,
    one label) with `tokenizer`, stored in float64; its score head scaled up so that scores are O(1)."""
    from transformers import Qwen2Config

    from veomni_lite.models.hf_reward_model import HFRewardModel

    tokenizer.save_pretrained(str(directory))
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HFRewardModel.from_config(config).hf_model
    with torch.no_grad():
        model.score.weight.normal_(0.0, 10.0)
    model.to(torch.float64).save_pretrained(str(directory), safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`write_reward_model` with the demo's ChatML tokenizer."""
    from examples.sft_demo import write_tokenizer

    directory = tmp_path_factory.mktemp("reward_model")
    return write_reward_model(directory, write_tokenizer(directory, QUESTIONS + ANSWERS, vocab_size=300))


def _rendered_prompts(directory: Path) -> list[str]:
    from veomni_lite.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer(directory)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS]  # fmt: skip


def _trained_sides(directory: Path, messages: list[list[dict[str, str]]] | None = None) -> list[list[int]]:
    """Each conversation (default: each question and its answer) as the preference data path encodes a pair's side
    (`PairEncoder`: the prompt's turns frozen, then the last turn, the assistant's response)."""
    from veomni_lite.data.sft import ChatEncoder, Conversation, Turn
    from veomni_lite.models.pretrained import load_tokenizer

    if messages is None:
        messages = [
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in zip(QUESTIONS, ANSWERS)
        ]
    encoder = ChatEncoder(load_tokenizer(directory))
    turns = [[Turn(m["role"], [m["content"]], train=m is row[-1]) for m in row] for row in messages]
    return [encoder.encode(Conversation(row), [], f"row {i}").input_ids for i, row in enumerate(turns)]


def _own_scores(directory: Path, sequences: list[list[int]], dtype: torch.dtype = torch.float64) -> list[float]:
    """transformers' own score of each sequence, one unpadded forward each."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=dtype).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in sequences]


def test_the_reward_models_reward_is_its_own_score_of_the_sequence_it_was_trained_on(reward_dir):
    spec = {"name": "rm", "function": "reward_model", "path": str(reward_dir), "batch_size": 2}
    (reward,) = load_rewards([spec | {"dtype": "auto"}])  # the directory's float64
    prompts = _rendered_prompts(reward_dir)
    sides = _trained_sides(reward_dir)
    assert len({len(ids) for ids in sides}) == len(sides)  # every row another length: batches of 2 pad
    expected = _own_scores(reward_dir, sides)
    assert all(abs(value) > 0.1 for value in expected)
    # float64, batched and padded against one unpadded forward each: the same tokens read at the same position
    assert reward(prompts, ANSWERS, [None] * 5, [{}] * 5) == pytest.approx(expected, rel=1e-12, abs=0)
    # the default float32: within float32's rounding of two layers (the batched and the unpadded forward round
    # differently, measured up to 7e-6 relative; 2**-23 ~ 1.2e-7 per operation)
    (reward,) = load_rewards([spec])
    float32 = _own_scores(reward_dir, sides, torch.float32)
    assert reward(prompts, ANSWERS, [None] * 5, [{}] * 5) == pytest.approx(float32, rel=1e-4, abs=0)
    assert float32 == pytest.approx(expected, rel=1e-4, abs=0)
    tokenizer = model_rewards._load(str(reward_dir), "auto", "float32")[0]
    assert model_rewards.end_of_turn_text(tokenizer) == "<|im_end|>\n"

    # negative controls: another rendering (the old one: the whole text tokenized at once, without the end of turn)
    # scores otherwise, and so does the score read at the padded batch's last position (transformers' pooling with a
    # pad id that is not the config's)
    tokenizer, model, _ = model_rewards._load(str(reward_dir), "auto", "auto")
    whole = [tokenizer(p + a, add_special_tokens=False)["input_ids"] for p, a in zip(prompts, ANSWERS)]
    assert all(abs(o - e) > 1e-3 for o, e in zip(_own_scores(reward_dir, whole), expected))
    longest = max(len(ids) for ids in sides)
    filler = model.config.pad_token_id + 1
    padded = torch.tensor([ids + [filler] * (longest - len(ids)) for ids in sides])
    mask = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids in sides])
    with torch.no_grad():
        at_the_end = model(input_ids=padded, attention_mask=mask).logits[:, 0].tolist()
    shorter = [i for i, ids in enumerate(sides) if len(ids) < longest]
    assert all(abs(at_the_end[i] - expected[i]) > 1e-3 for i in shorter)


def test_weights_and_per_reward_values_combine_a_reward_model_with_the_other_rewards(reward_dir):
    rewards = load_rewards([
        {"name": "rm", "function": "reward_model", "path": str(reward_dir), "weight": 0.5, "device": "cpu"},
        {"name": "exact", "function": "exact_match", "weight": 2.0},
    ])  # fmt: skip
    prompts = _rendered_prompts(reward_dir)
    completions = ["5", "red", "hello", "Hello there", "41"]
    total, each = score(rewards, prompts, completions, ANSWERS, [{}] * 5, [f"row {i}" for i in range(5)])
    alone = rewards[0](prompts, completions, [None] * 5, [{}] * 5)
    assert each["rm"].tolist() == alone
    assert each["exact"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert torch.equal(total, 0.5 * each["rm"] + 2.0 * each["exact"])


@pytest.mark.slow
def test_an_rl_runs_reward_model_reward_is_the_models_own_score_of_each_rollouts_conversation(tmp_path):
    """Through the trainer: every rollout's `rm` reward is the reward model's own score of the row's prompt messages
    and the rollout's response, encoded as a preference pair's side."""
    from examples.rl_math import write_demo
    from tests.rl.test_rl_generation import math_args
    from veomni_lite.config import load_config
    from veomni_lite.models.pretrained import load_tokenizer
    from veomni_lite.rl.config import RLConfig
    from veomni_lite.rl.trainer import RLTrainer

    demo = write_demo(tmp_path / "demo", sft_rows=16, rl_rows=16, eval_rows=4)
    rm = write_reward_model(tmp_path / "rm", load_tokenizer(demo / "models/qwen2_math"))
    rewards = f"[{{name: rm, function: reward_model, path: '{rm}', batch_size: 3, dtype: auto, weight: 0.5}}]"
    args = math_args(demo, tmp_path / "run", "--rl.rewards", rewards, "--train.max_steps", "1")
    trainer = RLTrainer(load_config(None, args, sections={"rl": RLConfig}))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    samples = trainer.rollouts.last
    rows = [json.loads(line) for line in (demo / "rl_train.jsonl").read_text().splitlines() if line.strip()]
    conversations = []
    for sample in samples:
        messages = rows[int(re.search(r"row (\d+)", sample.where).group(1))]["messages"]
        prompt = messages[:-1] if messages[-1]["role"] == "assistant" else messages  # the RL prompt: no reply
        conversations.append([*prompt, {"role": "assistant", "content": sample.response_text}])
    sides = _trained_sides(rm, conversations)
    assert len(samples) == 16 and len({len(ids) for ids in sides}) > 1  # batches of 3 pad
    expected = _own_scores(rm, sides)
    assert [s.rewards["rm"] for s in samples] == pytest.approx(expected, rel=1e-12, abs=0)
    assert [s.reward for s in samples] == pytest.approx([0.5 * e for e in expected], rel=1e-12, abs=0)


def test_a_sequence_classifier_without_a_decoders_score_head_is_a_named_error(reward_dir, tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from veomni_lite.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer(reward_dir)
    tokenizer.save_pretrained(str(tmp_path))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=1)  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(str(tmp_path))
    (reward,) = load_rewards([{"name": "rm", "function": "reward_model", "path": str(tmp_path)}])
    with pytest.raises(RewardError, match=r"batch row 0: BertForSequenceClassification has no `score` head over"):
        reward(["q"], ["a"], [None], [{}])


# ---- judge ----


class _JudgeServer:
    """A local OpenAI-compatible chat server: answers "... Score: N" where N is the number after "Response: " in the
    user message; counts requests and requests in flight; fails its first `fail_first` requests with HTTP 500, and
    every request whose message holds `fail_on`."""

    def __init__(self, delay_s: float = 0.0, fail_first: int = 0, fail_on: str = "\0", answer: str = "") -> None:
        self.delay_s, self.fail_first, self.fail_on, self.answer = delay_s, fail_first, fail_on, answer
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append({"path": self.path, "body": body, "auth": self.headers["Authorization"]})
                    failing = len(server.requests) <= server.fail_first
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                time.sleep(server.delay_s)
                with server.lock:
                    server.in_flight -= 1
                text = body["messages"][0]["content"]
                if failing or server.fail_on in text:
                    self._send(500, {"error": "judge overloaded"})
                    return
                found = re.search(r"Response: (\d+)", text)
                content = server.answer or f"The response is fine. Score: {found.group(1) if found else 'none'}"
                self._send(200, {"choices": [{"message": {"role": "assistant", "content": content}}]})

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def judge_server() -> Iterator[Any]:
    servers: list[_JudgeServer] = []

    def start(**kwargs: Any) -> _JudgeServer:
        servers.append(_JudgeServer(**kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_rewards, "RETRY_BACKOFF_S", 0.0)


RUBRIC = "Grade the response to {prompt} (reference {answer}, topic {topic}).\nResponse: {response}\nEnd with Score: N"


def _judge(url: str, **options: Any) -> Any:
    spec = {"name": "judge", "function": "judge", "url": url, "model": "grader", "rubric": RUBRIC} | options
    return load_rewards([spec])[0]


def test_the_judge_fills_the_rubric_parses_the_score_and_scales_it(judge_server, monkeypatch):
    server = judge_server()
    monkeypatch.setenv("JUDGE_KEY", "secret")
    reward = _judge(server.url, max_score=5, api_key_env="JUDGE_KEY")
    completions = ["3", "5", "0"]
    got = reward(["q0", "q1", "q2"], completions, ["a", None, "c"], [{"topic": "sums"}] * 3)
    assert got == [0.6, 1.0, 0.0]
    first = next(
        r for r in server.requests if r["body"]["messages"][0]["content"].endswith("Response: 3\nEnd with Score: N")
    )
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer secret"
    assert first["body"] == {
        "model": "grader", "temperature": 0.0, "max_tokens": 512,
        "messages": [{"role": "user", "content": RUBRIC.format(prompt="q0", answer="a", topic="sums", response="3")}],
    }  # fmt: skip


def test_a_parser_of_ones_own_and_an_unreadable_answer(judge_server, tmp_path):
    (tmp_path / "parse.py").write_text("def stars(text):\n    return text.count('*')\n")
    server = judge_server(answer="I give it ***")
    spec = {"name": "j", "function": "judge", "url": server.url, "model": "m", "rubric": "{response}",
            "parser": "parse.py:stars", "max_score": 4}  # fmt: skip
    (reward,) = load_rewards([spec], tmp_path)
    assert reward(["q"], ["r"], [None], [{}]) == [0.75]
    (reward,) = load_rewards([{k: v for k, v in spec.items() if k != "parser"} | {"pattern": r"\d+"}], tmp_path)
    with pytest.raises(RewardError) as caught:
        reward(["q"], ["r"], [None], [{}], ["data/rl.jsonl, row 4 (0-based)"])
    assert str(caught.value) == (
        f"reward 'j' (judge 'm' at {server.url}), data/rl.jsonl, row 4 (0-based): the judge at {server.url} answered "
        "'I give it ***', which the parser reads as None, not a finite number"
    )
    assert len(server.requests) == 2  # an unreadable answer is not asked again


def test_judge_requests_overlap_up_to_max_concurrency(judge_server):
    server = judge_server(delay_s=0.2)
    reward = _judge(server.url, max_concurrency=4)
    completions = [str(i) for i in range(8)]
    assert reward(["q"] * 8, completions, [None] * 8, [{"topic": "t"}] * 8) == [i / 10 for i in range(8)]
    assert 2 <= server.max_in_flight <= 4
    # control: one at a time
    serial = judge_server(delay_s=0.05)
    _judge(serial.url, max_concurrency=1)(["q"] * 4, completions[:4], [None] * 4, [{"topic": "t"}] * 4)
    assert serial.max_in_flight == 1 and len(serial.requests) == 4


def test_failed_judge_requests_are_retried_with_exponential_backoff(judge_server, monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(model_rewards, "time", SimpleNamespace(sleep=waits.append))
    monkeypatch.setattr(model_rewards, "RETRY_BACKOFF_S", 0.5)
    server = judge_server(fail_first=2)
    reward = _judge(server.url, retries=2, max_concurrency=1)
    assert reward(["q", "q"], ["7", "9"], [None] * 2, [{"topic": "t"}] * 2) == [0.7, 0.9]
    assert len(server.requests) == 4  # row 0: two failures, then its answer; row 1: its answer
    assert waits == [0.5, 1.0]


def test_a_judge_failing_after_its_retries_is_a_reward_error_naming_the_reward_the_url_and_the_row(judge_server):
    server = judge_server(fail_on="Response: 2")
    reward = _judge(server.url, retries=2, max_concurrency=1)
    rows = [f"data/rl.jsonl, row {i} (0-based)" for i in range(4)]
    with pytest.raises(RewardError) as caught:
        reward(["q"] * 4, ["1", "2", "3", "4"], [None] * 4, [{"topic": "t"}] * 4, rows)
    message = str(caught.value)
    assert message.startswith(
        f"reward 'judge' (judge 'grader' at {server.url}), data/rl.jsonl, row 1 (0-based): the judge at {server.url} "
        "failed 3 times (retries 2); the last: "
    )
    assert message.endswith(
        """the last: the judge's request (POST /chat/completions) answered HTTP 500: {"error": "judge overloaded"}"""
    )
    assert len(server.requests) == 1 + 3  # row 0, then row 1 three times; the rows after it are not sent
    # a refused connection (nothing listening) is retried and named alike
    server.close()
    with pytest.raises(RewardError, match=rf"at {re.escape(server.url)} failed 3 times .*Connection refused"):
        reward(["q"], ["1"], [None], [{"topic": "t"}])
    # a rubric field the row lacks is its error
    with pytest.raises(RewardError, match=r"row 0 \(0-based\): the rubric's \{topic\} is no column of the row"):
        reward(["q"], ["1"], [None], [{}], rows[:1])


def _judge_then_agree(rank: int, world_size: int, url: str) -> str:
    from veomni_lite.distributed.collectives import agree

    model_rewards.RETRY_BACKOFF_S = 0.0
    (reward,) = load_rewards([{"name": "judge", "function": "judge", "url": url, "model": "grader",
                               "rubric": "Response: {response}", "retries": 1}])  # fmt: skip
    completions = ["4", "2"] if rank == 1 else ["4", "5"]  # the server fails on "Response: 2": rank 1's second row
    rows = [f"data/rl.jsonl, row {2 * rank + i} (0-based)" for i in range(2)]
    problem = None
    try:
        total, _ = score([reward], ["q", "q"], completions, [None, None], [{}, {}], rows)
    except RewardError as exc:
        problem = exc
    try:
        agree(problem, RewardError)
    except RewardError as exc:
        return str(exc)
    return f"no error; totals {total.tolist()}"


@pytest.mark.slow
def test_a_judge_failing_on_one_rank_is_the_same_named_error_on_every_rank(judge_server):
    from tests.dist_helpers import run_distributed

    server = judge_server(fail_on="Response: 2")
    messages = run_distributed(_judge_then_agree, 2, server.url, timeout_s=120, pg_timeout_s=30)
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        f"rank 1: reward 'judge' (judge 'grader' at {server.url}), data/rl.jsonl, row 3 (0-based): the judge at "
        f"{server.url} failed 2 times (retries 1)"
    )
    # control: no fault on any rank
    server.fail_on = "\0"
    assert run_distributed(_judge_then_agree, 2, server.url, timeout_s=120, pg_timeout_s=30) == [
        "no error; totals [0.4, 0.5]",
        "no error; totals [0.4, 0.2]",
    ]


# ---- config ----


JUDGE = {"function": "judge", "url": "http://x/v1", "model": "m", "rubric": "{response}"}
RM = {"function": "reward_model", "path": "RM"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (RM | {"batch_sise": 4}, r"\.batch_sise: unknown key \(did you mean `batch_size`\?\); the built-in 'reward_m"),
        (JUDGE | {"rubrik": "{response}"}, r"\.rubrik: unknown key \(did you mean `rubric`\?\)"),
        ({"function": "judge", "model": "m", "rubric": "{response}"}, r"\.url: the built-in 'judge' needs it"),
        (JUDGE | {"url": "x:8000"}, r"\.url: 'x:8000' is not an http"),
        (JUDGE | {"rubric": "Rate {prompt}"}, r"\.rubric: the rubric never shows the judge the \{response\}"),
        (JUDGE | {"rubric": "{response} {"}, r"\.rubric: not a format template"),
        (JUDGE | {"pattern": "("}, r"\.pattern: '\(' is not a valid"),
        (JUDGE | {"retries": -1}, r"\.retries: expected a whole number >= 0"),
        (JUDGE | {"max_concurrency": 0}, r"\.max_concurrency: expected a whole number >= 1"),
        (
            JUDGE | {"api_key_env": "VEOMNI_LITE_NO_KEY"},
            r"\.api_key_env: the environment variable 'VEOMNI_LITE_NO_KEY' is",
        ),
        (JUDGE | {"parser": "nowhere.py:f"}, r"\.parser\.function: .*nowhere\.py does not exist"),
        (RM | {"path": "nowhere"}, r"\.path: .*nowhere is not a model directory"),
        (RM | {"device": "gpu7"}, r"\.device: 'gpu7' is not a device"),
        (RM | {"dtype": "fp8"}, r"\.dtype: 'fp8' is not one of"),
        (RM | {"path": "LM"}, r"\.path: .*LM is not a reward model \(architectures \['Qwen2ForCausalLM'\], 2 labels\)"),
    ],
)
def test_bad_model_reward_entries_are_config_errors_naming_the_key(reward_dir, tmp_path, spec, message):
    (tmp_path / "RM").symlink_to(reward_dir)
    (tmp_path / "LM").mkdir()
    (tmp_path / "LM" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"^rl\.rewards\[0\]" + message):
        load_rewards([{"name": "r", **spec}], tmp_path)
