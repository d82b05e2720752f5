"""On-policy distillation's teacher (`veomni_lite.rl.teacher`): a teacher directory's log-probabilities are its own
of each sampled sequence alone (batched over sequences of different lengths); a vLLM server's prompt log-probabilities
(a fake one serving the same model) give the same values; through the trainer, every rollout holds the teacher's
log-probabilities and the run logs the reverse KL, with no reward; a teacher with another tokenizer (a directory or a
server) is a config error naming both; the stage on 2 ranks equals one process, and a teacher failing on one rank is
the same named error on every rank; bad entries are config errors naming the key."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from veomni_lite.config import ConfigError
from veomni_lite.rl.rollouts import RolloutSample
from veomni_lite.rl.teacher import (
    LocalTeacher,
    ServedTeacher,
    TeacherError,
    TeacherSettings,
    make_teacher,
    teacher_logprobs,
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The math demo's problems and student, and a larger teacher with the student's tokenizer, stored in float64."""
    from examples.distill_math import TEACHER, write_teacher
    from examples.rl_math import write_demo

    out = write_demo(tmp_path_factory.mktemp("demo"), sft_rows=16, rl_rows=16, eval_rows=4)
    write_teacher(out, rows=8, hidden_size=64, layers=3)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out / TEACHER))
    model.to(torch.float64).save_pretrained(str(out / TEACHER), safe_serialization=True)
    return out


def _teacher_dir(demo: Path) -> str:
    return str(demo / "models/qwen2_math_teacher")


def _alone(directory: str, sequences: list[tuple[list[int], int]]) -> list[list[float]]:
    """Each sequence's last n tokens' log-probabilities under the model, the sequence alone (float64)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for ids, n in sequences:
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
            out.append([float(logp[t - 1, ids[t]]) for t in range(len(ids) - n, len(ids))])
    return out


SEQUENCES = [([5, 9, 12, 40, 7], 2), ([3, 8, 1], 1), ([11, 2, 30, 4, 4, 19, 23, 6], 5), ([2, 50, 60], 2)]


def test_a_teacher_directorys_logprobs_are_its_own_of_each_sequence_alone(demo):
    directory = _teacher_dir(demo)
    teacher = LocalTeacher(TeacherSettings.parse({"pretrained_dir": directory, "batch_size": 3, "dtype": "float64"}))
    got = teacher.logprobs(SEQUENCES)  # batches of 3: right-padded under the attention mask
    expected = _alone(directory, SEQUENCES)
    assert [len(g) for g in got] == [n for _, n in SEQUENCES]
    for row, (values, reference) in enumerate(zip(got, expected)):
        assert values == pytest.approx(reference, rel=1e-12, abs=1e-12), row
    # control: the values read one position off are not the model's
    assert got[2] != pytest.approx(_alone(directory, [(SEQUENCES[2][0], 6)])[0][:5], abs=1e-6)


def _ids(tokenizer: Any) -> list[int]:
    """A probe prompt's ids as the student renders it (chat markup and text)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Tom has 3 apples and buys 4 more."}],
                                         tokenize=False, add_generation_prompt=True)  # fmt: skip
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class _Server:
    """A fake vLLM serving `directory`'s model: /v1/models, /tokenize with `tokenizer_dir`'s tokenizer, and
    /v1/completions' prompt log-probabilities (None at the first position, {id: {logprob}} after, as vLLM)."""

    def __init__(self, directory: str, tokenizer_dir: str) -> None:
        from veomni_lite.models.pretrained import load_tokenizer

        teacher = LocalTeacher(TeacherSettings.parse({"pretrained_dir": directory, "dtype": "float64"}))
        tokenizer = load_tokenizer(tokenizer_dir)
        self.requests: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer({"data": [{"id": "teacher"}]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append({"route": self.path, **body})
                if self.path == "/tokenize":
                    return self._answer({"tokens": tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]})
                ids = body["prompt"]
                values = teacher.logprobs([(ids, len(ids) - 1)])[0]
                entries = [None] + [{str(t): {"logprob": v, "rank": 1}} for t, v in zip(ids[1:], values)]
                self._answer({"choices": [{"text": "", "prompt_logprobs": entries}]})

            def _answer(self, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture()
def served(demo) -> Iterator[Any]:
    servers = []

    def start(tokenizer_dir: str | None = None) -> _Server:
        servers.append(_Server(_teacher_dir(demo), tokenizer_dir or _teacher_dir(demo)))
        return servers[-1]

    yield start
    for server in servers:
        server.httpd.shutdown()


def test_a_served_teachers_prompt_logprobs_are_the_directorys(demo, served):
    from veomni_lite.models.pretrained import load_tokenizer

    server = served()
    student = str(demo / "models/qwen2_math")
    tokenizer = load_tokenizer(student)
    teacher = make_teacher({"url": server.url, "max_concurrency": 2}, student, tokenizer, _ids(tokenizer), False)
    assert isinstance(teacher, ServedTeacher)
    for values, reference in zip(teacher.logprobs(SEQUENCES), _alone(_teacher_dir(demo), SEQUENCES), strict=True):
        assert values == pytest.approx(reference, rel=1e-12)
    completions = [r for r in server.requests if r["route"] == "/v1/completions"]
    assert sorted(r["prompt"] for r in completions) == sorted(ids for ids, _ in SEQUENCES)  # concurrent
    assert all(r["model"] == "teacher" and r["prompt_logprobs"] == 0 and r["max_tokens"] == 1 for r in completions)


def test_a_teacher_with_another_tokenizer_is_a_config_error_naming_both(demo, served, tmp_path):
    from examples.rl_math import write_chat_tokenizer
    from veomni_lite.models.pretrained import load_tokenizer

    student = str(demo / "models/qwen2_math")
    tokenizer = load_tokenizer(student)
    other = tmp_path / "other"
    write_chat_tokenizer(other, ["completely different words", "a tokenizer of its own"] * 20, 300)
    (other / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"the teacher {other} has another tokenizer than the student {student}"):
        make_teacher({"pretrained_dir": str(other)}, student, tokenizer, [], False)
    server = served(str(other))
    with pytest.raises(ConfigError, match=rf"the teacher at {server.url} tokenizes the probe .* the student {student}"):
        make_teacher({"url": server.url}, student, tokenizer, _ids(tokenizer), False)
    refused = r"rl.teacher.url: .* at http://127.0.0.1:9: list the served models .*refused"
    with pytest.raises(ConfigError, match=refused):
        make_teacher({"url": "http://127.0.0.1:9", "request_timeout_s": 5}, student, tokenizer, [], False)
    with pytest.raises(ConfigError, match="rl.teacher: distillation scores text sequences; the policy is a vision"):
        make_teacher({"pretrained_dir": _teacher_dir(demo)}, student, tokenizer, [], True)
    # control: the teacher's own copy of the student's tokenizer passes
    assert make_teacher({"pretrained_dir": _teacher_dir(demo)}, student, tokenizer, [], False) is not None


@pytest.mark.slow
def test_an_rl_run_with_a_teacher_and_no_reward_distills(demo, tmp_path):
    """Through the trainer, no reward: every rollout holds the teacher's log-probabilities of its response (the
    teacher's own, each sequence alone), its advantage from the (absent) rewards is 0, and the run logs the reverse
    KL."""
    from tests.rl.test_rl_generation import math_args
    from tests.trainer.helpers import read_events
    from veomni_lite.config import load_config
    from veomni_lite.rl.config import RLConfig
    from veomni_lite.rl.trainer import RLTrainer

    teacher = f"{{pretrained_dir: '{_teacher_dir(demo)}', coef: 0.5, batch_size: 3, dtype: float64}}"
    args = math_args(demo, tmp_path / "run", "--rl.rewards", "[]", "--rl.kl_coef", "0", "--rl.teacher", teacher,
                     "--train.max_steps", "1")  # fmt: skip
    config = load_config(None, args, sections={"rl": RLConfig})
    trainer = RLTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    assert trainer.policy.teacher_coef == 0.5
    samples = trainer.rollouts.last
    sequences = [(s.prompt_ids + s.response_ids, len(s.response_ids)) for s in samples]
    expected = _alone(_teacher_dir(demo), sequences)
    assert len(samples) == 16
    for sample, reference in zip(samples, expected):
        assert sample.teacher_logprobs == pytest.approx(reference, rel=1e-12, abs=1e-12)
        assert sample.advantage == 0.0 and sample.reward == 0.0
    events = [e for e in read_events(trainer.output_dir) if "rl/teacher/reverse_kl" in e]
    assert events and all(e["rl/teacher/reverse_kl"] == e["rl/teacher/reverse_kl"] for e in events)  # logged, not NaN


class _FakeTeacher:
    """log p = -(id + position) / 100 of each response token; raises on rank `fail_rank`."""

    def __init__(self, rank: int, fail_rank: int | None) -> None:
        self.settings = TeacherSettings(url="http://fake", batch_size=3)
        self.rank, self.fail_rank = rank, fail_rank

    def logprobs(self, sequences: list[tuple[list[int], int]]) -> list[list[float]]:
        if self.rank == self.fail_rank:
            raise RuntimeError("the teacher's server answered HTTP 500")
        return [[-(ids[t] + t) / 100 for t in range(len(ids) - n, len(ids))] for ids, n in sequences]


def _samples() -> list[RolloutSample]:
    return [RolloutSample(group=i // 2, prompt_ids=[1 + i, 2], response_ids=list(range(3, 3 + i % 4 + 1)))
            for i in range(11)]  # fmt: skip


def _stage(rank: int, world: int, fail_rank: int | None) -> Any:
    import torch.distributed as dist

    group = dist.group.WORLD if world > 1 else None
    context = SimpleNamespace(teacher=_FakeTeacher(rank, fail_rank), control_group=group,
                              parallel=SimpleNamespace(rank=rank, world_size=world))  # fmt: skip
    samples = _samples()
    try:
        teacher_logprobs(context, samples, "rollout batch 3")
    except TeacherError as exc:
        return str(exc)
    return [s.teacher_logprobs for s in samples]


@pytest.mark.slow
def test_the_stage_on_two_ranks_is_one_process_and_a_failure_on_one_rank_is_every_ranks():
    from tests.dist_helpers import run_distributed

    single = _stage(0, 1, None)
    assert single == [[-(s.response_ids[i] + len(s.prompt_ids) + i) / 100 for i in range(len(s.response_ids))]
                      for s in _samples()]  # fmt: skip
    assert run_distributed(_stage, 2, None, timeout_s=120) == [single, single]
    messages = run_distributed(_stage, 2, 1, timeout_s=120, pg_timeout_s=30)
    expected = "rollout batch 3: the teacher http://fake: rank 1: the teacher's server answered HTTP 500"
    assert messages == [expected, expected]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({}, "rl.teacher: set pretrained_dir .* or url .*, exactly one"),
        ({"pretrained_dir": "x", "url": "http://h"}, "exactly one"),
        ({"pretrained_dir": "/nonexistent"}, "rl.teacher.pretrained_dir: /nonexistent holds no config.json"),
        ({"url": "http://h", "coef": 0}, "rl.teacher.coef: must be > 0, got 0"),
        ({"url": "http://h", "dtype": "int8"}, "rl.teacher.dtype: one of"),
        ({"url": "http://h", "coeff": 1}, "rl.teacher.coeff.*coef"),
    ],
)
def test_bad_teacher_entries_are_config_errors_naming_the_key(entry, message):
    with pytest.raises(ConfigError, match=message):
        TeacherSettings.parse(entry)


def test_a_teacher_makes_rewards_optional_and_sets_the_losss_coefficient(demo, tmp_path):
    from tests.rl.test_rl_generation import math_args
    from veomni_lite.config import load_config
    from veomni_lite.rl.config import RLConfig
    from veomni_lite.rl.policy_loss import PolicyLoss

    args = math_args(demo, tmp_path, "--rl.rewards", "[]")
    with pytest.raises(ConfigError, match="rl.rewards: give at least one reward function .*, or rl.teacher"):
        load_config(None, args, sections={"rl": RLConfig})
    config = load_config(None, [*args, "--rl.teacher.url", "http://h", "--rl.teacher.coef", "0.3"],
                         sections={"rl": RLConfig})  # fmt: skip
    assert PolicyLoss.of(config.rl).teacher_coef == 0.3
    assert PolicyLoss.of(load_config(None, math_args(demo, tmp_path), sections={"rl": RLConfig}).rl).teacher_coef == 0
